"""Drives the pipeline's services as processes on a private Kafka + MinIO, for end-to-end tests."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections import Counter, defaultdict
from typing import Callable

from consumers.monitoring import PipelineStats
from infra.kafka import end_offsets, read_topic
from infra.launcher import Launcher
from infra.objectstore import ObjectStore
from infra.settings import Settings
from learner import checkpoint_store
from schemas import codec
from schemas.keys import trajectory_id
from schemas.manifests import CheckpointManifest
from schemas.records import (
    BatchManifest,
    DeadLetter,
    EpisodeEnded,
    EpisodeStarted,
    RolloutEvent,
    SandboxResult,
    Trajectory,
)
from schemas.topics import Topics
from tests.stack import private_launcher

ROOT = Path(__file__).resolve().parents[2]
MODEL = ["--layers", "2", "--width", "64"]


@dataclass
class PipelineRun:
    """A private stack (so a broker restart or a MinIO stop touches no other test) and its services."""

    root: Path
    ns: str = "e2e"
    brokers: int = 1
    launcher: Launcher = field(init=False)
    settings: Settings = field(init=False)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.launcher = private_launcher(self.root / "stack", brokers=self.brokers)
        self.launcher.up()
        self.settings = self.launcher.settings()

    @property
    def topics(self) -> Topics:
        return Topics(self.ns, partitions=2)

    def start(self, name: str, module: str, *argv: str, fault: str = "") -> subprocess.Popen[bytes]:
        """Start `python -m module --ns NS argv`; `fault` sets TRAJPIPE_FAULT (see infra.faults)."""
        env = {**os.environ, **self.settings.as_env(), "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        env.pop("TRAJPIPE_FAULT", None)
        if fault:
            env["TRAJPIPE_FAULT"] = fault
        log = open(self.root / f"{name}.log", "ab")
        proc = subprocess.Popen([sys.executable, "-m", module, "--ns", self.ns, *argv], cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT)
        self.procs[name] = proc
        return proc

    def kill9(self, name: str) -> None:
        proc = self.procs.pop(name)  # a killed process is no failure to report
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)

    def wait_killed(self, name: str, timeout: float = 240.0) -> None:
        """Wait for a process started with a fault to kill itself (SIGKILL), then forget it."""
        try:
            code = self.procs[name].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name} did not reach its fault point; logs:\n{self.logs()}") from None
        assert code == -signal.SIGKILL, f"{name} exited {code}, not by its fault point; logs:\n{self.logs()}"
        self.procs.pop(name)

    def stop(self, name: str, timeout: float = 120.0) -> int:
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                return proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                return -9
        return int(proc.returncode)

    def count(self, topic: str) -> int:
        try:
            return sum(hi - lo for lo, hi in end_offsets(self.settings, topic, timeout=3).values())
        except Exception:
            return -1

    def wait_until(self, what: str, ok: Callable[[], bool], timeout: float = 240.0, every: float = 0.5) -> None:
        deadline = time.monotonic() + timeout
        while not ok():
            dead = [n for n, p in self.procs.items() if p.poll() not in (None, 0)]
            if dead or time.monotonic() > deadline:
                raise AssertionError(f"waiting for {what}: dead {dead}; logs:\n{self.logs()}")
            time.sleep(every)

    def settled(self, topic: str, quiet_s: float = 8.0, timeout: float = 240.0) -> int:
        """The record count of `topic` once it has not grown for quiet_s seconds."""
        last, since = self.count(topic), time.monotonic()
        deadline = time.monotonic() + timeout
        while time.monotonic() - since < quiet_s:
            if time.monotonic() > deadline:
                raise AssertionError(f"{topic} never settled; logs:\n{self.logs()}")
            time.sleep(1.0)
            now = self.count(topic)
            if now != last:
                last, since = now, time.monotonic()
        return last

    def logs(self, tail: int = 1500) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-tail:]}" for p in self.root.glob("*.log"))

    def close(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self.launcher.down()

    def producer_args(self, episodes: int, producer_id: str, seed: int) -> list[str]:
        return ["--sources", "math-easy", "--episodes", str(episodes), "--group-size", "4", "--prompts-per-step",
                "2", "--max-new-tokens", "6", "--max-policy-lag", "1000", "--producer-id", producer_id,
                "--seed", str(seed), *MODEL]


def decode_all(run: PipelineRun, topic: str) -> list:  # type: ignore[type-arg]
    """Every record of `topic`, decoded."""
    return [codec.decode(m.value()) for m in read_topic(run.settings, topic, timeout=120)]


def unclosed_episodes(run: PipelineRun) -> str:
    """'' once every started episode has a trajectory, else a description of those that have none."""
    events: list[RolloutEvent] = decode_all(run, run.topics.events)
    started = {e.episode_id for e in events if isinstance(e.body, EpisodeStarted)}
    missing = started - {t.episode_id for t in decode_all(run, run.topics.trajectories)}
    return describe(missing, events, run) if missing else ""


def every_episode_closed(run: PipelineRun) -> bool:
    return not unclosed_episodes(run)


def describe(episodes: set[str], events: list[RolloutEvent], run: PipelineRun) -> str:
    """The episodes' events, the log lines that name them (any service, any restart), and the logs' tails."""
    rows = [f"{e.producer_id} {e.episode_id} seq={e.seq} {type(e.body).__name__} ts={e.ts}"
            for e in events if e.episode_id in episodes]
    named = [f"{log.name}: {line}" for log in sorted(run.root.glob("*.log"))
             for line in log.read_text(errors="replace").splitlines() if any(ep in line for ep in episodes)]
    dead = [f"{d.stage} {d.reason}: {d.detail[:200]}" for d in decode_all(run, run.topics.deadletter)]
    return (f"{len(episodes)} episodes without a trajectory:\n" + "\n".join(rows[:40])
            + "\n--- log lines naming them\n" + "\n".join(named[:40])
            + f"\n--- {len(dead)} dead letters\n" + "\n".join(dead[:20]) + "\n" + run.logs(4000))


def assert_every_id_accounted_for(run: PipelineRun, orphans: bool) -> list[CheckpointManifest]:
    """Every ended episode in one trajectory id, every scored trajectory in one batch, every batch trained once;
    returns the lineage of announced checkpoints."""
    t = run.topics
    stats = PipelineStats(t)  # the monitor's figures, folded from the same records
    raw = {topic: list(read_topic(run.settings, topic, timeout=120)) for topic in (t.events, t.scored, t.batches, t.metrics)}
    for topic, messages in raw.items():
        for m in messages:
            stats.observe(topic, m.timestamp()[1], m.value())
    events: list[RolloutEvent] = [codec.decode(m.value()) for m in raw[t.events]]
    started = {e.episode_id for e in events if isinstance(e.body, EpisodeStarted)}
    ended = {e.episode_id for e in events if isinstance(e.body, EpisodeEnded)}
    assert len(started) >= 100 and ended <= started

    trajectories: list[Trajectory] = decode_all(run, t.trajectories)
    by_id = {tr.trajectory_id: tr for tr in trajectories}
    # every episode that ended is in exactly one trajectory (ids are derived from the episode: re-emits share it)
    missing = {ep for ep in ended if trajectory_id(ep) not in by_id}
    assert not missing, describe(missing, events, run)
    assert {tr.episode_id for tr in by_id.values()} == started
    in_flight = started - ended  # a killed producer's in-flight episodes: closed by the sweeper, never trained
    assert in_flight or not orphans, "no episode was orphaned"
    assert all(by_id[trajectory_id(ep)].status == "abandoned" for ep in in_flight)
    for tr in by_id.values():  # emitted twice (at least once) means emitted identically
        assert all(codec.encode(x) == codec.encode(tr) for x in trajectories if x.trajectory_id == tr.trajectory_id)

    dead: list[DeadLetter] = decode_all(run, t.deadletter)
    assert dead == [], "\n".join(
        [f"{d.reason} ({d.stage}, {d.source_topic}:{d.partition}@{d.offset}): {d.detail}" for d in dead]
        + [describe({d.key.decode(errors="replace") for d in dead if d.key}, events, run)])

    scored = {codec.decode(m.value(), Trajectory).trajectory_id for m in raw[t.scored]}
    assert scored <= set(by_id)
    # the monitor's figures count each scored trajectory and sandbox result once, whatever a restarted worker
    # sent again
    assert sum(w.n for w in stats.reward.values()) == len(scored), stats.resent
    results = {e.event_id: e.body for e in events if isinstance(e.body, SandboxResult)}
    assert stats.sandbox_outcomes == Counter(r.outcome for r in results.values())
    # the streams worker's own counters, cumulative per partition, count each input and trajectory once
    # across its kills (a replayed batch is not counted again)
    assert stats.service_sum.get(("streams", "streams/events", ""), 0) == len(events)
    statuses = Counter(tr.status for tr in by_id.values())
    assert {status: stats.service_sum.get(("streams", "streams/trajectories", f"status={status}"), 0)
            for status in statuses} == statuses
    manifests: dict[str, BatchManifest] = {}
    for m in decode_all(run, t.batches):
        assert manifests.setdefault(m.batch_id, m) == m  # a republished manifest is the same manifest
    in_batches = Counter(tid for m in manifests.values() for tid in m.trajectory_ids)
    assert set(in_batches) == scored and max(in_batches.values()) == 1  # every scored trajectory in one batch
    # the monitor's latency histogram: one EpisodeEnded -> batch observation per batched trajectory
    assert stats.batch_latency.count == len(in_batches)
    assert stats.checkpoint_latency.count > 0, "no rollout worker reported generating with an announced checkpoint"

    store = ObjectStore(run.settings)
    announced = [e for e in checkpoint_store.published(run.settings, t) if e.run == run.ns]
    final = max(e.version for e in announced)
    lineage = [CheckpointManifest.from_json(store.get(f"checkpoints/{run.ns}/v{v}/manifest.json"))
               for v in range(final + 1)]
    for e in announced:  # no checkpoint lost: every announced one still verifies
        checkpoint_store.load(store, e)
    trained = Counter(b for m in lineage for b in m.batch_ids)
    assert set(trained) == set(manifests) and max(trained.values()) == 1  # every batch trained exactly once
    per_version = defaultdict(list)
    for m in lineage:
        per_version[m.version].append(m)
    assert sorted(per_version) == list(range(final + 1))
    return lineage
