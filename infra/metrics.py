"""A service's figures as PipelineMetric records: counters, mean/std accumulators and gauges over windows.

    metrics = Metrics("rollout", rates={"rollout/episodes_per_s": "rollout/episodes"})
    metrics.count("rollout/episodes", 16, status="completed")
    metrics.observe("rollout/reward", 0.5, domain="math")
    metrics.gauge("rollout/policy_version", 7)
    records = metrics.flush(window_start_ms, window_end_ms)   # PipelineMetric records; the window restarts
    publish(publisher, topics.metrics, records)

Counters are per window (sum the windows for a total) and `totals` keeps them since the service started;
`rates` name per-second figures of counters, computed over each window. A service whose counters must
survive a restart exactly (the streams worker: streams.counting) publishes them as cumulative records
instead, with `window_counts=False` here. Every service publishes to
<ns>.pipeline.metrics under its own source and name prefix (`rollout/`, `shards/`, `streams/`, `learner/`).
"""
from __future__ import annotations

import math
import os
import socket
from collections import Counter
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from infra.kafka import Publisher
from schemas.codec import codec
from schemas.records import PipelineMetric

Labels = tuple[tuple[str, str], ...]
Key = tuple[str, Labels]


@dataclass
class Welford:
    """Running mean and variance in one pass (numerically stable)."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, x: float) -> None:
        self.n += 1
        delta = x - self.mean
        self.mean += delta / self.n
        self.m2 += delta * (x - self.mean)

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.n) if self.n > 1 else 0.0

    def merge(self, other: "Welford") -> None:
        """Take in another's values (Chan et al.'s pairwise update): as if each had been added here."""
        n = self.n + other.n
        if not other.n or not n:
            return
        delta = other.mean - self.mean
        self.mean += delta * other.n / n
        self.m2 += other.m2 + delta * delta * self.n * other.n / n
        self.n = n


def process_id() -> str:
    """host-pid: which process of several of one service made a figure (a label on its windows)."""
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass
class Metrics:
    source: str
    rates: Mapping[str, str] = field(default_factory=dict)  # rate name -> the counter it is the rate of
    counters: Counter[Key] = field(default_factory=Counter)
    stats: dict[Key, Welford] = field(default_factory=dict)
    gauges: dict[Key, float] = field(default_factory=dict)
    totals: Counter[Key] = field(default_factory=Counter)
    window_counts: bool = True  # False: counters feed the rates and `totals`, not the window's records
    # Labels every window record carries besides its own: which process made it (several workers of one source
    # publish the same figures; a reader sums or compares them per process).
    labels: Mapping[str, str] = field(default_factory=dict)

    def count(self, name: str, n: int = 1, **labels: str) -> None:
        self.count_key((name, _labels(labels) if labels else ()), n)

    def count_key(self, key: Key, n: int = 1) -> None:
        self.counters[key] += n
        self.totals[key] += n

    def observe(self, name: str, value: float, **labels: str) -> None:
        self.observe_key((name, _labels(labels)), value)

    def observe_key(self, key: Key, value: float) -> None:
        running = self.stats.get(key)
        if running is None:
            running = self.stats[key] = Welford()
        running.add(value)

    def gauge(self, name: str, value: float, **labels: str) -> None:
        self.gauges[(name, _labels(labels))] = value

    def total(self, name: str, **labels: str) -> int:
        """Since start; without labels, summed over every label set of `name`."""
        if labels:
            return int(self.totals[(name, _labels(labels))])
        return int(sum(v for (n, _), v in self.totals.items() if n == name))

    def flush(self, start_ms: int, end_ms: int, seconds: Optional[float] = None) -> list[PipelineMetric]:
        """The window's figures (sorted by name and labels), then an empty window; rates per `seconds` (the
        window's length if not given: a window in event time gives the wall seconds it took)."""
        seconds = max((end_ms - start_ms) / 1000.0 if seconds is None else seconds, 1e-3)
        metric = self._metric
        out = [metric(name, float(v), labels, start_ms, end_ms) for (name, labels), v in self.counters.items()
               if self.window_counts]
        for rate, counter in self.rates.items():
            n = sum(v for (name, _), v in self.counters.items() if name == counter)
            out.append(metric(rate, n / seconds, (), start_ms, end_ms))
        for (name, labels), running in self.stats.items():
            out.append(metric(f"{name}_mean", running.mean, labels, start_ms, end_ms))
            out.append(metric(f"{name}_std", running.std, labels, start_ms, end_ms))
        out += [metric(name, v, labels, start_ms, end_ms) for (name, labels), v in self.gauges.items()]
        self.counters.clear()
        self.stats.clear()
        self.gauges.clear()
        return sorted(out, key=lambda m: (m.name, sorted(m.labels.items())))

    def summary(self) -> str:
        """One log line of the totals since start."""
        names = sorted({name for name, _ in self.totals})
        return ", ".join(f"{name.split('/', 1)[-1]}={self.total(name)}" for name in names)

    def _metric(self, name: str, value: float, labels: Labels, start_ms: int, end_ms: int) -> PipelineMetric:
        return PipelineMetric(source=self.source, name=name, value=value, labels={**self.labels, **dict(labels)},
                              window_start=start_ms, window_end=end_ms)


def _labels(labels: dict[str, str]) -> Labels:
    return tuple(labels.items()) if len(labels) < 2 else tuple(sorted(labels.items()))


def publish(publisher: Publisher, topic: str, records: Sequence[PipelineMetric]) -> None:
    """Send a window's records (not flushed: they travel with the service's next flush)."""
    for record in records:
        publisher.send(topic, f"{record.source}:{record.name}".encode(), codec.encode(record))
