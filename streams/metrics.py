"""Metrics of the streams worker: counters and mean/std accumulators over tumbling windows of wall time.

    metrics = Metrics()
    metrics.count("streams/duplicates")
    metrics.observe("rollout/reward", 0.5, domain="math")
    records = metrics.flush(window_start_ms, window_end_ms)   # PipelineMetric records; the window restarts

Counters are per window (sum the windows for a total) and `totals` keeps them since the worker started.
Windows are processing time on purpose: they describe the worker, not the episodes.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from schemas.records import PipelineMetric, Trajectory

SOURCE = "streams"
Labels = tuple[tuple[str, str], ...]
Key = tuple[str, Labels]


@dataclass
class Running:
    n: int = 0
    total: float = 0.0
    total_sq: float = 0.0

    def add(self, value: float) -> None:
        self.n += 1
        self.total += value
        self.total_sq += value * value

    @property
    def mean(self) -> float:
        return self.total / self.n if self.n else 0.0

    @property
    def std(self) -> float:
        if self.n < 2:
            return 0.0
        return math.sqrt(max(self.total_sq / self.n - self.mean ** 2, 0.0))


@dataclass
class Metrics:
    counters: Counter[Key] = field(default_factory=Counter)
    stats: dict[Key, Running] = field(default_factory=dict)
    gauges: dict[Key, float] = field(default_factory=dict)
    totals: Counter[Key] = field(default_factory=Counter)

    def count(self, name: str, n: int = 1, **labels: str) -> None:
        key = (name, _labels(labels) if labels else ())
        self.counters[key] += n
        self.totals[key] += n

    def observe(self, name: str, value: float, **labels: str) -> None:
        self.observe_key((name, _labels(labels)), value)

    def observe_key(self, key: Key, value: float) -> None:
        running = self.stats.get(key)
        if running is None:
            running = self.stats[key] = Running()
        running.add(value)

    def gauge(self, name: str, value: float, **labels: str) -> None:
        self.gauges[(name, _labels(labels))] = value

    def total(self, name: str, **labels: str) -> int:
        """Since start; without labels, summed over every label set of `name`."""
        if labels:
            return int(self.totals[(name, _labels(labels))])
        return int(sum(v for (n, _), v in self.totals.items() if n == name))

    def flush(self, start_ms: int, end_ms: int) -> list[PipelineMetric]:
        """The window's figures (sorted by name and labels), then an empty window."""
        seconds = max((end_ms - start_ms) / 1000.0, 1e-3)
        out = [_metric(name, float(v), labels, start_ms, end_ms) for (name, labels), v in self.counters.items()]
        events = sum(v for (name, _), v in self.counters.items() if name == "streams/events")
        out.append(_metric("streams/events_per_s", events / seconds, (), start_ms, end_ms))
        for (name, labels), running in self.stats.items():
            out.append(_metric(f"{name}_mean", running.mean, labels, start_ms, end_ms))
            out.append(_metric(f"{name}_std", running.std, labels, start_ms, end_ms))
        out += [_metric(name, v, labels, start_ms, end_ms) for (name, labels), v in self.gauges.items()]
        self.counters.clear()
        self.stats.clear()
        self.gauges.clear()
        return sorted(out, key=lambda m: (m.name, sorted(m.labels.items())))

    def summary(self) -> str:
        """One log line of the totals since start."""
        names = sorted({name for name, _ in self.totals})
        return ", ".join(f"{name.split('/', 1)[-1]}={self.total(name)}" for name in names)


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


def _labels(labels: dict[str, str]) -> Labels:
    return tuple(labels.items()) if len(labels) < 2 else tuple(sorted(labels.items()))


def _metric(name: str, value: float, labels: Labels, start_ms: int, end_ms: int) -> PipelineMetric:
    return PipelineMetric(source=SOURCE, name=name, value=value, labels=dict(labels), window_start=start_ms,
                          window_end=end_ms)
