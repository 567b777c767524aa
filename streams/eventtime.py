"""Event time per producer clock, trusting producer clocks only as far as they can be checked.

    clock = EventTime(max_skew_ms=2000)
    clock.observe((partition, producer_id), event.ts)   # every event, in log order (True: the ts was capped)
    clock.touch(key, (partition, producer_id))          # an event of `key` was just taken
    clock.idle_ms(key, wall_idle_s)                     # how long `key` has been idle: event or wall time
    clock.forget(key)                                   # `key` closed
    clock.forget_unused()                               # drop the clocks no open item was touched on
    clock.age_ms(partition, ts, wall_idle_s)            # for long horizons: against the partition's watermark

Timestamps are compared only with timestamps of the same clock (a producer on a partition): producers whose
clocks are minutes apart then share a partition without making each other's episodes look idle. Each
timestamp is capped at this worker's clock plus `max_skew_ms`, so one from the future moves its clock at most
that far. An item's idleness is how far its clock moved since the worker last touched the item, or the wall
time since then, whichever is longer: a quiet log does not stop the clock, and a replay (event time faster
than wall time) ages items at its own pace. An item this worker never touched (recovered from a changelog)
has no clock and ages by wall time from when the worker could read the log again (its start, or the end of
a recovery or rebalance: the sweeper's `ready_since`), so a restart does not age it.
"""
from __future__ import annotations

import time
from typing import Callable, Hashable, Optional


def wall_ms() -> int:
    return int(time.time() * 1000)


class EventTime:
    def __init__(self, max_skew_ms: int, now_ms: Callable[[], int] = wall_ms) -> None:
        self.max_skew_ms = max_skew_ms
        self.now_ms = now_ms
        self.clocks: dict[Hashable, int] = {}  # (partition, producer) -> largest (capped) timestamp seen
        self.partitions: dict[int, int] = {}  # partition -> largest (capped) timestamp of any clock
        self.marks: dict[bytes, tuple[Hashable, int]] = {}  # key -> (its clock, that clock's time at the touch)

    def observe(self, clock: tuple[int, str], ts: int) -> bool:
        """Move the clock to `ts`; True when `ts` was capped (a clock ahead of this worker's)."""
        cap = self.now_ms() + self.max_skew_ms
        capped = ts > cap
        if capped:
            ts = cap
        if ts > self.clocks.get(clock, ts - 1):
            self.clocks[clock] = ts
        partition = clock[0]
        if ts > self.partitions.get(partition, ts - 1):
            self.partitions[partition] = ts
        return capped

    def touch(self, key: bytes, clock: tuple[int, str]) -> None:
        self.marks[key] = (clock, self.clocks.get(clock, 0))

    def forget(self, key: bytes) -> None:
        self.marks.pop(key, None)

    def forget_unused(self) -> int:
        """Drop the clocks no item holds a mark on: each restarted rollout worker is a new producer id, and its old
        clocks would stay for the worker's life. A producer still writing starts its clock again at its next
        event, before any item is touched on it. Returns how many were dropped."""
        used = {clock for clock, _ in self.marks.values()}
        unused = [clock for clock in self.clocks if clock not in used]
        for clock in unused:
            del self.clocks[clock]
        return len(unused)

    def idle_ms(self, key: bytes, wall_idle_s: float) -> float:
        """Event time its clock advanced since `key` was last touched, or wall time if longer."""
        mark: Optional[tuple[Hashable, int]] = self.marks.get(key)
        event_idle = 0.0 if mark is None else float(self.clocks.get(mark[0], mark[1]) - mark[1])
        return max(event_idle, wall_idle_s * 1000.0)

    def age_ms(self, partition: int, ts: int, wall_idle_s: float) -> float:
        """How old a timestamp is against its partition's (capped) watermark, or wall time if longer: for
        long horizons (forgetting closed markers), where a producer's lag is small against the horizon."""
        return max(float(self.partitions.get(partition, 0) - ts), wall_idle_s * 1000.0)
