"""An environment from an installed package, end to end on the real broker and object store: demonstrations and
rollouts (with the environment's feedback turns) through the log, scored in streams by its own verifier, a
learner update on them; then a streams worker without the package dead-letters new events of that domain."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from infra.kafka import end_offsets, read_topic
from infra.objectstore import ObjectStore
from infra.settings import Settings
from learner import checkpoint_store
from schemas import codec
from schemas.records import BatchManifest, DeadLetter, EpisodeStarted, RolloutEvent, Trajectory
from schemas.tasks import decode_task_spec
from schemas.topics import Topics
from tests.environment_package import install

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
MODEL = ["--layers", "2", "--width", "64"]


class Services:
    def __init__(self, stack: Settings, ns: str, logs: Path) -> None:
        self.stack, self.ns, self.logs = stack, ns, logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def env(self, site: Path | None) -> dict[str, str]:
        path = os.pathsep.join([str(site), str(ROOT)] if site else [str(ROOT)])
        return {**os.environ, **self.stack.as_env(), "PYTHONPATH": path, "PYTHONUNBUFFERED": "1",
                "TRAJPIPE_STREAMS_RESTARTS": "1000"}  # a failing streams worker exits: the test sees it

    def start(self, name: str, module: str, args: list[str], site: Path | None) -> subprocess.Popen[bytes]:
        log = (self.logs / f"{name}.log").open("ab")
        self.procs[name] = subprocess.Popen([sys.executable, "-m", module, "--ns", self.ns, *args], cwd=ROOT,
                                            env=self.env(site), stdout=log, stderr=subprocess.STDOUT)
        return self.procs[name]

    def finish(self, name: str, timeout: float = 300) -> None:
        assert self.procs[name].wait(timeout=timeout) == 0, self.tail()

    def stop(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGTERM)
        assert self.procs[name].wait(timeout=120) == 0, self.tail()

    def tail(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}" for p in self.logs.glob("*.log"))

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def decoded(stack: Settings, topic: str) -> list[Any]:
    return [codec.decode(m.value()) for m in read_topic(stack, topic, timeout=60)]


def count(stack: Settings, topic: str) -> int:
    return sum(hi - lo for lo, hi in end_offsets(stack, topic, timeout=5).values())


def wait_for(what: str, ok: Any, services: Services, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"waiting for {what}:\n{services.tail()}"
        time.sleep(1)


def vowels(word: str) -> int:
    return sum(ch in "aeiou" for ch in word)


def test_an_installed_environment_runs_end_to_end_and_without_it_new_events_are_dead_lettered(
        stack: Settings, topics: Topics, tmp_path: Path) -> None:
    site = install(tmp_path / "site")
    services = Services(stack, topics.ns, tmp_path)
    producer = ["--sources", "env:vowels", "--group-size", "4", "--prompts-per-step", "2", "--max-new-tokens", "3",
                "--max-policy-lag", "1000", *MODEL]
    try:
        services.start("streams", "streams", ["--episode-timeout-s", "60", "--group-timeout-s", "60"], site)
        services.start("writer", "consumers.shard_writer", ["--max-trajectories", "8", "--max-age-s", "2"], site)
        services.start("learner", "learner", [*MODEL, "--algorithm", "sft", "--max-updates", "1",
                                              "--updates-per-checkpoint", "1", "--cache-dir", str(tmp_path / "c")], site)
        services.start("teacher", "producers", ["--sources", "env:vowels", "--demonstrations", "8", "--producer-id",
                                                "teacher", *MODEL], site)
        services.finish("teacher")
        services.start("rollouts", "producers", [*producer, "--episodes", "8", "--producer-id", "worker"], site)
        services.finish("rollouts")
        services.finish("learner")  # one update on the environment's data, then it exits

        events: list[RolloutEvent] = decoded(stack, topics.events)
        started = {e.episode_id for e in events if isinstance(e.body, EpisodeStarted)}
        assert len(started) == 16 and {e.domain for e in events} == {"env/vowels"}
        wait_for("every episode scored or dropped", lambda: count(stack, topics.trajectories) >= 16, services)
        trajectories: list[Trajectory] = decoded(stack, topics.trajectories)
        assert {t.episode_id for t in trajectories} == started
        for t in trajectories:  # the environment's verifier, checked against the answer independently
            word = decode_task_spec(t.task_spec)["word"]
            said = t.turns[-1].text.strip().split()
            right = bool(said) and said[0] == str(vowels(word))
            assert t.reward_components["outcome/correct"] == float(right), t
            assert {"process/answer_found", "penalty/truncated", "penalty/overlong"} <= set(t.reward_components)
            assert t.reward_fn == "default"
        rollouts = [t for t in trajectories if t.turns[0].policy_version >= 0]
        # a wrong first answer got the environment's feedback and a second turn (the tiny model is rarely right)
        second = [t for t in rollouts if len(t.turns) == 2]
        assert second and all(t.turns[1].obs_text == " wrong, try again:" for t in second)
        assert all(len(t.turns) == 1 for t in trajectories if t.turns[0].policy_version < 0)  # demonstrations

        store_versions = [e for e in checkpoint_store.published(stack, topics) if e.run == topics.ns]
        assert max(e.version for e in store_versions) == 1
        batches = {m.batch_id: m for m in decoded(stack, topics.batches) if isinstance(m, BatchManifest)}
        v1 = checkpoint_store.read_manifest(ObjectStore(stack), topics.ns, 1)
        trained = [i for b in v1.batch_ids for i in batches[b].trajectory_ids]
        assert v1.step == 1 and trained and set(trained) <= {t.trajectory_id for t in trajectories}

        # the package gone from the streams worker: new events of its domain are dead letters, the worker runs on
        services.stop("streams")
        before = count(stack, topics.deadletter)
        services.start("streams", "streams", ["--episode-timeout-s", "60", "--group-timeout-s", "60"], None)
        services.start("more", "producers", [*producer, "--episodes", "4", "--producer-id", "later"], site)
        services.finish("more")
        new = [e for e in decoded(stack, topics.events) if e.producer_id == "later"]
        assert before == 0 and len({e.episode_id for e in new}) == 4
        wait_for("the new events dead-lettered", lambda: count(stack, topics.deadletter) >= before + len(new), services)
        letters: list[DeadLetter] = decoded(stack, topics.deadletter)[before:]
        assert len(letters) == len(new) and {d.reason for d in letters} == {"unknown_environment"}
        assert all("'vowels'" in d.detail and "not installed" in d.detail for d in letters)
        assert services.procs["streams"].poll() is None, services.tail()
        assert {t.episode_id for t in decoded(stack, topics.trajectories)} == started  # nothing new assembled
        services.stop("streams")
        services.stop("writer")
    finally:
        services.close()


def test_terminal_episodes_go_through_the_log_and_are_scored_from_their_recorded_facts(
        stack: Settings, topics: Topics, tmp_path: Path) -> None:
    """The small model's turns are rarely tool calls: each gets the reason as its next observation, the step limit
    ends the episode, and streams scores it from the log (tool errors, no submit); a demonstration's fixing write
    is a valid call."""
    services = Services(stack, topics.ns, tmp_path)
    try:
        services.start("streams", "streams", ["--episode-timeout-s", "60", "--group-timeout-s", "60"], None)
        services.start("rollouts", "producers", ["--sources", "terminal", "--episodes", "4", "--group-size", "2",
                                                 "--prompts-per-step", "2", "--max-new-tokens", "48", "--no-follow",
                                                 "--own-weights", *MODEL], None)
        services.finish("rollouts")
        wait_for("4 trajectories", lambda: count(stack, topics.trajectories) >= 4, services)
        trajectories: list[Trajectory] = decoded(stack, topics.trajectories)
        assert len(trajectories) == 4 and {t.domain for t in trajectories} == {"terminal"}
        for t in trajectories:
            spec = decode_task_spec(t.task_spec, "terminal")
            assert t.status == "truncated" and len(t.turns) == spec["max_steps"] == 8
            executed = [turn for turn in t.turns if turn.outcome]  # a call that parsed ran, and its result is a fact
            errors = [turn for turn in t.turns[1:] if turn.obs_text.startswith("\ntool error:")]
            assert len(executed) + len(errors) >= len(t.turns) - 1
            c = t.reward_components
            assert c["outcome/tests_passed"] == 0.0 and c["penalty/truncated"] == 1.0 and c["penalty/steps"] == 1.0
            assert c["penalty/tool_errors"] == pytest.approx(1 - len(executed) / len(t.turns))
        services.stop("streams")
    finally:
        services.close()
