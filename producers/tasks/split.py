"""A stable train / held-out split of any task source, by a hash of the task id (evaluation never trains)."""
from __future__ import annotations

import hashlib

from producers.tasks.task import Task, TaskSource
from schemas.errors import ConfigError

SPLITS = ("train", "heldout", "all")


def is_heldout(task_id: str, every: int = 5) -> bool:
    """One task in `every` is held out, the same ones on every machine and run."""
    return int(hashlib.sha256(task_id.encode()).hexdigest()[:8], 16) % every == 0


class SplitSource:
    """The tasks of `source` on one side of the split, indexable like any source."""

    def __init__(self, source: TaskSource, split: str, every: int = 5) -> None:
        if split not in SPLITS:
            raise ConfigError(f"split {split!r}: choose one of {SPLITS}")
        self.source, self.split = source, split
        self.name, self.domain = source.name, source.domain
        keep = (lambda t: True) if split == "all" else (lambda t: is_heldout(t, every) == (split == "heldout"))
        # A source that names its tasks without making them (task_id(i)) spares making every one here.
        task_id = getattr(source, "task_id", None) or (lambda i: source[i].task_id)
        self._index = [i for i in range(len(source)) if keep(task_id(i))]
        if not self._index:
            raise ConfigError(f"task source {source.name!r} has no {split} tasks")

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, index: int) -> Task:
        return self.source[self._index[index]]
