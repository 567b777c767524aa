"""Kafka client factories with the pipeline's delivery guarantees, and a counted, back-pressured publisher.

    publisher = Publisher(settings)
    publisher.send(topic, key, value)   # blocks when the local buffer is full (backpressure)
    publisher.close()                   # flushes; raises if anything was not delivered
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, TypeVar

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from infra.settings import Settings
from schemas.errors import PipelineError

log = logging.getLogger(__name__)


class DeliveryError(PipelineError):
    """Records the broker did not acknowledge."""


# The largest record a producer of this project sends (brokers here accept 8 MiB: docker-compose, local).
RECORD_LIMIT = 4 * 1024 * 1024

def producer_config(settings: Settings, **overrides: Any) -> dict[str, Any]:
    conf: dict[str, Any] = {
        "bootstrap.servers": settings.kafka_bootstrap,
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": 5,
        "queue.buffering.max.messages": 100_000,
        "queue.buffering.max.kbytes": 256 * 1024,
        # Retry for as long as it takes (a broker restart); the publisher surfaces failures.
        "message.timeout.ms": 300_000,
        "message.max.bytes": RECORD_LIMIT,
    }
    conf.update(overrides)
    return conf


def consumer_config(settings: Settings, group: str, **overrides: Any) -> dict[str, Any]:
    conf: dict[str, Any] = {
        "bootstrap.servers": settings.kafka_bootstrap,
        "group.id": group,
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        "enable.partition.eof": False,
        "fetch.max.bytes": 64 * 1024 * 1024,
        "max.partition.fetch.bytes": 8 * 1024 * 1024,
    }
    conf.update(overrides)
    return conf


T = TypeVar("T")


def while_broker_away(what: str, fn: Callable[[], T], timeout_s: float = 300.0) -> T:
    """fn(), retried while the broker is restarting or electing coordinators (a service that starts
    during a broker restart waits for it instead of dying); other Kafka errors raise at once."""
    deadline = time.monotonic() + timeout_s
    delay = 0.5
    while True:
        try:
            return fn()
        except KafkaException as exc:
            err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
            transient = err is None or err.retriable() or err.code() in _AWAY
            if not transient or time.monotonic() + delay > deadline:
                raise
            log.warning("%s: %s; retrying in %.1fs", what, exc, delay)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


# _UNKNOWN_PARTITION: the client's metadata has the topic again but not yet its partitions' leaders.
_AWAY = {KafkaError._TRANSPORT, KafkaError._TIMED_OUT, KafkaError._ALL_BROKERS_DOWN, KafkaError._UNKNOWN_PARTITION,
         KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_NOT_AVAILABLE, KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
         KafkaError.LEADER_NOT_AVAILABLE, KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.REQUEST_TIMED_OUT}


def admin(settings: Settings) -> AdminClient:
    return AdminClient({"bootstrap.servers": settings.kafka_bootstrap})


def consumer(settings: Settings, group: str, **overrides: Any) -> Consumer:
    return Consumer(consumer_config(settings, group, **overrides))


@dataclass
class DeliveryStats:
    sent: int = 0
    delivered: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def pending(self) -> int:
        return self.sent - self.delivered - self.failed


class Publisher:
    """An idempotent producer whose every record is accounted for by a delivery callback."""

    def __init__(self, settings: Settings, on_delivery: Optional[Callable[[Message], None]] = None,
                 **overrides: Any) -> None:
        self._producer = Producer(producer_config(settings, **overrides))
        self._on_delivery = on_delivery
        self._lock = threading.Lock()
        self.stats = DeliveryStats()

    def _delivered(self, err: Optional[KafkaError], msg: Message) -> None:
        with self._lock:
            if err is None:
                self.stats.delivered += 1
            else:
                self.stats.failed += 1
                if len(self.stats.errors) < 100:
                    self.stats.errors.append(f"{msg.topic()}: {err.str()}")
        if err is None and self._on_delivery is not None:
            self._on_delivery(msg)

    def send(self, topic: str, key: Optional[bytes | str], value: bytes,
             headers: Optional[list[tuple[str, Optional[bytes]]]] = None, partition: Optional[int] = None,
             timestamp: Optional[int] = None) -> None:
        """Queue one record; when the local buffer is full, wait for deliveries (never drop).

        `timestamp` (ms) keeps a copied record's time index (replay); default: the producer's clock.
        """
        kwargs: dict[str, Any] = {"key": key, "value": value, "on_delivery": self._delivered}
        if headers:
            kwargs["headers"] = headers
        if partition is not None:
            kwargs["partition"] = partition
        if timestamp is not None:
            kwargs["timestamp"] = timestamp
        while True:
            try:
                self._producer.produce(topic, **kwargs)
                break
            except BufferError:
                self._producer.poll(0.05)
        self.stats.sent += 1
        self._producer.poll(0)

    def poll(self, timeout: float = 0.0) -> int:
        return self._producer.poll(timeout)

    def flush(self, timeout: float = 300.0) -> None:
        """Wait until every queued record is acknowledged or failed; raise on failures."""
        deadline = time.monotonic() + timeout
        while self.stats.pending > 0 and time.monotonic() < deadline:
            self._producer.flush(min(1.0, max(0.0, deadline - time.monotonic())))
        if self.stats.pending > 0:
            raise DeliveryError(f"{self.stats.pending} records still unacknowledged after {timeout}s")
        if self.stats.failed:
            raise DeliveryError(f"{self.stats.failed} records failed: {self.stats.errors[:3]}")

    def close(self, timeout: float = 300.0) -> None:
        self.flush(timeout)


def read_topic(settings: Settings, topic: str, timeout: float = 60.0) -> Iterator[Message]:
    """Every record of `topic` from the beginning up to its end at call time (tools, tests, replay)."""
    ends = end_offsets(settings, topic)
    todo = {p: (lo, hi) for p, (lo, hi) in ends.items() if hi > lo}
    if not todo:
        return
    c = consumer(settings, f"trajpipe-reader-{topic}", **{"enable.partition.eof": True})
    try:
        yield from read_ranges(c, topic, todo, timeout)
    finally:
        c.close()


def read_past(c: Consumer, topic: str, marks: dict[int, tuple[int, int]], read_to: dict[int, int],
              timeout: float = 60.0) -> Iterator[Message]:
    """The records a reader that follows `topic` has not read yet: each partition's from `read_to` (the next offset
    to read; from the low watermark where that is unset or deleted) to its high watermark in `marks` (`watermarks`).
    Once every partition is read, `read_to` moves to those ends; a read cut short reads them again next time."""
    ranges = {p: (max(low, read_to.get(p, low)), high) for p, (low, high) in marks.items()}
    yield from read_ranges(c, topic, ranges, timeout)
    read_to.update({p: high for p, (_, high) in ranges.items()})


def read_ranges(c: Consumer, topic: str, ranges: dict[int, tuple[int, int]], timeout: float = 60.0
                ) -> Iterator[Message]:
    """The records of each partition from its start offset up to its end (start, end), through a consumer made
    with `enable.partition.eof`, which this assigns and leaves unassigned; TimeoutError past `timeout`."""
    # The end offset can lie past the last record (a transaction's commit marker): a partition is done at its
    # last record or at the consumer's end-of-partition event, whichever comes first.
    todo = {p: end for p, (start, end) in ranges.items() if end > start}
    if not todo:
        return
    c.assign([TopicPartition(topic, p, ranges[p][0]) for p in todo])
    deadline = time.monotonic() + timeout
    try:
        while todo:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{topic}: partitions {sorted(todo)} not read to their end in {timeout}s")
            msg = c.poll(0.5)
            if msg is None:
                continue
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    todo.pop(msg.partition() or 0, None)
                    continue
                if err.retriable() or err.code() in _AWAY:
                    continue  # the broker is coming back: librdkafka reconnects, the deadline bounds it
                raise KafkaException(err)
            part, offset = msg.partition() or 0, msg.offset() or 0
            if offset >= todo.get(part, -1) - 1:
                todo.pop(part, None)
            yield msg
    finally:
        c.unassign()


def committed_offsets(c: Consumer, partitions: list[TopicPartition], timeout: float = 10.0) -> list[TopicPartition]:
    """The group's committed offsets (OFFSET_INVALID where none), waiting out a broker restart and a fresh
    broker's group coordinator, which answers NOT_COORDINATOR until it has loaded its offsets topic."""
    return while_broker_away("committed offsets", lambda: c.committed(partitions, timeout=timeout))


def commit_offsets(c: Consumer, offsets: list[TopicPartition]) -> None:
    """Commit `offsets` for the consumer's group and wait for the broker's answer, waiting out a restart."""
    while_broker_away("commit", lambda: c.commit(offsets=offsets, asynchronous=False))


def end_offsets(settings: Settings, topic: str, timeout: float = 10.0) -> dict[int, tuple[int, int]]:
    """(low, high) watermark per partition of `topic`, waiting out a broker restart."""
    return while_broker_away(f"watermarks of {topic}", lambda: _watermarks(settings, topic, timeout))


def _watermarks(settings: Settings, topic: str, timeout: float) -> dict[int, tuple[int, int]]:
    c = consumer(settings, "trajpipe-watermarks")
    try:
        return watermarks(c, topic, timeout)
    finally:
        c.close()


def watermarks(c: Consumer, topic: str, timeout: float = 10.0) -> dict[int, tuple[int, int]]:
    """(low, high) watermark per partition of `topic`, through a client already open (a caller that asks
    often keeps one); no partitions for a topic the broker does not know."""
    parts = c.list_topics(topic, timeout=timeout).topics[topic].partitions
    return {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout) for p in parts}


def group_assignment(settings: Settings, group: str, topic: str, timeout: float = 10.0) -> dict[str, set[int]]:
    """The partitions of `topic` each member of consumer group `group` holds now (member id -> partitions)."""
    client = admin(settings)  # held until the future resolves: a collected client fails it with _DESTROY
    described = client.describe_consumer_groups([group], request_timeout=timeout)[group].result(timeout=timeout)
    return {m.member_id: {tp.partition for tp in m.assignment.topic_partitions if tp.topic == topic}
            for m in described.members}
