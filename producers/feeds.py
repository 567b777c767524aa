"""Follows the compacted <ns>.task.stats feed into the task mixer's curriculum statistics."""
from __future__ import annotations

import threading
import uuid
from typing import MutableMapping

from confluent_kafka import TopicPartition

from infra.kafka import consumer
from infra.settings import Settings
from schemas.codec import codec
from schemas.errors import DecodeError
from schemas.records import TaskStats
from schemas.topics import Topics


class TaskStatsFollower:
    """A daemon thread that keeps stats[task_id] = (attempts, passes) up to date: the sum of the task's
    records, one per partition of <ns>.trajectories (key "<partition>|<task id>", each written by the
    streams worker that holds the partition). A record keyed by the task id alone (logs of earlier versions)
    already holds every partition's sum; it counts until the task's first per-partition record."""

    def __init__(self, settings: Settings, topics: Topics, stats: MutableMapping[str, tuple[int, int]]) -> None:
        self.settings, self.topics, self.stats = settings, topics, stats
        self.parts: dict[str, dict[bytes, tuple[int, int]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="task-stats", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        c = consumer(self.settings, f"{self.topics.ns}-taskstats-{uuid.uuid4().hex[:8]}")
        c.assign([TopicPartition(self.topics.task_stats, 0, 0)])
        try:
            while not self._stop.is_set():
                msg = c.poll(0.5)
                if msg is None or msg.error():
                    continue
                try:
                    s = codec.decode(msg.value() or b"", expect=TaskStats)
                except DecodeError:
                    continue  # the feed only steers sampling; a bad record costs nothing
                self.fold(msg.key() or s.task_id.encode(), s)
        finally:
            c.close()

    def fold(self, key: bytes, s: TaskStats) -> None:
        parts = self.parts.setdefault(s.task_id, {})
        if key != s.task_id.encode():
            parts.pop(s.task_id.encode(), None)  # per-partition records from now on
        elif any(k != key for k in parts):
            return
        parts[key] = (s.attempts, s.passes)
        self.stats[s.task_id] = (sum(a for a, _ in parts.values()), sum(p for _, p in parts.values()))
