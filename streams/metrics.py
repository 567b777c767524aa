"""Metrics of the streams worker (infra.metrics.Metrics under the source "streams"), and what it observes of a
scored trajectory.

Windows are processing time on purpose: they describe the worker, not the episodes.
"""
from __future__ import annotations

from infra.metrics import Metrics
from schemas.records import Trajectory

SOURCE = "streams"


def streams_metrics() -> Metrics:
    return Metrics(SOURCE, rates={"streams/events_per_s": "streams/events"})


def observe_trajectory(metrics: Metrics, trajectory: Trajectory) -> None:
    """Reward per domain, episode length, and the sandbox outcome mix of one scored trajectory."""
    labels = (("domain", trajectory.domain),)
    metrics.count("streams/trajectories", status=trajectory.status)
    metrics.observe_key(("rollout/reward", labels), trajectory.reward)
    metrics.observe_key(("rollout/episode_turns", labels), float(len(trajectory.turns)))
    metrics.observe_key(("rollout/episode_tokens", labels), float(sum(len(t.tokens) for t in trajectory.turns) // 4))
    for turn in trajectory.turns:
        if turn.outcome:
            metrics.count("rollout/sandbox_outcomes", outcome=turn.outcome)
