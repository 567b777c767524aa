"""Closed markers in the order they closed, so forgetting the ones past the dedupe horizon looks at the due ones.

    markers = ClosedMarkers()
    markers.add(partition, key, marker)                      # a marker the worker just put in its table
    for partition, key in markers.due(expired, table.get):   # oldest first, up to the first not yet due
        table.delete(outbox, partition, key)
    markers.rebuild(table.items())                           # after a recovery filled the table from its changelog

The tables keep an hour of closed episodes and groups (millions of entries at a few thousand events a
second). Walking all of them every 30 sweeps held the event loop for seconds per million entries. A marker's
age grows with its partition's watermark and with wall time, and markers close in about the order of their
timestamps: read from the oldest, each partition's queue stops at the first marker not yet due. One that
closed out of order waits behind it: forgotten late, never early, which is the safe side for dedupe.
"""
from __future__ import annotations

from collections import defaultdict, deque
from typing import Any, Callable, Iterable, Optional


def _closed_ts(item: tuple[int, bytes, Any]) -> int:
    return item[0]


class ClosedMarkers:
    def __init__(self) -> None:
        self.queues: dict[int, deque[tuple[bytes, Any]]] = {}

    def add(self, partition: int, key: bytes, marker: Any) -> None:
        queue = self.queues.get(partition)
        if queue is None:
            queue = self.queues[partition] = deque()
        queue.append((key, marker))

    def rebuild(self, entries: Iterable[tuple[bytes, Any]]) -> None:
        """Every marker among `entries` (values with `partition` and `closed_ts`), oldest first per partition."""
        by_partition: dict[int, list[tuple[int, bytes, Any]]] = defaultdict(list)
        for key, marker in entries:
            by_partition[marker.partition].append((marker.closed_ts, key, marker))
        self.queues = {}
        for partition, items in by_partition.items():
            items.sort(key=_closed_ts)  # a recovery reads them in about this order already: a quick sort
            self.queues[partition] = deque((key, marker) for _, key, marker in items)

    def due(self, expired: Callable[[Any], bool], current: Callable[[bytes], Optional[Any]]
            ) -> list[tuple[int, bytes]]:
        """(partition, key) of each marker past the horizon, taken off its queue. An entry whose key no longer
        holds that very marker (deleted, let go in a rebalance, or closed again: the newer one is queued behind
        it) is dropped on the way."""
        out: list[tuple[int, bytes]] = []
        for partition, queue in self.queues.items():
            while queue:
                key, marker = queue[0]
                if current(key) is not marker:
                    queue.popleft()
                elif expired(marker):
                    queue.popleft()
                    out.append((partition, key))
                else:
                    break
        return out

    def __len__(self) -> int:
        return sum(len(queue) for queue in self.queues.values())
