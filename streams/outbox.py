"""Where the worker's records go: every output and changelog write, flushed before offsets are committed.

    outbox.send(topic, key, value, partition=None)   # queued, never dropped (blocks when the buffer is full)
    await outbox.flush()                             # everything sent before this call is acknowledged
    await outbox.reachable()                         # a broker answers now (the sweeper's clock stops if not)

`KafkaOutbox` is an idempotent confluent-kafka producer (librdkafka does the batching in C, a few
microseconds a record). The Faust producer's flush awaits `outbox.flush()`, so Faust commits a source
offset only after every record derived from it is on the broker: at-least-once. `MemoryOutbox` records
what was sent, for tests.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from infra.kafka import DeliveryError, producer_config
from infra.settings import Settings


class Outbox(Protocol):
    def send(self, topic: str, key: Optional[bytes], value: Optional[bytes], partition: Optional[int] = None) -> None:
        ...

    async def flush(self) -> None:
        ...

    async def reachable(self) -> bool:
        ...


@dataclass
class Sent:
    topic: str
    key: Optional[bytes]
    value: Optional[bytes]
    partition: Optional[int]


@dataclass
class MemoryOutbox:
    sent: list[Sent] = field(default_factory=list)
    flushed_at: list[int] = field(default_factory=list)  # len(sent) at each flush
    up: bool = True  # what reachable() answers: a test sets False for a broker outage

    def send(self, topic: str, key: Optional[bytes], value: Optional[bytes], partition: Optional[int] = None) -> None:
        self.sent.append(Sent(topic, key, value, partition))

    async def flush(self) -> None:
        self.flushed_at.append(len(self.sent))

    async def reachable(self) -> bool:
        return self.up

    def to(self, topic: str) -> list[Sent]:
        return [s for s in self.sent if s.topic == topic]


POLL_EVERY = 2000


class KafkaOutbox:
    """Counts records per flush epoch, so a flush waits for what was sent before it, not for later traffic.

    Sends are counted on the event loop's thread only; deliveries are counted under a lock by whichever
    thread serves librdkafka's callbacks (the flush, off the loop).
    """

    def __init__(self, settings: Settings, **overrides: Any) -> None:
        # No compression: Faust reads these topics through aiokafka, which has no lz4/snappy/zstd here.
        conf = {"linger.ms": 5, "batch.num.messages": 10_000, **overrides}
        self._producer = Producer(producer_config(settings, **conf))
        self._lock = threading.Lock()
        self._epoch = 0
        self._sent: dict[int, int] = defaultdict(int)
        self._done: dict[int, int] = defaultdict(int)
        self._callback = self._callback_for(0)
        self.errors: list[str] = []
        self._unpolled = 0

    def send(self, topic: str, key: Optional[bytes], value: Optional[bytes], partition: Optional[int] = None) -> None:
        kwargs: dict[str, Any] = {"key": key, "value": value, "on_delivery": self._callback}
        if partition is not None:
            kwargs["partition"] = partition
        while True:
            try:
                self._producer.produce(topic, **kwargs)
                break
            except BufferError:  # backpressure: wait for deliveries rather than drop
                self._producer.poll(0.05)
        self._sent[self._epoch] += 1
        self._unpolled += 1
        if self._unpolled >= POLL_EVERY:  # serve delivery reports, which hold their records until served
            self._unpolled = 0
            self._producer.poll(0)

    def _callback_for(self, epoch: int) -> Any:
        def delivered(err: Optional[KafkaError], msg: Message) -> None:
            with self._lock:
                self._done[epoch] += 1
                if err is not None and len(self.errors) < 100:
                    self.errors.append(f"{msg.topic()}[{msg.partition()}]: {err.str()}")
        return delivered

    def _outstanding(self, upto: int) -> int:
        with self._lock:
            return sum(n - self._done[epoch] for epoch, n in list(self._sent.items()) if epoch <= upto)

    def _wait(self, upto: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self._outstanding(upto) > 0:
            if time.monotonic() > deadline:
                raise DeliveryError(f"{self._outstanding(upto)} records unacknowledged after {timeout}s")
            self._producer.poll(0.05)
        with self._lock:
            for epoch in [e for e in self._sent if e <= upto]:
                self._sent.pop(epoch, None)
                self._done.pop(epoch, None)
        if self.errors:
            raise DeliveryError(f"{len(self.errors)} records failed: {self.errors[:3]}")

    async def flush(self, timeout: float = 300.0) -> None:
        """Wait, off the event loop, until every record sent so far is acknowledged; raise if any failed."""
        upto = self._epoch
        self._epoch += 1
        self._callback = self._callback_for(self._epoch)
        await asyncio.get_running_loop().run_in_executor(None, self._wait, upto, timeout)

    async def reachable(self, timeout: float = 1.0) -> bool:
        """Whether a broker answers a metadata request within `timeout` (off the event loop)."""
        def probe() -> bool:
            try:
                self._producer.list_topics(timeout=timeout)
                return True
            except KafkaException:
                return False
        return await asyncio.get_running_loop().run_in_executor(None, probe)

    def close(self, timeout: float = 60.0) -> None:
        self._wait(self._epoch, timeout)
