"""Re-scores a replayed namespace by running the streams worker over it until its scored output stops growing.

    summary = rescore(settings, "run1-r2", "default:2", compare_ns="run1")
    print(format_summary(summary))
"""
from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

from confluent_kafka import TopicPartition

from infra.kafka import committed_offsets, consumer, end_offsets, read_topic
from infra.settings import Settings
from schemas.codec import codec
from schemas.errors import ConfigError, DecodeError, PipelineError
from schemas.records import Trajectory
from schemas.topics import Topics

STOP_GRACE_S = 30.0


@dataclass
class RewardSummary:
    trajectories: int = 0
    by_reward: dict[str, int] = field(default_factory=dict)  # "name:version" -> count
    mean_by_domain: dict[str, float] = field(default_factory=dict)
    compared: int = 0  # trajectories present in both namespaces
    changed: int = 0  # of those, how many got a different reward
    mean_delta: float = 0.0


def parse_reward(text: str) -> tuple[str, str]:
    name, sep, version = text.partition(":")
    if not sep or not name or not version:
        raise ConfigError(f"reward {text!r}: write name:version, e.g. default:2")
    return name, version


def scored_count(settings: Settings, ns: str) -> int:
    return sum(hi - lo for lo, hi in end_offsets(settings, Topics(ns).scored).values())


def consumed_all(settings: Settings, ns: str) -> Optional[bool]:
    """Whether the streams app's group has committed the whole events topic; None when it has no commits."""
    topics = Topics(ns)
    ends = end_offsets(settings, topics.events)
    c = consumer(settings, topics.streams_app_id)
    try:
        committed = committed_offsets(c, [TopicPartition(topics.events, p) for p in ends])
    finally:
        c.close()
    if all(tp.offset < 0 for tp in committed):
        return None
    return all(tp.offset >= ends[tp.partition][1] for tp in committed if ends[tp.partition][1] > 0)


def settled(history: list[tuple[float, int]], settle_s: float, all_consumed: Optional[bool]) -> bool:
    """The output count has not moved for settle_s seconds, and the input is consumed (or output exists)."""
    if not history or history[-1][0] - history[0][0] < settle_s:
        return False
    now, count = history[-1]
    steady = all(c == count for t, c in history if now - t <= settle_s)
    return steady and (all_consumed is True or (all_consumed is None and count > 0))


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_streams(settings: Settings, ns: str, reward: str, settle_s: float = 15.0, timeout_s: float = 900.0,
                log_path: Optional[Path] = None) -> int:
    """Start `python -m streams --ns NS --reward R`, wait until the scored output settles, stop it; the count."""
    parse_reward(reward)
    log_path = log_path or Path(tempfile.mkstemp(prefix=f"streams-{ns}-", suffix=".log")[1])
    env = {**os.environ, **settings.as_env()}
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "streams", "--ns", ns, "--reward", reward],
                                stdout=log_file, stderr=subprocess.STDOUT, env=env)
        try:
            return _wait_settled(settings, ns, proc, settle_s, timeout_s, log_path)
        finally:
            stop_process(proc)


def _wait_settled(settings: Settings, ns: str, proc: subprocess.Popen[bytes], settle_s: float, timeout_s: float,
                  log_path: Path) -> int:
    deadline = time.monotonic() + timeout_s
    history: list[tuple[float, int]] = []
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise PipelineError(f"streams worker exited with {proc.returncode}:\n{log_tail(log_path)}")
        history.append((time.monotonic(), scored_count(settings, ns)))
        history = [(t, c) for t, c in history if history[-1][0] - t <= 2 * settle_s]
        if settled(history, settle_s, consumed_all(settings, ns)):
            return history[-1][1]
        time.sleep(1.0)
    raise PipelineError(f"{ns}: scored output still growing after {timeout_s:.0f}s; log {log_path}")


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def latest_scored(settings: Settings, ns: str) -> dict[str, Trajectory]:
    """The scored trajectories of a namespace by id; a redelivered one counts once (the last copy)."""
    out: dict[str, Trajectory] = {}
    for msg in read_topic(settings, Topics(ns).scored):
        try:
            traj = codec.decode(msg.value() or b"", Trajectory)
        except DecodeError:
            continue
        out[traj.trajectory_id] = traj
    return out


def summarise(trajectories: Iterable[Trajectory], baseline: Optional[dict[str, Trajectory]] = None) -> RewardSummary:
    summary = RewardSummary()
    sums: dict[str, list[float]] = {}
    deltas: list[float] = []
    for t in trajectories:
        summary.trajectories += 1
        tag = f"{t.reward_fn}:{t.reward_version}"
        summary.by_reward[tag] = summary.by_reward.get(tag, 0) + 1
        sums.setdefault(t.domain, []).append(t.reward)
        old = (baseline or {}).get(t.trajectory_id)
        if old is not None:
            deltas.append(t.reward - old.reward)
    summary.mean_by_domain = {d: math.fsum(v) / len(v) for d, v in sorted(sums.items())}
    summary.compared = len(deltas)
    summary.changed = sum(1 for d in deltas if d != 0.0)
    summary.mean_delta = math.fsum(deltas) / len(deltas) if deltas else 0.0
    return summary


def rescore(settings: Settings, ns: str, reward: str, compare_ns: Optional[str] = None,
            settle_s: float = 15.0, timeout_s: float = 900.0) -> RewardSummary:
    run_streams(settings, ns, reward, settle_s, timeout_s)
    baseline = latest_scored(settings, compare_ns) if compare_ns else None
    return summarise(latest_scored(settings, ns).values(), baseline)


def format_summary(summary: RewardSummary, compare_ns: Optional[str] = None) -> str:
    lines = [f"scored trajectories: {summary.trajectories}  by reward: {summary.by_reward}"]
    lines += [f"  reward mean [{d}]: {m:.4f}" for d, m in summary.mean_by_domain.items()]
    if compare_ns:
        lines.append(f"against {compare_ns}: {summary.compared} in both, {summary.changed} with a different reward, "
                     f"mean change {summary.mean_delta:+.4f}")
    return "\n".join(lines)
