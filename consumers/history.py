"""Recorded history as ArchivedEvent records: an offset range of a Kafka topic, or a namespace's archive objects.

    history = KafkaHistory(settings, topic, starts={0: 10}, ends={0: 500})   # or ArchiveHistory(store, ns, topic)
    for rec in history.records():          # each partition in offset order
        if enough(rec):
            history.stop(rec.partition)    # the partition yields nothing more
"""
from __future__ import annotations

import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator, Optional

from confluent_kafka import Consumer, KafkaException, TopicPartition

from consumers.archive import from_message
from consumers.selection import Window
from infra.kafka import consumer, end_offsets
from infra.objectstore import ObjectStore
from infra.settings import Settings
from schemas.archive import ArchivedEvent, ArchiveObject, archive_prefix, iter_archive, sorted_objects, utc_date
from schemas.errors import PipelineError

IDLE_TIMEOUT_S = 60.0


def time_offsets(settings: Settings, topic: str, ms: int, partitions: list[int]) -> dict[int, int]:
    """Per partition, the first offset whose record timestamp is >= ms (the high watermark when none is)."""
    c = consumer(settings, f"trajpipe-history-{uuid.uuid4().hex[:8]}")
    try:
        found = c.offsets_for_times([TopicPartition(topic, p, ms) for p in partitions], timeout=30)
    finally:
        c.close()
    ends = end_offsets(settings, topic)
    return {tp.partition: tp.offset if tp.offset >= 0 else ends[tp.partition][1] for tp in found}


def kafka_bounds(settings: Settings, topic: str, window: Window) -> tuple[dict[int, int], dict[int, int]]:
    """Where to start and stop reading each partition: the window's offsets narrowed by its times."""
    marks = end_offsets(settings, topic)
    parts = sorted(marks)
    starts = {p: max(window.start.get(p, 0), marks[p][0]) for p in parts}
    ends = {p: min(window.end.get(p, marks[p][1]), marks[p][1]) for p in parts}
    if window.since is not None:
        for p, o in time_offsets(settings, topic, window.since, parts).items():
            starts[p] = max(starts[p], o)
    return starts, ends


class KafkaHistory:
    """Reads each partition of `topic` from starts[p] up to (not including) ends[p]."""

    def __init__(self, settings: Settings, topic: str, starts: dict[int, int], ends: dict[int, int]) -> None:
        self.settings = settings
        self.topic = topic
        self.starts = starts
        self.ends = ends
        self.stopped: set[int] = set()

    @property
    def total(self) -> int:
        return sum(max(0, self.ends[p] - self.starts.get(p, 0)) for p in self.ends)

    def stop(self, partition: int) -> None:
        self.stopped.add(partition)

    def records(self) -> Iterator[ArchivedEvent]:
        todo = {p for p in self.ends if self.ends[p] > self.starts.get(p, 0)}
        if not todo:
            return
        c = consumer(self.settings, f"trajpipe-history-{uuid.uuid4().hex[:8]}")
        c.assign([TopicPartition(self.topic, p, self.starts.get(p, 0)) for p in sorted(todo)])
        idle_since = time.monotonic()
        try:
            while todo - self.stopped:
                msgs = c.consume(num_messages=5000, timeout=0.5)
                if not msgs:
                    todo -= self._caught_up(c, todo)
                    if time.monotonic() - idle_since > IDLE_TIMEOUT_S:
                        raise PipelineError(f"{self.topic}: partitions {sorted(todo)} stalled before their end")
                    continue
                idle_since = time.monotonic()
                for msg in msgs:
                    if msg.error():
                        raise KafkaException(msg.error())
                    p, offset = msg.partition() or 0, msg.offset() or 0
                    if p not in todo or p in self.stopped or offset >= self.ends[p]:
                        continue
                    yield from_message(msg)
                    if offset >= self.ends[p] - 1:
                        todo.discard(p)
        finally:
            c.close()

    def _caught_up(self, c: Consumer, todo: set[int]) -> set[int]:
        # Offsets can have gaps (transaction markers), so an idle partition may be done without its last offset.
        positions = c.position([TopicPartition(self.topic, p) for p in todo])
        return {tp.partition for tp in positions if tp.offset >= self.ends[tp.partition]}


def relevant(obj: ArchiveObject, window: Window) -> bool:
    """Whether an archive object can hold records a replay of `window` needs (objects hold one UTC date each)."""
    # Objects past the window's end stay: they can hold the tail of an episode begun inside it.
    if obj.last < window.start.get(obj.partition, 0):
        return False
    return window.since is None or obj.date >= utc_date(window.since)


class ArchiveHistory:
    """Reads the archive objects of `topic` in namespace `ns`, fetching the next object while one is read."""

    def __init__(self, store: ObjectStore, ns: str, topic: str, window: Window = Window()) -> None:
        self.store = store
        self.window = window
        self.objects = [o for o in sorted_objects(store.list(archive_prefix(ns, topic))) if relevant(o, window)]
        self.stopped: set[int] = set()

    @property
    def partitions(self) -> list[int]:
        return sorted({o.partition for o in self.objects})

    @property
    def total(self) -> int:
        return sum(o.last - max(o.first, self.window.start.get(o.partition, 0)) + 1 for o in self.objects)

    def stop(self, partition: int) -> None:
        self.stopped.add(partition)

    def records(self) -> Iterator[ArchivedEvent]:
        with ThreadPoolExecutor(max_workers=1) as pool:
            pending: Optional[Future[bytes]] = None
            for i, obj in enumerate(self.objects):
                data = pending.result() if pending is not None else self.store.get(obj.key)
                pending = pool.submit(self.store.get, self.objects[i + 1].key) if i + 1 < len(self.objects) else None
                if obj.partition not in self.stopped:
                    yield from self._object_records(obj, data)

    def _object_records(self, obj: ArchiveObject, data: bytes) -> Iterator[ArchivedEvent]:
        start = self.window.start.get(obj.partition, 0)
        for rec in iter_archive(data):
            if obj.partition in self.stopped:
                return
            if rec.offset >= start:
                yield rec
