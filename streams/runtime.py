"""Faust plumbing at batch cost, keeping Faust's consumer group, acks, commits and table recovery.

    async for batch in batches(stream, max_size=4000, wait_s=0.02):   # what one agent's channel holds
        ...batch.messages...                                         # outputs to app.outbox
        batch.ack()                                                  # then Faust may commit them
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Awaitable, Callable, Generic, Optional, TypeVar

import faust
from faust.transport.drivers import aiokafka as driver
from faust.types import EventT, StreamT, TableT
from faust.types.tuples import ack_lock
from mode.utils.futures import notify

from streams.outbox import Outbox

log = logging.getLogger(__name__)
V = TypeVar("V")
SMALL_BATCH = 8  # a batch under 1/8 of the maximum waits for more events
CHUNK = 256  # records of one partition handed to an agent at once (at most the batch's maximum)


class Record:
    """A message Faust made (an agent's test context puts them), as the stages read it: see
    `streams.pipeline.Message`. Chunks hand aiokafka's records over as they are."""

    __slots__ = ("topic", "partition", "offset", "key", "value", "timestamp")

    def __init__(self, topic: str, partition: int, offset: int, key: Optional[bytes], value: Optional[bytes],
                 timestamp: int) -> None:
        self.topic, self.partition, self.offset = topic, partition, offset
        self.key, self.value, self.timestamp = key, value, timestamp

    @classmethod
    def of(cls, message: Any) -> "Record":
        """Faust's message, whose timestamp is in seconds."""
        return cls(message.topic, message.partition, message.offset, message.key, message.value,
                   int(round((message.timestamp or 0) * 1000)))


class Budget:
    """How many handed-over records an agent's channel holds: the consumer waits while it holds its maximum."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.pending = 0
        self.drained = asyncio.Event()

    def take(self, n: int) -> None:
        self.pending = max(self.pending - n, 0)
        if self.pending < self.limit:
            self.drained.set()

    def recount(self, queue: Any) -> None:
        """The records of the chunks the queue still holds (a rebalance clears the queue without a take)."""
        self.pending = sum(len(item.records) for item in list(queue._queue) if isinstance(item, Chunk))


class Chunk:
    """Consecutive records of one partition put into an agent's channel as one item, acked together: Faust's
    conductor would make a message, an event and an ack for each."""

    __slots__ = ("consumer", "tp", "records", "budget")

    def __init__(self, consumer: Optional["BatchConsumer"], tp: Any, records: list[Any], budget: Budget) -> None:
        self.consumer, self.tp, self.records, self.budget = consumer, tp, records, budget

    def ack(self) -> None:
        if self.consumer is not None:
            self.consumer.ack_offsets(self.tp, self.records[0].topic, [r.offset for r in self.records])


class Batch:
    """What an agent took from its channel: the messages in order, acked together once their outputs are sent."""

    __slots__ = ("messages", "events", "chunks")

    def __init__(self) -> None:
        self.messages: list[Any] = []
        self.events: list[EventT] = []
        self.chunks: list[Chunk] = []

    def add(self, item: Any) -> None:
        if isinstance(item, Chunk):
            self.chunks.append(item)
            self.messages.extend(item.records)
        else:  # an event Faust's conductor (or an agent's test context) put there
            self.events.append(item)
            self.messages.append(Record.of(item.message))

    def ack(self) -> None:
        for event in self.events:
            event.ack()
        for chunk in self.chunks:
            chunk.ack()

    def __len__(self) -> int:
        return len(self.messages)


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
    The records of a topic in `StreamsApp.batch_topics` (raw bytes, read by one agent) skip the conductor and
    Faust's messages and events too: up to `CHUNK` consecutive records of a partition go into the agent's
    channel as one `Chunk`, acked together (`ack_offsets`, Faust's ack bookkeeping for a list of offsets), and
    the consumer stops fetching while the channel holds `stream_buffer_maxsize` records.
    """

    seeks = 0  # perform_seek calls: a fetch that spans one returns records from before the seek
    handed_over = 0  # records put into an agent's channel without the conductor
    _budgets: Optional[dict[int, Budget]] = None  # by id of the agent's channel

    def _batch_channel(self, tp: Any) -> Any:
        """The channel of the only agent reading `tp`, when its topic is read in batches; else None."""
        if tp.topic not in self.app.batch_topics:  # type: ignore[attr-defined]
            return None
        channels = self.app.topics._tp_index.get(tp)  # type: ignore[attr-defined]
        return next(iter(channels)) if channels is not None and len(channels) == 1 else None

    def _budget(self, channel: Any) -> Budget:
        if self._budgets is None:
            self._budgets = {}
        found = self._budgets.get(id(channel))
        if found is None:
            found = self._budgets[id(channel)] = Budget(max(int(self.app.conf.stream_buffer_maxsize), 1))
        return found

    def ack_offsets(self, tp: Any, topic: str, offsets: list[int]) -> None:
        """`Consumer.ack` for many offsets of one partition at once: Faust commits up to the first gap."""
        if not self.app.topics.acks_enabled_for(topic):
            return
        with ack_lock:
            committed = self._committed_offset[tp]
            index = self._acked_index[tp]
            fresh = [o for o in offsets if (committed is None or o >= committed) and o not in index]
            index.update(fresh)
            self._acked[tp].extend(fresh)
            self._n_acked += len(fresh)
            notify(self._waiting_for_ack)

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
                channels = {tp: self._batch_channel(tp) for tp in records}
                stopped = False
                n = 0
                plain = {tp: rs for tp, rs in records.items() if channels[tp] is None}
                paused: set[Any] = set()
                for tp, record in self.scheduler.iterate(plain) if plain else ():
                    if suspended() or self._epoch() != epoch:
                        stopped = True
                        break  # a rebalance or seek: what is left is rewound below (or the seek moved it)
                    if tp in paused:
                        continue
                    if not self._is_active(tp):
                        paused.add(tp)  # paused since the fetch (recovery): its records come again
                        continue
                    if not await self._deliver(tp, self._to_message(tp, record), callback, epoch):
                        stopped = True
                        break
                    delivered[tp] += 1
                    n += 1
                    if n % 256 == 0:
                        await asyncio.sleep(0)  # let agents and timers run during large fetches
                size = self._chunk_size()
                for tp, rs in records.items():
                    channel = channels[tp]
                    if channel is None:
                        continue
                    while not stopped and delivered[tp] < len(rs):
                        if suspended() or self._epoch() != epoch:
                            stopped = True
                        elif not self._is_active(tp):
                            break
                        elif await self._deliver_chunk(tp, rs[delivered[tp]:delivered[tp] + size], channel, epoch):
                            delivered[tp] = min(delivered[tp] + size, len(rs))
                            await asyncio.sleep(0)
                        else:
                            stopped = True
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
        if not await self._commit_if_due(epoch):
            return False
        read = self._read_offset[tp]
        if read is not None and offset < read:
            return True
        await self._add_gaps(tp, message.topic, read, (offset,))
        if self._epoch() != epoch:
            return False
        await callback(message)  # waits only while Faust's flow is suspended (a rebalance) or a queue is full
        if self._epoch() != epoch:  # the seek set the read offset; this record's would be stale
            return False
        self._read_offset[tp] = offset
        return True

    async def _add_gaps(self, tp: Any, topic: str, read: Optional[int], offsets: Any) -> None:
        """Offsets skipped before each of `offsets` (from the read offset on: compacted or transactional gaps)
        stay committable."""
        if not self.app.topics.acks_enabled_for(topic):
            return
        previous = read
        for offset in offsets:
            if previous and offset - previous > 1:
                await self._add_gap(tp, previous + 1, offset)
            previous = offset

    async def _commit_if_due(self, epoch: tuple[int, int]) -> bool:
        if self._commit_every is not None and self._n_acked >= self._commit_every:
            self._n_acked = 0
            await self.commit()  # awaits the outbox: a rebalance may complete meanwhile
            return self._epoch() == epoch
        return True

    def _is_active(self, tp: Any) -> bool:
        return tp in self._get_active_partitions() or tp in self._buffered_partitions

    def _chunk_size(self) -> int:
        return max(1, min(CHUNK, int(getattr(self.app, "batch_max", CHUNK))))

    async def _deliver_chunk(self, tp: Any, records: list[Any], channel: Any, epoch: tuple[int, int]
                             ) -> bool:  # pragma: no cover - runs against a broker
        """Hand consecutive records of one partition to its agent as one chunk, as `_deliver` hands each record
        (gaps in the offsets stay committable, records before the read offset are skipped); False when a
        rebalance or seek came meanwhile."""
        if not await self._commit_if_due(epoch):
            return False
        read = self._read_offset[tp]
        if read is not None and records[0].offset < read:
            records = [r for r in records if r.offset >= read]
            if not records:
                return True
        consecutive = records[-1].offset - records[0].offset == len(records) - 1
        await self._add_gaps(tp, records[0].topic, read,
                             (records[0].offset,) if consecutive else [r.offset for r in records])
        budget = self._budget(channel)
        while budget.pending >= budget.limit:
            budget.recount(channel.queue)
            if budget.pending < budget.limit:
                break
            budget.drained.clear()
            try:
                await asyncio.wait_for(budget.drained.wait(), 1.0)
            except asyncio.TimeoutError:
                pass
            if self.should_stop or self._epoch() != epoch:
                return False
        flow = self.app.flow_control
        if not flow.is_active():
            await flow.acquire()
        if self._epoch() != epoch:
            return False
        chunk = Chunk(self, tp, records, budget)  # aiokafka's records: the stages read their fields
        channel.queue.put_nowait(chunk)
        budget.pending += len(records)
        self.handed_over += len(records)
        self._read_offset[tp] = records[-1].offset
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
    batch_max: int = CHUNK  # the agents' largest batch: a chunk holds no more
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


async def batches(stream: StreamT, max_size: int, wait_s: float) -> AsyncIterator[Batch]:
    """What the agent's channel holds, in batches of up to `max_size` messages (a chunk is never split: one
    ends a batch early rather than make it larger); waits `wait_s` for a small batch to fill (fewer changelog
    writes per event), never when the stream is busy (the wait would only idle the worker).

    The caller must ack each batch (`batch.ack()`) once its outputs are queued.
    """
    queue = aiter(stream.channel).queue  # type: ignore[attr-defined]
    carried: Optional[Any] = None  # an item that would have made the last batch too large
    while True:
        batch = Batch()
        try:
            if carried is None:
                carried = _taken(await queue.get())
            carried = _drain(queue, batch, max_size, carried)
            if carried is None and len(batch) * SMALL_BATCH < max_size and wait_s > 0:
                await asyncio.sleep(wait_s)
                carried = _drain(queue, batch, max_size, None)
        except StopAsyncIteration:
            # Faust stops a stream by throwing this into its channel, also while a batch fills: the
            # batch's events are not acked, so a restarted worker gets them again.
            return
        yield batch


def _taken(item: Any) -> Any:
    if isinstance(item, Chunk):
        item.budget.take(len(item.records))
    return item


def _drain(queue: Any, batch: Batch, max_size: int, item: Optional[Any]) -> Optional[Any]:
    """Items into the batch, starting with `item`, until it is full; returns one taken that did not fit."""
    while True:
        if item is None:
            if len(batch) >= max_size or queue.empty():
                return None
            item = _taken(queue.get_nowait())
        if batch.messages and len(batch) + (len(item.records) if isinstance(item, Chunk) else 1) > max_size:
            return item
        batch.add(item)
        item = None


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
