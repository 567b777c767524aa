"""Faust plumbing at batch cost, keeping Faust's consumer group, acks, commits and table recovery.

    async for batch in batches(stream, max_size=4000, wait_s=0.02):   # events of one agent
        ...                                                          # outputs to app.outbox
        for event in batch:
            event.ack()                                              # then Faust may commit them
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Awaitable, Callable, Generic, Optional, TypeVar

import faust
from faust.transport.drivers import aiokafka as driver
from faust.types import TP, EventT, StreamT, TableT

from streams.outbox import Outbox

log = logging.getLogger(__name__)
V = TypeVar("V")
SMALL_BATCH = 8  # a batch under 1/8 of the maximum waits for more events


def fetch_position(client: Any, tp: Any) -> Optional[int]:
    """The aiokafka consumer's next fetch offset of `tp`; None when it is not assigned or has none."""
    assignment = client._subscription.subscription and client._subscription.subscription.assignment
    if assignment is None or tp not in assignment.tps:
        return None
    return assignment.state_value(tp)._position  # type: ignore[no-any-return]


class BatchConsumer(driver.Consumer):
    """Faust's aiokafka consumer without the per-message `wait_first`, and without the conductor for the topics
    the agents read in batches.

    Measured on 2 cores, a Faust agent that does nothing moves ~5k events/s, `stream.take` included: the
    consumer wraps every message in `wait_first` (four asyncio tasks a message), and the stream iterates one
    event at a time. This hands each message to the conductor directly; `batches` then skips the stream.
    A message of a topic in `StreamsApp.batch_topics` (raw bytes, read by one agent) skips the conductor too:
    it goes into the agent's channel as the conductor would put it, without the conductor's lock, its
    serializers (raw bytes stay bytes) and its check of Faust's producer buffer, which this worker never
    fills (it writes through the outbox). In a py-spy profile of `bench_streams.py` that cut handing a record
    to the agent from 12.7% of the worker's samples to about 5%.
    """

    seeks = 0  # perform_seek calls: a fetch that spans one returns records from before the seek
    handed_over = 0  # records put into an agent's channel without the conductor
    _event_type: Any = None  # the app's Event class (read once: each read of a setting costs)
    _pressure: Optional[dict[Any, tuple[Callable[[], None], Callable[[], None]]]] = None

    def _batch_channel(self, tp: Any) -> Any:
        """The channel of the only agent reading `tp`, when its topic is read in batches; else None."""
        if tp.topic not in self.app.batch_topics:  # type: ignore[attr-defined]
            return None
        channels = self.app.topics._tp_index.get(tp)  # type: ignore[attr-defined]
        return next(iter(channels)) if channels is not None and len(channels) == 1 else None

    async def _hand_over(self, channel: Any, message: Any) -> None:
        """Put the message into the channel as Faust's conductor does: an Event holding one reference, acked
        by the agent; while a rebalance suspends the flow, wait."""
        flow = self.app.flow_control
        if not flow.is_active():
            await flow.acquire()
        tp = message.tp
        message.incref(1)
        if self._event_type is None:
            self._event_type = self.app.conf.Event
        event = self._event_type(self.app, message.key, message.value, message.headers, message)
        queue = channel.queue
        if queue.full():
            self.app.sensors.on_topic_buffer_full(tp)
            await channel.put(event)
        else:
            high, drop = self._pressure_callbacks(tp)
            queue.put_nowait_enhanced(event, on_pressure_high=high, on_pressure_drop=drop)
        self.handed_over += 1

    def _pressure_callbacks(self, tp: Any) -> tuple[Callable[[], None], Callable[[], None]]:
        """The conductor's callbacks for a filling channel: stop fetching the partition, and fetch it again once
        the agent drained it. The queue keeps the second in a set, so each partition's stay the same objects."""
        if self._pressure is None:
            self._pressure = {}
        found = self._pressure.get(tp)
        if found is None:
            # Faust's own TP: the consumer's partition sets assert it, and the fetched records carry aiokafka's
            tp = TP(tp.topic, tp.partition)

            def high() -> None:
                self.app.sensors.on_topic_buffer_full(tp)
                self.on_buffer_full(tp)

            def drop() -> None:
                self.on_buffer_drop(tp)

            found = self._pressure[tp] = (high, drop)
        return found

    async def perform_seek(self) -> None:
        self.seeks += 1
        await super().perform_seek()

    def _epoch(self) -> tuple[int, int]:
        """Changes with every rebalance (the group generation) and every seek to the committed offsets."""
        return self.app.consumer_generation_id, self.seeks

    async def _fetch(self, timeout: float) -> tuple[dict[Any, list[Any]], dict[Any, Optional[int]]]:
        """Records of the active partitions, and each one's fetch position right after them (read in the
        consumer's thread with the fetch: a seek made since then shows as another position)."""
        if not self.flow_active:
            await self.wait(self.can_resume_flow)  # type: ignore[arg-type]
        active = set(self._get_active_partitions())
        if not active:
            await self.sleep(1)
            return {}, {}
        thread = self._thread
        client = thread._ensure_consumer()

        async def fetch() -> tuple[dict[Any, list[Any]], dict[Any, Optional[int]]]:
            records = await thread._fetch_records(client, active, timeout=timeout,
                                                  max_records=client._max_poll_records)
            return dict(records), {tp: fetch_position(client, tp) for tp in records}

        return await thread.call_thread(fetch)  # type: ignore[no-any-return]

    async def _rewind(self, undelivered: dict[Any, int], positions: dict[Any, Optional[int]]) -> None:
        """Put each partition back at its first undelivered record, unless a seek moved it since the fetch
        (then that seek stands). Faust's own fetch loop drops such records and counts on a seek to the
        committed offsets to fetch them again, which moves no changelog partition and no partition without
        a committed offset: a worker that took over a partition nobody had committed on, or that was
        recovering a changelog, waited forever for records it had dropped."""
        if not undelivered:
            return
        client = self._thread._ensure_consumer()

        async def rewind() -> None:  # in the consumer's thread: no fetch or seek of it runs in between
            for tp, offset in undelivered.items():
                if positions.get(tp) is not None and fetch_position(client, tp) == positions[tp]:
                    client.seek(tp, offset)

        await self._thread.call_thread(rewind)

    async def _drain_messages(self, fetcher: Any) -> None:  # pragma: no cover - runs against a broker
        callback = self.callback
        consumer_stopped, fetcher_stopped = self._stopped.is_set, fetcher._stopped.is_set
        suspended = self.suspend_flow.is_set
        try:
            while not (consumer_stopped() or fetcher_stopped()):
                # Faust notes the generation only once its fetch returns, so records fetched before a
                # rebalance that completed meanwhile would pass as current: delivered from their old
                # positions, they would make the gap up to the committed offset look acked and drop the
                # records fetched again from there. The epoch is taken before the fetch instead.
                epoch = self._epoch()
                records, positions = await self._fetch(timeout=1.0)
                await asyncio.sleep(0)
                if not records or self.should_stop:
                    continue
                delivered = dict.fromkeys(records, 0)
                for tp in records:  # the lag the monitor shows: each partition's end, once a fetch
                    self.app.monitor.track_tp_end_offset(tp, self.highwater(tp))
                paused: set[Any] = set()
                n = 0
                for tp, record in self.scheduler.iterate(records):
                    if suspended() or self._epoch() != epoch:
                        break  # a rebalance or seek: what is left is rewound below (or the seek moved it)
                    if tp in paused:
                        continue
                    if tp not in self._get_active_partitions() and tp not in self._buffered_partitions:
                        paused.add(tp)  # paused since the fetch (recovery): its records come again
                        continue
                    if not await self._deliver(tp, self._to_message(tp, record), callback, epoch):
                        break
                    delivered[tp] += 1
                    n += 1
                    if n % 256 == 0:
                        await asyncio.sleep(0)  # let agents and timers run during large fetches
                await self._rewind({tp: rs[delivered[tp]].offset for tp, rs in records.items()
                                    if delivered[tp] < len(rs)}, positions)
        except self.consumer_stopped_errors:
            if self.transport.app.should_stop:
                return
            raise
        except asyncio.CancelledError:
            if self.transport.app.should_stop:
                return
            raise

    async def _deliver(self, tp: Any, message: Any, callback: Any, epoch: tuple[int, int]) -> bool:  # pragma: no cover
        """Hand one record to the agents; False when a rebalance completed meanwhile."""
        offset = message.offset
        if self._commit_every is not None and self._n_acked >= self._commit_every:
            self._n_acked = 0
            await self.commit()  # awaits the outbox: a rebalance may complete meanwhile
            if self._epoch() != epoch:
                return False
        read = self._read_offset[tp]
        if read is not None and offset < read:
            return True
        if read and offset - read > 1 and self.app.topics.acks_enabled_for(message.topic):
            await self._add_gap(tp, read + 1, offset)  # compacted or transactional gaps stay committable
        if self._epoch() != epoch:
            return False
        channel = self._batch_channel(tp)
        if channel is None:  # either waits only while Faust's flow is suspended (a rebalance) or a queue is full
            await callback(message)
        else:
            await self._hand_over(channel, message)
        if self._epoch() != epoch:  # the seek set the read offset; this record's would be stale
            return False
        self._read_offset[tp] = offset
        return True


class OutboxProducer(driver.Producer):
    """Faust's producer, whose flush (awaited before each offset commit) also flushes the outbox."""

    async def flush(self) -> None:
        await super().flush()
        outbox: Optional[Outbox] = getattr(self.app, "outbox", None)
        if outbox is not None:
            await outbox.flush()


class Transport(driver.Transport):
    Consumer = BatchConsumer
    Producer = OutboxProducer


class StreamsApp(faust.App):
    """A Faust app with the batch transport and an `outbox` for every record the worker writes."""

    outbox: Optional[Outbox] = None
    batch_topics: frozenset[str] = frozenset()  # topics of raw bytes, one agent each, read by `batches`
    failure: Optional[BaseException] = None  # set when a batch failed: the worker exits non-zero
    stop_worker: Optional[Callable[[], None]] = None  # how a failed batch stops the worker (set by __main__)
    on_stopping: Optional[Callable[[], Awaitable[None]]] = None  # e.g. publish the last metrics window

    async def on_stop(self) -> None:
        if self.on_stopping is not None:
            await self.on_stopping()
        await super().on_stop()  # commits after the producer (and so the outbox) is flushed
        if self.outbox is not None:
            await self.outbox.flush()
        consumer = self._consumer  # only if one was made: `self.consumer` would make it now
        if isinstance(consumer, BatchConsumer):
            log.info("%d records handed to the agents without the conductor", consumer.handed_over)

    def _new_transport(self) -> Transport:
        return Transport(self.conf.broker_consumer, self)

    def _new_producer_transport(self) -> Transport:
        return Transport(self.conf.broker_producer, self)


async def batches(stream: StreamT, max_size: int, wait_s: float) -> AsyncIterator[list[EventT]]:
    """Events of the agent's stream in lists of up to `max_size`; waits `wait_s` for a small list to fill
    (fewer changelog writes per event), never when the stream is busy (the wait would only idle the worker).

    The caller must ack every event of a list (`event.ack()`) once its outputs are queued.
    """
    queue = aiter(stream.channel).queue  # type: ignore[attr-defined]
    while True:
        try:
            batch = [await queue.get()]
            _drain(queue, batch, max_size)
            if len(batch) * SMALL_BATCH < max_size and wait_s > 0:
                await asyncio.sleep(wait_s)
                _drain(queue, batch, max_size)
        except StopAsyncIteration:
            # Faust stops a stream by throwing this into its channel, also while a batch fills: the
            # batch's events are not acked, so a restarted worker gets them again.
            return
        yield batch


def _drain(queue: Any, batch: list[EventT], max_size: int) -> None:
    while len(batch) < max_size and not queue.empty():
        batch.append(queue.get_nowait())


class PartitionedTable(Generic[V]):
    """A Faust table read as a dict and written with an explicit changelog partition, through the outbox.

    Faust's dict API takes the partition from the current event, which a timer has not and a batch has
    many of. The in-memory store is what Faust recovers from the changelog on start, so a restarted
    worker sees every value written here before its last committed offset.
    """

    def __init__(self, table: TableT, dump: Any) -> None:
        self.table = table
        self.dump = dump
        # The partition of every key written here (Faust tracks the ones it recovered from the changelog
        # itself, and drops those of partitions it no longer holds once recovery completes).
        self.partition_of: dict[bytes, int] = {}

    @property
    def topic(self) -> str:
        return self.table.changelog_topic.get_topic_name()

    def get(self, key: bytes) -> Optional[V]:
        return self.table.data.get(key)  # type: ignore[no-any-return]

    def items(self) -> list[tuple[bytes, V]]:
        """Every value but the worker's own records (keys starting with NUL, which ids never hold)."""
        return [(key, value) for key, value in self.table.data.items() if key[:1] != b"\x00"]

    def __len__(self) -> int:
        return len(self.items())

    def put(self, outbox: Outbox, partition: int, key: bytes, value: V) -> None:
        self.table.data[key] = value
        self.partition_of[key] = partition
        outbox.send(self.topic, key, self.dump(value), partition)

    def keep_partitions(self, partitions: set[int]) -> list[bytes]:
        """Forget what this worker wrote for partitions it no longer holds (their new owner recovers them from
        the changelog); returns the keys let go."""
        gone = [key for key, partition in self.partition_of.items() if partition not in partitions]
        for key in gone:
            self.table.data.pop(key, None)
            del self.partition_of[key]
        return gone

    def log(self, outbox: Outbox, partition: int, key: bytes, value: V) -> None:
        """Write the value to the changelog only: the caller keeps it in memory elsewhere until it is deleted,
        and a restarted worker finds it in the table."""
        outbox.send(self.topic, key, self.dump(value), partition)

    def delete(self, outbox: Outbox, partition: int, key: bytes, tombstone: bool = True) -> None:
        """Remove the key; `tombstone=False` when it was never written to the changelog."""
        self.table.data.pop(key, None)
        self.partition_of.pop(key, None)
        if tombstone:
            outbox.send(self.topic, key, None, partition)
