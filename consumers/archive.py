"""Archives <ns>.rollout.events into the object store as Avro container files, so history outlives Kafka retention.

    python -m consumers.archive --ns NS            # follow the topic until SIGTERM / Ctrl-C
    python -m consumers.archive --ns NS --once     # archive everything up to the current end, then exit

Objects are keyed by (UTC date, partition, first offset, last offset) with schemas.keys.archive_key; each is
written and read back before its offsets are committed. A restart resumes after the last archived object of
each partition (the committed offset, moved past any object that already covers it), so nothing is stored
twice. One archiver per namespace: the consumer group `<ns>.archive` hands partitions over on failure.
"""
from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from confluent_kafka import OFFSET_INVALID, Consumer, KafkaException, Message, TopicPartition

from infra.kafka import commit_offsets, committed_offsets, consumer, end_offsets
from infra.objectstore import ObjectStore
from infra.settings import Settings, add_ns_argument
from schemas.archive import ArchivedEvent, ArchiveObject, archive_prefix, sorted_objects, utc_date, write_archive
from schemas.errors import ConfigError, PipelineError
from schemas.keys import archive_key
from schemas.topics import Topics

log = logging.getLogger("consumers.archive")
RECORD_OVERHEAD = 48  # bytes an archived record adds to its key and value (positions, lengths)


@dataclass(frozen=True)
class ArchiveBounds:
    max_events: int = 50_000
    max_bytes: int = 64 * 1024 * 1024
    max_age_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_events < 1 or self.max_bytes < 1 or not self.max_age_s > 0:
            raise ConfigError(f"archive bounds must be positive, got {self}")


@dataclass
class Chunk:
    """Consecutive records of one partition and one UTC date: the content of one archive object."""

    partition: int
    date: str
    opened_at: float
    records: list[ArchivedEvent] = field(default_factory=list)
    nbytes: int = 0

    @property
    def first(self) -> int:
        return self.records[0].offset

    @property
    def last(self) -> int:
        return self.records[-1].offset

    def key(self, ns: str) -> str:
        return archive_key(ns, self.records[0].topic, self.date, self.partition, self.first, self.last)


def record_size(rec: ArchivedEvent) -> int:
    return len(rec.value) + len(rec.key or b"") + RECORD_OVERHEAD


class ChunkBuilder:
    """Cuts each partition's records into chunks by date, count, size and age; pure."""

    def __init__(self, bounds: ArchiveBounds) -> None:
        self.bounds = bounds
        self.open: dict[int, Chunk] = {}

    def add(self, rec: ArchivedEvent, now: float) -> list[Chunk]:
        """Add one record; return the chunks it closed (the previous one on a date change, or its own when full)."""
        closed: list[Chunk] = []
        date = utc_date(rec.timestamp)
        chunk = self.open.get(rec.partition)
        if chunk is not None and chunk.date != date:
            closed.append(self.open.pop(rec.partition))
            chunk = None
        if chunk is None:
            chunk = self.open[rec.partition] = Chunk(rec.partition, date, now)
        chunk.records.append(rec)
        chunk.nbytes += record_size(rec)
        if len(chunk.records) >= self.bounds.max_events or chunk.nbytes >= self.bounds.max_bytes:
            closed.append(self.open.pop(rec.partition))
        return closed

    def due(self, now: float) -> list[Chunk]:
        late = [p for p, c in self.open.items() if now - c.opened_at >= self.bounds.max_age_s]
        return [self.open.pop(p) for p in sorted(late)]

    def drain(self) -> list[Chunk]:
        return [self.open.pop(p) for p in sorted(self.open)]

    def revoke(self, partitions: Iterable[int]) -> None:
        for p in partitions:
            self.open.pop(p, None)


def resume_offset(objects: Iterable[ArchiveObject], partition: int, position: int) -> int:
    """`position` moved past every archived object of `partition` that covers it: stored data is not written again."""
    ranges = sorted((o.first, o.last) for o in objects if o.partition == partition)
    for first, last in ranges:
        if first <= position <= last:
            position = last + 1
    return position


def header_of(header: Any) -> tuple[str, Optional[bytes]]:
    name, value = header
    return str(name), None if value is None else bytes(value, "utf-8") if isinstance(value, str) else bytes(value)


def from_message(msg: Message) -> ArchivedEvent:
    headers = tuple(header_of(h) for h in msg.headers() or [])
    return ArchivedEvent(topic=msg.topic() or "", partition=msg.partition() or 0, offset=msg.offset() or 0,
                         timestamp=msg.timestamp()[1], key=msg.key(), value=msg.value() or b"", headers=headers)


KEEP_KEYS = 1000  # the newest object keys a run reports (an archiver runs for weeks: one object a minute a partition)


@dataclass
class ArchiveStats:
    events: int = 0
    objects: int = 0
    bytes: int = 0
    keys: list[str] = field(default_factory=list)  # the newest KEEP_KEYS written


class Archiver:
    """Consumes the events topic, writes verified chunks, commits their offsets."""

    def __init__(self, settings: Settings, ns: str, bounds: ArchiveBounds = ArchiveBounds(),
                 store: Optional[ObjectStore] = None, group: Optional[str] = None) -> None:
        self.settings = settings
        self.ns = ns
        self.topic = Topics(ns).events
        self.store = store or ObjectStore(settings)
        self.group = group or f"{ns}.archive"
        self.builder = ChunkBuilder(bounds)
        self.stats = ArchiveStats()
        self.consumer: Consumer = consumer(settings, self.group)
        self.next_offset: dict[int, int] = {}

    def archived_objects(self) -> list[ArchiveObject]:
        return sorted_objects(self.store.list(archive_prefix(self.ns, self.topic)))

    def start_positions(self, partitions: list[TopicPartition]) -> list[TopicPartition]:
        """The committed offset of each partition, moved past objects already in the store."""
        objects = self.archived_objects()
        committed = committed_offsets(self.consumer, partitions, timeout=30)
        lows = end_offsets(self.settings, self.topic)
        out = []
        for tp in committed:
            position = tp.offset if tp.offset != OFFSET_INVALID and tp.offset >= 0 else lows[tp.partition][0]
            position = resume_offset(objects, tp.partition, max(position, lows[tp.partition][0]))
            out.append(TopicPartition(self.topic, tp.partition, position))
            self.next_offset[tp.partition] = position
        return out

    def write(self, chunk: Chunk) -> None:
        key = chunk.key(self.ns)
        data = write_archive(chunk.records, key)
        self.store.put_verified(key, data)
        commit_offsets(self.consumer, [TopicPartition(self.topic, chunk.partition, chunk.last + 1)])
        self.stats.objects += 1
        self.stats.bytes += len(data)
        self.stats.keys.append(key)
        del self.stats.keys[:-KEEP_KEYS]
        log.info("archived %s (%d events, %d bytes)", key, len(chunk.records), len(data))

    def take(self, messages: list[Message]) -> None:
        now = time.monotonic()
        for msg in messages:
            if msg.error():
                raise KafkaException(msg.error())
            rec = from_message(msg)
            self.next_offset[rec.partition] = rec.offset + 1
            self.stats.events += 1
            for chunk in self.builder.add(rec, now):
                self.write(chunk)
        for chunk in self.builder.due(now):
            self.write(chunk)

    def run_once(self, timeout_s: float = 600.0) -> ArchiveStats:
        """Archive every partition up to its end offset at call time, then flush what is open."""
        ends = {p: hi for p, (_, hi) in end_offsets(self.settings, self.topic).items()}
        self.consumer.assign(self.start_positions([TopicPartition(self.topic, p) for p in sorted(ends)]))
        deadline = time.monotonic() + timeout_s
        while any(self.next_offset.get(p, 0) < hi for p, hi in ends.items()):
            if time.monotonic() > deadline:
                raise PipelineError(f"{self.topic}: not archived to its end within {timeout_s:.0f}s")
            self.take(self.consumer.consume(num_messages=2000, timeout=0.5))
        for chunk in self.builder.drain():
            self.write(chunk)
        return self.stats

    def _on_assign(self, c: Consumer, partitions: list[TopicPartition]) -> None:
        c.assign(self.start_positions(partitions))

    def _on_revoke(self, c: Consumer, partitions: list[TopicPartition]) -> None:
        # Open chunks of a revoked partition are dropped uncommitted: its next owner reads them again.
        self.builder.revoke(tp.partition for tp in partitions)

    def run_forever(self, stop: "StopFlag") -> ArchiveStats:
        self.consumer.subscribe([self.topic], on_assign=self._on_assign, on_revoke=self._on_revoke)
        while not stop.set:
            self.take(self.consumer.consume(num_messages=2000, timeout=0.5))
        for chunk in self.builder.drain():
            self.write(chunk)
        return self.stats

    def close(self) -> None:
        self.consumer.close()


class StopFlag:
    """Set by SIGTERM / SIGINT so the loop ends after writing what it holds."""

    def __init__(self) -> None:
        self.set = False

    def install(self) -> "StopFlag":
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: setattr(self, "set", True))
        return self


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m consumers.archive", description=__doc__.splitlines()[0])
    add_ns_argument(p, help="namespace whose rollout.events are archived")
    p.add_argument("--once", action="store_true", help="archive up to the current end of the topic, then exit")
    p.add_argument("--max-events", type=int, default=ArchiveBounds.max_events, help="records per object at most")
    p.add_argument("--max-bytes", type=int, default=ArchiveBounds.max_bytes, help="bytes per object at most")
    p.add_argument("--max-age", type=float, default=ArchiveBounds.max_age_s,
                   help="seconds an object stays open while following the topic")
    p.add_argument("--group", default=None, help="consumer group (default <ns>.archive)")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    try:
        settings = Settings.from_env()
        archiver = Archiver(settings, args.ns, ArchiveBounds(args.max_events, args.max_bytes, args.max_age),
                            group=args.group)
        archiver.store.ensure_bucket()
        try:
            stats = archiver.run_once() if args.once else archiver.run_forever(StopFlag().install())
        finally:
            archiver.close()
    except PipelineError as exc:
        print(f"archive: {exc}", file=sys.stderr)
        return 1
    summary: dict[str, Any] = {"topic": archiver.topic, "events": stats.events, "objects": stats.objects,
                               "bytes": stats.bytes}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
