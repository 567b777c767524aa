"""Taps every topic of a namespace: a live terminal view, a Prometheus /metrics endpoint, and PNG reports.

    python -m consumers.monitor --ns run1                              # live view, /metrics on :9108
    python -m consumers.monitor --ns run1 --no-tui --port 9200         # headless exporter
    python -m consumers.monitor --ns run1 --duration 60 --report out/  # then plots and out/summary.md
    python -m consumers.monitor --ns run1 --no-tui --to-end --report out/  # every record there is now, then out/

The monitor reads in its own consumer group (<ns>.monitor) from the beginning of each topic, so its totals
count everything the topics hold (--resume starts from its last commit instead). Consumer lag covers every
group whose name contains the namespace; the figures are computed in consumers.monitoring.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Optional

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    ConsumerGroupTopicPartitions,
    KafkaError,
    KafkaException,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, OffsetSpec
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from consumers.monitoring import PipelineStats, consumer_lag, first_unread, sparkline
from infra.kafka import admin, committed_offsets, consumer, end_offsets
from infra.settings import Settings, add_ns_argument
from schemas.errors import PipelineError
from schemas.topics import Topics

log = logging.getLogger("consumers.monitor")
LAG_EVERY_S = 5.0
COMMIT_EVERY_S = 10.0


def now_ms() -> int:
    return int(time.time() * 1000)


def pipeline_topics(topics: Topics) -> list[str]:
    """The topics the monitor taps: every data topic of the namespace (not the streams app's changelogs)."""
    return [topics.events, topics.deadletter, topics.trajectories, topics.scored, topics.batches,
            topics.checkpoints, topics.metrics, topics.task_stats]


def group_lags(client: AdminClient, ns: str, timeout: float = 10.0
               ) -> tuple[dict[tuple[str, str], int], dict[tuple[str, str], dict[int, int]]]:
    """For every consumer group named after the namespace that committed on its topics: (group, topic) -> lag,
    and (group, topic) -> {partition: first uncommitted offset} where it lags."""
    listing = client.list_consumer_groups(request_timeout=timeout).result()
    groups = sorted(g.group_id for g in listing.valid if ns in g.group_id)
    committed: dict[str, dict[tuple[str, int], int]] = {}
    for group in groups:
        result = client.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group)],
                                                    request_timeout=timeout)[group].result()
        mine = {(tp.topic, tp.partition): tp.offset for tp in result.topic_partitions or []
                if tp.topic.startswith(ns + ".")}
        if mine:
            committed[group] = mine
    ends = watermarks(client, {tp for offsets in committed.values() for tp in offsets}, timeout)
    lags = {(group, topic): lag for group, offsets in committed.items()
            for topic, lag in consumer_lag(offsets, ends).items()}
    unread = {(group, topic): positions for group, offsets in committed.items()
              for topic, positions in first_unread(offsets, ends).items()}
    return lags, unread


def watermarks(client: AdminClient, partitions: set[tuple[str, int]],
               timeout: float) -> dict[tuple[str, int], tuple[int, int]]:
    if not partitions:
        return {}
    tps = [TopicPartition(t, p) for t, p in sorted(partitions)]
    lows = client.list_offsets({tp: OffsetSpec.earliest() for tp in tps}, request_timeout=timeout)
    highs = client.list_offsets({tp: OffsetSpec.latest() for tp in tps}, request_timeout=timeout)
    out = {}
    for tp in tps:
        try:
            out[(tp.topic, tp.partition)] = (lows[tp].result().offset, highs[tp].result().offset)
        except KafkaException:
            continue  # a topic deleted since the group committed on it
    return out


class StatsCollector(Collector):
    """Exposes a PipelineStats at scrape time, under the monitor's lock."""

    def __init__(self, stats: PipelineStats, lock: threading.Lock) -> None:
        self.stats = stats
        self.lock = lock

    def collect(self) -> Iterator[Metric]:
        with self.lock:
            yield from self._families(self.stats)

    @staticmethod
    def _families(s: PipelineStats) -> Iterator[Metric]:
        def family(kind: Any, name: str, doc: str, labels: list[str], rows: Any) -> Metric:
            f = kind(name, doc, labels=labels)
            for key, value in rows:
                f.add_metric(list(key) if isinstance(key, tuple) else [key], value)
            return f  # type: ignore[no-any-return]

        yield family(CounterMetricFamily, "trajpipe_events", "Records read per topic", ["topic"],
                     s.events_total.items())
        yield family(CounterMetricFamily, "trajpipe_undecodable", "Records that did not decode, per topic",
                     ["topic"], s.undecodable.items())
        yield family(GaugeMetricFamily, "trajpipe_throughput", "Records per second over the last 30 s of record time",
                     ["topic"], s.rates(now_ms()).items())
        yield family(CounterMetricFamily, "trajpipe_resent", "Records counted once already (the same id again: a "
                     "restarted service re-sent it)", ["topic"], s.resent.items())
        yield family(CounterMetricFamily, "trajpipe_deadletter", "Dead letters per reason", ["reason"],
                     s.deadletter_reasons.items())
        yield family(CounterMetricFamily, "trajpipe_sandbox_outcomes", "Sandbox results per outcome", ["outcome"],
                     s.sandbox_outcomes.items())
        yield family(CounterMetricFamily, "trajpipe_scored_trajectories", "Scored trajectories per domain",
                     ["domain"], ((d, w.n) for d, w in s.reward.items()))
        yield family(GaugeMetricFamily, "trajpipe_reward_mean", "Mean reward of scored trajectories", ["domain"],
                     ((d, w.mean) for d, w in s.reward.items()))
        yield family(GaugeMetricFamily, "trajpipe_reward_std", "Reward standard deviation", ["domain"],
                     ((d, w.std) for d, w in s.reward.items()))
        yield family(GaugeMetricFamily, "trajpipe_success_rate", "Fraction of scored trajectories that solved their "
                     "task (an outcome/* component of 1)", ["domain"], ((d, w.mean) for d, w in s.success.items()))
        yield family(GaugeMetricFamily, "trajpipe_consumer_lag", "Records a group has not committed yet",
                     ["group", "topic"], s.consumer_lags.items())
        yield family(GaugeMetricFamily, "trajpipe_queue_oldest_unread_timestamp_seconds", "Broker time of the "
                     "oldest record a group has not committed (only where it lags)", ["group", "topic"],
                     ((k, ms / 1000) for k, ms in s.oldest_unread.items()))
        yield family(GaugeMetricFamily, "trajpipe_queue_age_seconds", "How long the oldest record a group has not "
                     "committed has waited (only where it lags): the autoscaling signal of a stage",
                     ["group", "topic"], ((k, max(0.0, time.time() - ms / 1000)) for k, ms in s.oldest_unread.items()))
        yield family(GaugeMetricFamily, "trajpipe_policy_version", "Newest policy version seen", ["source"],
                     [("checkpoint", s.newest_checkpoint), ("trajectory", s.newest_trajectory_version)])
        mean, worst = s.policy_lag()
        yield family(GaugeMetricFamily, "trajpipe_policy_lag", "Versions between the newest checkpoint and recent "
                     "trajectories", ["stat"], [("mean", mean), ("max", worst)])
        yield family(GaugeMetricFamily, "trajpipe_learner", "Latest learner figure (loss/*)", ["name"],
                     s.latest_learner().items())
        yield family(GaugeMetricFamily, "trajpipe_service", "Every service's newest figure on the metrics topic "
                     "(rollout/, shards/, streams/, learner/ ...)", ["source", "name", "labels"],
                     s.service_latest.items())
        for name, doc, latency in (
                ("trajpipe_batch_latency_seconds", "From an episode's EpisodeEnded to the batch manifest that makes its "
                 "trajectory readable by the learner", s.batch_latency),
                ("trajpipe_checkpoint_latency_seconds", "From a checkpoint's announcement to a rollout worker "
                 "generating with it", s.checkpoint_latency)):
            yield HistogramMetricFamily(name, doc, buckets=latency.cumulative(), sum_value=latency.total_s)
        yield family(CounterMetricFamily, "trajpipe_service_windows", "A service counter's total: summed over its "
                     "windows, or for a cumulative one (the streams worker's) the newest value of each partition "
                     "summed", ["source", "name", "labels"], s.service_sum.items())


def dashboard(s: PipelineStats) -> Table:
    """The live view: one small table per figure, in two columns."""
    rates = s.rates(now_ms())
    short = len(s.topics.ns) + 1  # names without the namespace, which the title carries
    flow = Table("topic", "records", "rec/s", title=f"throughput of {s.topics.ns}")
    for topic in sorted(s.events_total):
        flow.add_row(topic[short:], f"{s.events_total[topic]:,}", f"{rates.get(topic, 0.0):,.1f}")
    lag = Table("group", "topic", "lag", "age s", title="consumer lag")
    for (group, topic), n in sorted(s.consumer_lags.items()):
        oldest = s.oldest_unread.get((group, topic))
        lag.add_row(group, topic[short:], f"{n:,}", "-" if oldest is None else f"{max(0, now_ms() - oldest) / 1000:.1f}")
    reward = Table("domain", "n", "mean", "std", "success", "trend", title="reward")
    for domain, w in sorted(s.reward.items()):
        solved = s.success.get(domain)
        reward.add_row(domain, f"{w.n:,}", f"{w.mean:.3f}", f"{w.std:.3f}", f"{solved.mean:.1%}" if solved else "-",
                       sparkline(s.reward_trend(domain)))
    mean, worst = s.policy_lag()
    policy = Table("checkpoint", "trajectory", "lag mean", "lag max", title="newest policy versions")
    policy.add_row(str(s.newest_checkpoint), str(s.newest_trajectory_version), f"{mean:.2f}", str(worst))
    latency = Table("from -> to", "n", "p50 s", "p99 s", title="latency")
    for name, dist in (("episode ended -> in a batch", s.batch_latency),
                       ("checkpoint -> generating", s.checkpoint_latency)):
        latency.add_row(name, f"{dist.count:,}", f"{dist.quantile(0.5):.2f}", f"{dist.quantile(0.99):.2f}")
    grid = Table.grid(padding=(0, 2))
    grid.add_row(Group(flow, lag, policy, latency), Group(reward, counts_table("sandbox outcomes", s.sandbox_outcomes),
                                                 counts_table("dead letters", s.deadletter_reasons),
                                                 counts_table("learner", s.latest_learner(), "{:.4f}"),
                                                 counts_table("services", s.headline(), "{:,.4g}")))
    return grid


def counts_table(title: str, counts: Any, fmt: str = "{:,}") -> Table:
    table = Table("name", "value", title=title)
    for name, value in sorted(counts.items()):
        table.add_row(name, fmt.format(value))
    return table


class Monitor:
    """Reads the pipeline topics into a PipelineStats, refreshes consumer lag, commits its own position."""

    def __init__(self, settings: Settings, ns: str, group: Optional[str] = None, resume: bool = False) -> None:
        self.settings = settings
        self.topics = Topics(ns)
        self.group = group or f"{ns}.monitor"
        self.stats = PipelineStats(self.topics)
        self.lock = threading.Lock()
        self.admin = admin(settings)
        # A partition's end offset can lie past its last record (a transaction's commit marker): the end is
        # known from the consumer's end-of-partition event, not from the last record read.
        self.consumer: Consumer = consumer(settings, self.group, **{"enable.partition.eof": True})
        self.resume = resume
        self._last_lag = self._last_commit = 0.0
        self.assigned: set[str] = set()
        self.positions: dict[tuple[str, int], int] = {}  # the next offset to read, of each partition read from

    def end_marks(self) -> dict[tuple[str, int], int]:
        """The end offset of every non-empty partition of the tapped topics now: what `--to-end` reads up to."""
        self.assign_new_topics()
        return {(topic, p): high for topic in sorted(self.assigned)
                for p, (low, high) in end_offsets(self.settings, topic).items() if high > low}

    def unread(self, marks: dict[tuple[str, int], int]) -> int:
        """Records (offsets) between the monitor's position and `marks`, summed over partitions."""
        return sum(max(0, end - self.positions.get(tp, 0)) for tp, end in marks.items())

    def assign_new_topics(self) -> None:
        """Tap the pipeline topics that exist (and pick up ones created later)."""
        present = self.admin.list_topics(timeout=10).topics
        new = [t for t in pipeline_topics(self.topics) if t in present and t not in self.assigned]
        if not new:
            return
        tps = [TopicPartition(t, p) for t in new for p in present[t].partitions]
        if self.resume:
            tps = [tp if tp.offset >= 0 else TopicPartition(tp.topic, tp.partition, OFFSET_BEGINNING)
                   for tp in committed_offsets(self.consumer, tps)]
        else:
            tps = [TopicPartition(tp.topic, tp.partition, OFFSET_BEGINNING) for tp in tps]
        self.consumer.incremental_assign(tps)
        self.assigned.update(new)

    def poll(self, timeout: float = 0.2) -> int:
        msgs = self.consumer.consume(num_messages=2000, timeout=timeout)
        with self.lock:
            for msg in msgs:
                where, err = (msg.topic() or "", msg.partition() or 0), msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        self.positions[where] = max(self.positions.get(where, 0), msg.offset() or 0)
                    else:
                        log.warning("consume error: %s", err)
                    continue
                self.positions[where] = (msg.offset() or 0) + 1
                self.stats.observe(msg.topic() or "", msg.timestamp()[1], msg.value(), msg.partition(), msg.offset())
        return len(msgs)

    def refresh_lag(self) -> None:
        try:
            lags, unread = group_lags(self.admin, self.topics.ns)
        except KafkaException as exc:
            log.warning("consumer lag unavailable: %s", exc)
            return
        with self.lock:
            self.stats.set_consumer_lag(now_ms(), lags, unread)

    def commit(self) -> None:
        try:
            self.consumer.commit(asynchronous=True)
        except KafkaException:
            pass  # nothing consumed yet

    def tick(self) -> None:
        """One round: read, and on their schedules refresh lag, look for new topics, commit."""
        self.poll()
        now = time.monotonic()
        if now - self._last_lag >= LAG_EVERY_S:
            self._last_lag = now
            self.assign_new_topics()
            self.refresh_lag()
        if now - self._last_commit >= COMMIT_EVERY_S:
            self._last_commit = now
            self.commit()

    def close(self) -> None:
        self.commit()
        self.consumer.close()


def serve_metrics(monitor: Monitor, port: int, addr: str = "0.0.0.0") -> Any:
    """Start /metrics on `port` (0 picks a free one); returns the server (its server_port says which)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(monitor.stats, monitor.lock))
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    return server


def run(monitor: Monitor, duration: Optional[float], tui: bool, stop: threading.Event, to_end: bool = False) -> None:
    """Tick until stopped, `duration` seconds have passed or, with `to_end`, every record that the topics held
    at the start is read (progress on stderr; the report says how much was read if time ran out first)."""
    deadline = None if duration is None else time.monotonic() + duration
    console = Console()
    live = Live(dashboard(monitor.stats), console=console, refresh_per_second=2) if tui else None
    marks = monitor.end_marks() if to_end else {}
    total, said = sum(marks.values()), time.monotonic()
    if live is not None:
        live.start()
    try:
        while not stop.is_set() and (deadline is None or time.monotonic() < deadline):
            if to_end:
                left = monitor.unread(marks)
                if left == 0:
                    break
                if time.monotonic() - said >= 5:
                    said = time.monotonic()
                    print(f"monitor: read {total - left:,} of {total:,} offsets", file=sys.stderr, flush=True)
            monitor.tick()
            if live is not None:
                with monitor.lock:
                    live.update(dashboard(monitor.stats))
    finally:
        if live is not None:
            live.stop()
        left = monitor.unread(marks)
        if left:
            monitor.stats.partial = (f"read {total - left:,} of the {total:,} offsets (records, and transaction "
                                     "markers) the topics held when it started, then stopped")
            print(f"monitor: {monitor.stats.partial}", file=sys.stderr, flush=True)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m consumers.monitor", description=__doc__.splitlines()[0])
    add_ns_argument(p)
    p.add_argument("--port", type=int, default=9108, help="Prometheus /metrics port (0: any free port)")
    p.add_argument("--addr", default="0.0.0.0", help="address /metrics listens on")
    p.add_argument("--no-tui", action="store_true", help="no live terminal view")
    p.add_argument("--report", type=Path, help="on exit, write PNG plots and summary.md into this directory")
    p.add_argument("--duration", type=float, help="exit after this many seconds")
    p.add_argument("--to-end", action="store_true",
                   help="exit once every record the topics hold at start is read (or --duration passes)")
    p.add_argument("--group", help="consumer group (default <ns>.monitor)")
    p.add_argument("--resume", action="store_true", help="start from the group's commits, not the beginning")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        monitor = Monitor(Settings.from_env(), args.ns, args.group, args.resume)
        server = serve_metrics(monitor, args.port, args.addr)
        print(f"monitor: /metrics on port {server.server_port}", file=sys.stderr, flush=True)
        try:
            run(monitor, args.duration, not args.no_tui, stop, args.to_end)
        finally:
            monitor.close()
            server.shutdown()
    except PipelineError as exc:
        print(f"monitor: {exc}", file=sys.stderr)
        return 1
    if args.report:
        from consumers.report import write_report  # matplotlib only when a report is asked for

        print(f"monitor: report in {write_report(monitor.stats, args.report)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
