"""The monitor's figures, folded from the records of a namespace's topics; pure, so tests need no broker.

    stats = PipelineStats(Topics("run1"))
    stats.observe(topic, timestamp_ms, value_bytes)      # every record of every pipeline topic
    stats.set_consumer_lag(now_ms, {("run1.streams", "run1.rollout.events"): 12})
    stats.rates(now_ms)["run1.rollout.events"]           # events/s over the last 30 s of record time
"""
from __future__ import annotations

from array import array
from bisect import bisect_left
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Optional

from infra.metrics import Welford
from schemas.codec import codec
from schemas.errors import DecodeError
from schemas.records import (
    BatchManifest,
    CheckpointPublished,
    DeadLetter,
    PipelineMetric,
    RolloutEvent,
    SandboxResult,
    Trajectory,
)
from schemas.topics import Topics

BUCKET_MS = 10_000
KEEP_BUCKETS = 8_640  # a day of 10 s buckets
KEEP_POINTS = 10_000
# Reward and success by policy version: at most this many points per domain. Past it, versions are taken in buckets
# twice as wide (a bucket is keyed by its first version), the older ones merged: a run of a million versions
# holds a few thousand figures, not two million.
KEEP_VERSIONS = 2_000
RECENT = 1_000  # trajectories the policy-lag figures look back over
RECENT_IDS = 200_000  # record ids remembered to count a re-sent record once (re-sends follow within minutes)
LEARNER_SOURCE = "learner"
LOSS_PREFIX = "loss/"
CHECKPOINT_LATENCY = "rollout/checkpoint_latency_s"  # a rollout worker's: announcement -> generating with it
LATENCY_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0, 300.0)
# The service figures the live view, the summary and services.png show, each summed over its label sets
# (every figure, with its labels, is on /metrics): (source, name, how) where how is "total" (a counter: its
# total), "each" (a gauge per worker: the newest of each, summed) or "newest" (the newest record of any labels:
# the learner's per-update figures, labelled by version).
HEADLINE: tuple[tuple[str, str, str], ...] = (
    ("streams", "streams/events", "total"), ("streams", "streams/accepted", "total"),
    ("streams", "streams/duplicates", "total"), ("streams", "streams/deadletters", "total"),
    ("streams", "streams/abandoned", "total"), ("streams", "streams/late_stragglers", "total"),
    ("streams", "streams/zero_variance_groups", "total"), ("streams", "streams/open_episodes", "each"),
    ("streams", "streams/events_per_s", "each"),
    ("rollout", "rollout/episodes", "total"), ("rollout", "rollout/tokens_per_s", "each"),
    ("rollout", "rollout/checkpoints_refused", "each"),
    ("shards", "shards/batches", "total"), ("shards", "shards/duplicates", "total"),
    ("learner", "policy_lag/token_mean", "newest"), ("learner", "stats/clip_frac", "newest"),
    ("learner", "stale/dropped", "newest"), ("learner", "reader/stale_batches", "newest"),
)
HEADLINE_HOW = {(source, name): how for source, name, how in HEADLINE}
KEEP_LATENCIES = 10_000  # recent observations the quantiles are read from
# Labels that change along one series (the learner labels every figure with the version it made): a service's
# figure is one series whatever their values, or a long run would hold, scrape and sum one per version.
SERIES_LABELS_IGNORED = ("version", "algorithm")
# A series whose newest window is this much older (in metric time) than the newest of its source's is gone (a
# restarted rollout worker publishes under a new producer id): its last value leaves the figures that sum the
# live ones (`each` headlines, the Prometheus gauge). Its total stays in the sums over windows. Per source: the
# streams worker's windows are in event time, behind the others' while it works through a backlog or a replay.
STALE_SERIES_MS = 15 * 60 * 1000
PRUNE_SERIES_EVERY_MS = 60 * 1000
KEEP_RECORD_TIMES = 200_000  # per partition: offsets whose broker time the queue age can look up


def _joined(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def bucket_of(ms: int, bucket_ms: int = BUCKET_MS) -> int:
    return ms - ms % bucket_ms


def trajectory_version(t: Trajectory) -> int:
    """The oldest policy that wrote any turn of the trajectory: what its staleness is measured by."""
    return min((turn.policy_version for turn in t.turns), default=0)


def consumer_lag(committed: dict[tuple[str, int], int], ends: dict[tuple[str, int], tuple[int, int]]) -> dict[str, int]:
    """Lag per topic of one group: records between its committed offset and the end, summed over partitions."""
    lag: dict[str, int] = {}
    for (topic, partition), offset in committed.items():
        if (topic, partition) not in ends:
            continue
        low, high = ends[(topic, partition)]
        position = offset if offset >= 0 else low  # no commit yet: everything still there is unread
        lag[topic] = lag.get(topic, 0) + max(0, high - max(position, low))
    return lag


def first_unread(committed: dict[tuple[str, int], int],
                 ends: dict[tuple[str, int], tuple[int, int]]) -> dict[str, dict[int, int]]:
    """Of one group, per topic: the first offset it has not committed of each partition it lags on."""
    out: dict[str, dict[int, int]] = {}
    for (topic, partition), offset in committed.items():
        if (topic, partition) in ends:
            low, high = ends[(topic, partition)]
            position = max(offset if offset >= 0 else low, low)
            if position < high:
                out.setdefault(topic, {})[partition] = position
    return out


class RecordTimes:
    """The broker time of the records of one partition read lately, by offset (bounded: the oldest go)."""

    def __init__(self, size: int = KEEP_RECORD_TIMES) -> None:
        self.size = size
        self.offsets, self.times = array("q"), array("q")

    def add(self, offset: int, ts: int) -> None:
        if self.offsets and offset <= self.offsets[-1]:
            return  # read again (a re-assignment): already known
        self.offsets.append(offset)
        self.times.append(ts)
        if len(self.offsets) > self.size:
            del self.offsets[:self.size // 2], self.times[:self.size // 2]

    def at(self, offset: int) -> Optional[int]:
        """The time of the record at `offset` (or the next one there is: compaction leaves gaps); the oldest kept
        for an offset older than all of them; None when it has not been read yet."""
        i = bisect_left(self.offsets, offset)
        return self.times[i] if i < len(self.offsets) else None


class Recent:
    """The last `size` distinct keys: whether a key is new. A restarted service re-sends what it wrote after
    its last commit (byte-identical trajectories, the same dead letters, events a producer retried), soon
    after the first copy; counting each id once keeps the monitor's figures those of distinct records."""

    def __init__(self, size: int = RECENT_IDS) -> None:
        self.size = size
        self.keys: dict[Hashable, Any] = {}  # insertion-ordered: the oldest first

    def add(self, key: Hashable, value: Any = None) -> bool:
        if key in self.keys:
            return False
        self.keys[key] = value
        if len(self.keys) > self.size:
            del self.keys[next(iter(self.keys))]
        return True

    def pop(self, key: Hashable) -> Any:
        return self.keys.pop(key, None)


@dataclass
class Latency:
    """A latency distribution: Prometheus buckets (cumulative when exported) and the recent values."""
    count: int = 0
    total_s: float = 0.0
    buckets: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS_S))
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=KEEP_LATENCIES))

    def add(self, seconds: float) -> None:
        seconds = max(0.0, seconds)
        self.count += 1
        self.total_s += seconds
        self.recent.append(seconds)
        for i, bound in enumerate(LATENCY_BUCKETS_S):
            if seconds <= bound:
                self.buckets[i] += 1
                break

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus histogram buckets: (upper bound, observations at or under it), +Inf last."""
        out, running = [], 0
        for bound, n in zip(LATENCY_BUCKETS_S, self.buckets):
            running += n
            out.append((repr(bound), running))
        return out + [("+Inf", self.count)]

    def quantile(self, q: float) -> float:
        values = sorted(self.recent)
        return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


@dataclass
class PipelineStats:
    topics: Topics
    bucket_ms: int = BUCKET_MS
    events_total: Counter[str] = field(default_factory=Counter)
    undecodable: Counter[str] = field(default_factory=Counter)
    partial: str = ""  # why these figures cover only part of the topics (a reader stopped before their end)
    throughput: dict[str, dict[int, int]] = field(default_factory=dict)  # topic -> bucket start -> records
    reward: dict[str, Welford] = field(default_factory=dict)  # domain ->
    reward_by_version: dict[tuple[str, int], Welford] = field(default_factory=dict)
    reward_over_time: dict[str, dict[int, Welford]] = field(default_factory=dict)  # domain -> bucket ->
    # domain -> 1.0 per trajectory that solved its task (its best outcome/* component is 1), else 0.0
    success: dict[str, Welford] = field(default_factory=dict)
    success_by_version: dict[tuple[str, int], Welford] = field(default_factory=dict)
    version_width: dict[str, int] = field(default_factory=dict)  # domain -> versions per bucket of those two
    sandbox_outcomes: Counter[str] = field(default_factory=Counter)
    deadletter_reasons: Counter[str] = field(default_factory=Counter)
    newest_checkpoint: int = -1
    newest_trajectory_version: int = -1
    recent_policy_lag: deque[int] = field(default_factory=lambda: deque(maxlen=RECENT))
    learner: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # loss/* -> (time, value)
    consumer_lags: dict[tuple[str, str], int] = field(default_factory=dict)  # (group, topic) -> lag
    lag_over_time: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # group -> (time, total lag)
    # Every service's own figures on the metrics topic, by (source, name, "k=v,..." labels): the newest
    # window's value, and the sum over windows (the total, for counters published per window).
    service_latest: dict[tuple[str, str, str], float] = field(default_factory=dict)
    service_sum: dict[tuple[str, str, str], float] = field(default_factory=dict)
    # Cumulative counters (`total` records, the streams worker's): the newest value of each partition.
    service_partitions: dict[tuple[str, str, str], dict[str, float]] = field(default_factory=dict)
    service_newest: dict[tuple[str, str], float] = field(default_factory=dict)  # (source, name) -> any labels
    service_seen: dict[tuple[str, str, str], int] = field(default_factory=dict)  # key -> newest window's end (ms)
    metrics_newest_ms: dict[str, int] = field(default_factory=dict)  # source -> the newest window's end of its series
    series_pruned_ms: dict[str, int] = field(default_factory=dict)  # source -> its metric time at the last prune
    headline_series: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # name -> (time, value)
    resent: Counter[str] = field(default_factory=Counter)  # topic -> records counted once already (by id)
    record_times: dict[tuple[str, int], RecordTimes] = field(default_factory=dict)  # (topic, partition) ->
    # (group, topic) -> broker time (ms) of the oldest record the group has not committed: the queue's age
    oldest_unread: dict[tuple[str, str], int] = field(default_factory=dict)
    seen_ids: dict[str, Recent] = field(default_factory=dict)  # topic ->
    # An episode's EpisodeEnded (the trajectory's ended_ts) -> the batch manifest holding it (broker time):
    # when its trajectory is readable by the learner. Whichever record comes second completes the pair.
    batch_latency: Latency = field(default_factory=Latency)
    checkpoint_latency: Latency = field(default_factory=Latency)  # announcement -> a worker generating with it
    ended_at: Recent = field(default_factory=Recent)  # trajectory id -> ended_ts, until its batch is seen
    batched_at: Recent = field(default_factory=Recent)  # trajectory id -> batch time, until it is seen scored

    def __post_init__(self) -> None:
        t = self.topics
        self._handlers: dict[str, tuple[type, Callable[[Any, int], None]]] = {
            t.events: (RolloutEvent, self._on_event),
            t.deadletter: (DeadLetter, self._on_deadletter),
            t.scored: (Trajectory, self._on_scored),
            t.checkpoints: (CheckpointPublished, self._on_checkpoint),
            t.batches: (BatchManifest, self._on_batch),
            t.metrics: (PipelineMetric, self._on_metric),
        }

    def observe(self, topic: str, timestamp_ms: int, value: Optional[bytes], partition: Optional[int] = None,
                offset: Optional[int] = None) -> None:
        """Count one record of `topic`, and fold its content when the topic carries figures; with its
        partition and offset, its time is kept for the queue age."""
        self.events_total[topic] += 1
        if partition is not None and offset is not None:
            self.record_times.setdefault((topic, partition), RecordTimes()).add(offset, timestamp_ms)
        per_bucket = self.throughput.setdefault(topic, {})
        b = bucket_of(timestamp_ms, self.bucket_ms)
        per_bucket[b] = per_bucket.get(b, 0) + 1
        if len(per_bucket) > KEEP_BUCKETS:
            del per_bucket[min(per_bucket)]
        handler = self._handlers.get(topic)
        if handler is None or value is None:
            return
        cls, fold = handler
        try:
            record = codec.decode(value, cls)
        except DecodeError:
            self.undecodable[topic] += 1
            return
        fold(record, timestamp_ms)

    def _first(self, topic: str, key: Hashable) -> bool:
        """Whether the record with this id is the first of its topic seen (else it is counted as re-sent)."""
        if self.seen_ids.setdefault(topic, Recent()).add(key):
            return True
        self.resent[topic] += 1
        return False

    def _on_event(self, event: RolloutEvent, ts: int) -> None:
        if isinstance(event.body, SandboxResult) and self._first(self.topics.events, event.event_id):
            self.sandbox_outcomes[event.body.outcome] += 1

    def _on_deadletter(self, record: DeadLetter, ts: int) -> None:
        # a dead letter is identified by the input record it rejects and why (a re-processed input gives
        # the same one again)
        if self._first(self.topics.deadletter, (record.stage, record.source_topic, record.partition, record.offset,
                                                record.reason)):
            self.deadletter_reasons[record.reason] += 1

    def _on_scored(self, t: Trajectory, ts: int) -> None:
        if not self._first(self.topics.scored, t.trajectory_id):
            return
        batched = self.batched_at.pop(t.trajectory_id)
        if batched is not None:
            self.batch_latency.add((batched - t.ended_ts) / 1000)
        else:
            self.ended_at.add(t.trajectory_id, t.ended_ts)
        version = self._version_bucket(t.domain, trajectory_version(t))
        self.reward.setdefault(t.domain, Welford()).add(t.reward)
        self.reward_by_version.setdefault((t.domain, version), Welford()).add(t.reward)
        solved = float(max((v for k, v in t.reward_components.items() if k.startswith("outcome/")), default=0.0) >= 1.0)
        self.success.setdefault(t.domain, Welford()).add(solved)
        self.success_by_version.setdefault((t.domain, version), Welford()).add(solved)
        over_time = self.reward_over_time.setdefault(t.domain, {})
        over_time.setdefault(bucket_of(ts, self.bucket_ms), Welford()).add(t.reward)
        if len(over_time) > KEEP_BUCKETS:
            del over_time[min(over_time)]
        self.newest_trajectory_version = max(self.newest_trajectory_version, max(
            (turn.policy_version for turn in t.turns), default=0))
        if self.newest_checkpoint >= 0:
            self.recent_policy_lag.append(max(0, self.newest_checkpoint - version))

    def _on_checkpoint(self, c: CheckpointPublished, ts: int) -> None:
        self.newest_checkpoint = max(self.newest_checkpoint, c.version)

    def _on_batch(self, m: BatchManifest, ts: int) -> None:
        if not self._first(self.topics.batches, m.batch_id):
            return
        for trajectory_id in m.trajectory_ids:
            ended = self.ended_at.pop(trajectory_id)
            if ended is not None:
                self.batch_latency.add((ts - ended) / 1000)
            else:
                self.batched_at.add(trajectory_id, ts)

    def _on_metric(self, m: PipelineMetric, ts: int) -> None:
        if m.name == CHECKPOINT_LATENCY and self._first(self.topics.metrics, (m.source, m.name, _joined(m.labels))):
            self.checkpoint_latency.add(m.value)  # one per worker and version
        labels = {k: v for k, v in m.labels.items()
                  if not (m.total and k == "partition") and k not in SERIES_LABELS_IGNORED}
        key = (m.source, m.name, _joined(labels))
        at = m.window_end or ts
        self.service_seen[key] = max(at, self.service_seen.get(key, 0))
        newest = self.metrics_newest_ms[m.source] = max(self.metrics_newest_ms.get(m.source, 0), at)
        if m.total:  # since the start of the log, per partition: the newest of each, summed
            partitions = self.service_partitions.setdefault(key, {})
            partitions[m.labels.get("partition", "")] = m.value
            self.service_latest[key] = self.service_sum[key] = sum(partitions.values())
        else:
            self.service_latest[key] = m.value
            self.service_sum[key] = self.service_sum.get(key, 0.0) + m.value
        self.service_newest[(m.source, m.name)] = m.value
        if (m.source, m.name) in HEADLINE_HOW:
            points = self.headline_series.setdefault(m.name, [])
            points.append((m.window_end or ts, self.headline_value(m.source, m.name)))
            del points[:-KEEP_POINTS]
        if m.source == LEARNER_SOURCE and m.name.startswith(LOSS_PREFIX):
            points = self.learner.setdefault(m.name, [])
            points.append((m.window_end or ts, m.value))
            del points[:-KEEP_POINTS]
        if newest - self.series_pruned_ms.get(m.source, 0) >= PRUNE_SERIES_EVERY_MS:  # after the value is held:
            self.prune_series(m.source)  # a late window of a stale series goes with it, never left behind

    def _version_bucket(self, domain: str, version: int) -> int:
        """The first version of the bucket `version` falls in; widens the domain's buckets (merging what is held)
        when a new one would make more than KEEP_VERSIONS."""
        width = self.version_width.get(domain, 1)
        bucket = version - version % width
        if (domain, bucket) in self.reward_by_version:
            return bucket
        held = sum(1 for d, _ in self.reward_by_version if d == domain)
        if held < KEEP_VERSIONS:
            return bucket
        width = self.version_width[domain] = width * 2
        for by_version in (self.reward_by_version, self.success_by_version):
            for key in [k for k in by_version if k[0] == domain]:
                merged = by_version.pop(key)
                by_version.setdefault((domain, key[1] - key[1] % width), Welford()).merge(merged)
        return version - version % width

    def prune_series(self, source: str) -> None:
        """Let go of the newest values of the source's windowed series gone stale; cumulative ones (`total`) stay,
        as do the sums over windows."""
        horizon = self.metrics_newest_ms[source] - STALE_SERIES_MS
        for key in [k for k, at in self.service_seen.items()
                    if k[0] == source and at < horizon and k not in self.service_partitions]:
            del self.service_seen[key]
            self.service_latest.pop(key, None)
        self.series_pruned_ms[source] = self.metrics_newest_ms[source]

    def set_consumer_lag(self, now_ms: int, lags: dict[tuple[str, str], int],
                         unread: Optional[dict[tuple[str, str], dict[int, int]]] = None) -> None:
        """Each group's lag per topic; `unread`: per (group, topic), the first uncommitted offset of each
        partition it lags on, whose record time (when read) gives the queue's age."""
        self.consumer_lags = dict(lags)
        self.oldest_unread = {}
        for key, positions in (unread or {}).items():
            times = [self.record_times[(key[1], p)].at(o) for p, o in positions.items()
                     if (key[1], p) in self.record_times]
            known = [t for t in times if t is not None]
            if known:
                self.oldest_unread[key] = min(known)
        totals: dict[str, int] = {}
        for (group, _topic), lag in lags.items():
            totals[group] = totals.get(group, 0) + lag
        for group, total in totals.items():
            points = self.lag_over_time.setdefault(group, [])
            points.append((now_ms, total))
            del points[:-KEEP_POINTS]

    def rates(self, now_ms: int, window_s: float = 30.0) -> dict[str, float]:
        """Records per second of each topic whose record time falls in the last `window_s` seconds."""
        since = now_ms - int(window_s * 1000)
        return {topic: sum(n for b, n in buckets.items() if b + self.bucket_ms > since) / window_s
                for topic, buckets in self.throughput.items()}

    def policy_lag(self) -> tuple[float, int]:
        """(mean, max) versions between the newest checkpoint and recent trajectories' oldest turn."""
        lags = self.recent_policy_lag
        return (sum(lags) / len(lags), max(lags)) if lags else (0.0, 0)

    def headline_value(self, source: str, name: str) -> float:
        how = HEADLINE_HOW[(source, name)]
        if how == "newest":
            return self.service_newest.get((source, name), 0.0)
        values = self.service_sum if how == "total" else self.service_latest
        return sum(v for (s, n, _), v in values.items() if s == source and n == name)

    def headline(self) -> dict[str, float]:
        """The HEADLINE figures some service has published, by name."""
        return {name: self.headline_value(source, name) for source, name, _ in HEADLINE
                if (source, name) in self.service_newest}

    def latest_learner(self) -> dict[str, float]:
        return {name: points[-1][1] for name, points in sorted(self.learner.items()) if points}

    def reward_trend(self, domain: str, last: int = 20) -> list[float]:
        """Mean reward of the domain's last `last` time buckets that hold any trajectory."""
        buckets = self.reward_over_time.get(domain, {})
        return [buckets[b].mean for b in sorted(buckets)[-last:]]


SPARKS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float]) -> str:
    if not values:
        return ""
    lo, hi = min(values), max(values)
    span = hi - lo
    return "".join(SPARKS[int((v - lo) / span * (len(SPARKS) - 1)) if span else len(SPARKS) // 2] for v in values)
