"""Metrics of the streams worker (infra.metrics.Metrics under the source "streams"), and what it observes of a
scored trajectory.

Counters are cumulative per input partition (streams.counting), published as `total` records; the windows
carry the means, gauges and rates, and are bounded in event time (the newest event's timestamp), so a replay
of history publishes windows at the history's times. Rates are per wall second: they describe the worker, and
its windows carry a `worker` label (host-pid, infra.metrics.process_id), so the figures of several workers add up
instead of overwriting each other.
"""
from __future__ import annotations

from infra.metrics import Labels, Metrics
from schemas.records import Trajectory

SOURCE = "streams"


def streams_metrics(worker: str = "") -> Metrics:
    """The worker's metrics; its windows labelled `worker=<worker>` unless it is empty."""
    return Metrics(SOURCE, rates={"streams/events_per_s": "streams/events"}, window_counts=False,
                   labels={"worker": worker} if worker else {})


def trajectory_counts(trajectory: Trajectory) -> list[tuple[str, Labels, int]]:
    """The counters one scored trajectory adds: its status, and the sandbox outcome of each turn."""
    out: list[tuple[str, Labels, int]] = [("streams/trajectories", (("status", trajectory.status),), 1)]
    out += [("rollout/sandbox_outcomes", (("outcome", turn.outcome),), 1) for turn in trajectory.turns if turn.outcome]
    return out


def observe_trajectory(metrics: Metrics, trajectory: Trajectory) -> None:
    """Reward per domain, episode length, and the counters of one scored trajectory."""
    labels = (("domain", trajectory.domain),)
    for name, counter_labels, n in trajectory_counts(trajectory):
        metrics.count_key((name, counter_labels), n)
    metrics.observe_key(("rollout/reward", labels), trajectory.reward)
    metrics.observe_key(("rollout/episode_turns", labels), float(len(trajectory.turns)))
    metrics.observe_key(("rollout/episode_tokens", labels), float(sum(len(t.tokens) for t in trajectory.turns) // 4))
