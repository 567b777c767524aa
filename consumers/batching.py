"""Per-partition batching of scored trajectories for the shard writer: size and time bounds, replayed plans.

    batcher = Batcher(BatchBounds(max_trajectories=64, max_bytes=8 << 20, max_age_s=5.0))
    batcher.set_plan(partition, {10: 19})          # shards already in the store: the same cut again
    for batch in batcher.add(partition, offset, trajectory, size, time.monotonic()):
        write(batch)                               # closed batches, in offset order
    for batch in batcher.due(time.monotonic()):    # the time bound
        write(batch)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

from schemas.errors import ConfigError
from schemas.records import Trajectory


@dataclass(frozen=True)
class BatchBounds:
    max_trajectories: int = 256
    max_bytes: int = 16 * 1024 * 1024
    max_age_s: float = 5.0

    def __post_init__(self) -> None:
        if self.max_trajectories < 1:
            raise ConfigError(f"max_batch_trajectories must be >= 1, got {self.max_trajectories}")
        if self.max_bytes < 1:
            raise ConfigError(f"max_batch_bytes must be >= 1, got {self.max_bytes}")
        if not self.max_age_s > 0:
            raise ConfigError(f"max_batch_age_s must be > 0, got {self.max_age_s}")


@dataclass
class OpenBatch:
    """Trajectories of one partition, contiguous in offsets apart from dead-lettered records."""

    partition: int
    opened_at: float
    # Set when a shard starting here already exists: the batch must end exactly where that shard ends.
    planned_last: Optional[int] = None
    trajectories: list[Trajectory] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    nbytes: int = 0
    end: int = -1  # highest offset consumed into this batch, dead-lettered records included
    ids: set[str] = field(default_factory=set)

    @property
    def first(self) -> int:
        return self.offsets[0]

    @property
    def last(self) -> int:
        return self.offsets[-1]

    def append(self, offset: int, trajectory: Trajectory, size: int) -> None:
        self.offsets.append(offset)
        self.trajectories.append(trajectory)
        self.ids.add(trajectory.trajectory_id)
        self.nbytes += size
        self.end = offset


class Batcher:
    """Decides where batches start and end; pure, so a restart over the same input cuts the same way."""

    def __init__(self, bounds: BatchBounds) -> None:
        self.bounds = bounds
        self.open: dict[int, OpenBatch] = {}
        self.plans: dict[int, dict[int, int]] = {}

    def set_plan(self, partition: int, plan: dict[int, int]) -> None:
        """`plan` maps first -> last offset of shards already stored for `partition`."""
        self.plans[partition] = dict(plan)

    def add(self, partition: int, offset: int, trajectory: Trajectory, size: int, now: float) -> list[OpenBatch]:
        """Add one record; return the batches it closed (at most two: the one before it and its own)."""
        closed: list[OpenBatch] = []
        plan = self.plans.setdefault(partition, {})
        batch = self.open.get(partition)
        if batch is not None and self._ends_before(batch, offset, size, plan):
            closed.append(self.open.pop(partition))
            batch = None
        if batch is None:
            batch = self.open[partition] = OpenBatch(partition, now, plan.pop(offset, None))
        batch.append(offset, trajectory, size)
        if self._complete(batch):
            closed.append(self.open.pop(partition))
        return closed

    def planned(self, partition: int, offset: int) -> bool:
        """Whether `offset` belongs to a shard already stored (its content was decided before a restart)."""
        batch = self.open.get(partition)
        if batch is not None and batch.planned_last is not None and offset <= batch.planned_last:
            return True
        return any(first <= offset <= last for first, last in self.plans.get(partition, {}).items())

    def holds(self, partition: int, trajectory_id: str) -> bool:
        """Whether the open batch of `partition` already has this trajectory (re-emitted upstream before the
        batch was written: both copies would otherwise go into one shard)."""
        batch = self.open.get(partition)
        return batch is not None and trajectory_id in batch.ids

    def skip(self, partition: int, offset: int) -> Optional[int]:
        """A record that went elsewhere (dead letter): the offset to commit now, or None if a batch covers it."""
        batch = self.open.get(partition)
        if batch is None:
            return offset + 1
        batch.end = offset
        return None

    def due(self, now: float) -> list[OpenBatch]:
        """Batches past the time bound; a planned batch waits for its last record instead."""
        late = [p for p, b in self.open.items() if b.planned_last is None and now - b.opened_at >= self.bounds.max_age_s]
        return [self.open.pop(p) for p in sorted(late)]

    def drain(self) -> tuple[list[OpenBatch], list[OpenBatch]]:
        """(writable, unfinished): an unfinished planned batch must not be written with another cut."""
        batches = [self.open.pop(p) for p in sorted(self.open)]
        return [b for b in batches if b.planned_last is None], [b for b in batches if b.planned_last is not None]

    def revoke(self, partitions: Iterable[int]) -> list[OpenBatch]:
        """Forget partitions this writer no longer owns; their batches are dropped uncommitted."""
        dropped = []
        for p in partitions:
            self.plans.pop(p, None)
            if p in self.open:
                dropped.append(self.open.pop(p))
        return dropped

    @property
    def pending(self) -> int:
        return sum(len(b.offsets) for b in self.open.values())

    def _ends_before(self, batch: OpenBatch, offset: int, size: int, plan: dict[int, int]) -> bool:
        if offset in plan:
            return True
        if batch.planned_last is not None:
            return offset > batch.planned_last
        return batch.nbytes + size > self.bounds.max_bytes

    def _complete(self, batch: OpenBatch) -> bool:
        if batch.planned_last is not None:
            return batch.last >= batch.planned_last
        return len(batch.offsets) >= self.bounds.max_trajectories or batch.nbytes >= self.bounds.max_bytes
