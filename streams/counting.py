"""The streams worker's counters, exact across kill -9: per input partition, since the start of the log.

    tally = Tally(tables.episodes, is_open=lambda value: value is not None)   # one per stage
    replayed, fresh = tally.split(messages)     # positions counted before a crash, and new ones
    with tally.muted():                         # a replayed pass: its outputs are re-sent, never re-counted
        ...
    tally.count(partition, ("streams/events", ()), 1)
    tally.advance(messages)                     # the pass counted these positions
    tally.write(outbox)                         # before the pass's state writes to the same table
    with tally.closing(partition, key):         # the sweeper closes `key` (muted if counted before a crash)
        ...
    tally.records(source, window_end_ms)        # PipelineMetric(total=True) per partition and counter

A stage's counts of partition p are a record under `counts_key(p)` in the stage's own changelog table, written
before the pass's state writes to the same changelog partition. The producer keeps each partition's order
(idempotent, acks=all), so a state write that reached the broker follows the counts of the same pass: a
restarted worker, or the partition's next owner, recovers counts that match the state it recovers, and a
replayed position (offset <= the recorded one) is processed again without being counted again.

The sweeper closes items on a timer, not at a position: it counts each closing with the item's key in
`pending` (written before the closing writes), and a closing of a pending key, after a crash that lost the
closing writes, is not counted again. A key leaves `pending` once the table no longer holds it open.
"""
from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol, Sequence

from schemas.records import PipelineMetric
from streams.outbox import Outbox
from streams.runtime import PartitionedTable
from streams.state import PartitionCounts, counts_key

Labels = tuple[tuple[str, str], ...]
Key = tuple[str, Labels]


class Positioned(Protocol):
    partition: int
    offset: int


@dataclass
class Running:
    offset: int = -1
    counts: Counter[Key] = field(default_factory=Counter)
    pending: set[bytes] = field(default_factory=set)
    dirty: bool = False


class Tally:
    def __init__(self, table: PartitionedTable[Any], is_open: Callable[[Any], bool]) -> None:
        self.table = table
        self.is_open = is_open  # whether a value of the table is an item still open (a pending key stays)
        self.parts: dict[int, Running] = {}
        self._muted = 0

    def at(self, partition: int) -> Running:
        """The partition's counts: as this worker left them, or as recovered from the changelog (read after
        recovery: the stage processes a partition only once it is recovered)."""
        running = self.parts.get(partition)
        if running is None:
            stored = self.table.get(counts_key(partition))
            if isinstance(stored, PartitionCounts):
                running = Running(stored.offset, Counter({(n, labels): c for n, labels, c in stored.counts}),
                                  set(stored.pending))
            else:
                running = Running()
            self.parts[partition] = running
        return running

    def split(self, messages: Sequence[Positioned]) -> tuple[list[Any], list[Any]]:
        """(replayed, fresh): the messages at positions already counted, and the rest, each in log order."""
        replayed: list[Any] = []
        fresh: list[Any] = []
        for message in messages:
            (replayed if message.offset <= self.at(message.partition).offset else fresh).append(message)
        return replayed, fresh

    @property
    def is_muted(self) -> bool:
        return self._muted > 0

    @contextmanager
    def muted(self, mute: bool = True) -> Iterator[None]:
        self._muted += mute
        try:
            yield
        finally:
            self._muted -= mute

    def count(self, partition: int, key: Key, n: int = 1) -> None:
        if not self._muted:
            running = self.at(partition)
            running.counts[key] += n
            running.dirty = True

    def advance(self, messages: Sequence[Positioned]) -> None:
        for message in messages:
            running = self.at(message.partition)
            if message.offset > running.offset:
                running.offset = message.offset
                running.dirty = True

    @contextmanager
    def closing(self, partition: int, key: bytes) -> Iterator[None]:
        """The sweeper closes `key`: counted once, even when a crash lost the writes of an earlier closing."""
        running = self.at(partition)
        again = key in running.pending
        if not again:
            running.pending.add(key)
            running.dirty = True
        with self.muted(again):
            yield

    def write(self, outbox: Outbox) -> None:
        """Each changed partition's counts to the changelog (ahead of the state writes that follow)."""
        for partition, running in self.parts.items():
            if not running.dirty:
                continue
            running.pending = {key for key in running.pending if self.is_open(self.table.get(key))}
            value = PartitionCounts(running.offset, tuple(sorted((n, labels, c) for (n, labels), c
                                                                 in running.counts.items())),
                                    frozenset(running.pending))
            self.table.put(outbox, partition, counts_key(partition), value)
            running.dirty = False

    def keep_partitions(self, partitions: set[int]) -> None:
        """After a rebalance: the counts of partitions this worker no longer holds are their new owner's."""
        self.parts = {p: running for p, running in self.parts.items() if p in partitions}


def records(source: str, tallies: Sequence[Tally], window_end_ms: int) -> list[PipelineMetric]:
    """Every counter of each partition the tallies hold, summed over the stages: cumulative (`total`), so a
    reader keeps the newest value of each partition and sums the partitions."""
    summed: Counter[tuple[int, Key]] = Counter()
    for tally in tallies:
        for partition, running in tally.parts.items():
            for key, n in running.counts.items():
                summed[(partition, key)] += n
    return [PipelineMetric(source=source, name=name, value=float(n),
                           labels={**dict(labels), "partition": str(partition)},
                           window_start=0, window_end=window_end_ms, total=True)
            for (partition, (name, labels)), n in sorted(summed.items())]
