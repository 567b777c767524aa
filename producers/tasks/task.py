"""The Task a source hands to a rollout worker, and the TaskSource protocol every source follows."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from schemas.tasks import DOMAINS, encode_task_spec, is_domain, validate_spec


@dataclass(frozen=True)
class Task:
    """One prompt for the policy plus the verifier data (`spec`, see schemas.tasks) the rewards need."""

    task_id: str
    domain: str
    prompt: str
    spec: dict[str, Any]
    max_turns: int = 1
    # A gold completion for SFT (the answer, the canonical solution), or None where the source has none.
    demonstration: str | None = None

    def __post_init__(self) -> None:
        if not is_domain(self.domain):
            raise ValueError(f"task {self.task_id}: domain {self.domain!r} is not one of {DOMAINS} nor rg/<generator> "
                             "nor env/<name>")
        if self.max_turns < 1:
            raise ValueError(f"task {self.task_id}: max_turns must be >= 1, got {self.max_turns}")
        # Fail where the task is made, not downstream when its trajectory is scored.
        validate_spec(self.spec, self.domain)

    @property
    def task_spec(self) -> str:
        """The JSON string that rides in EpisodeStarted.task_spec."""
        return encode_task_spec(self.spec)


class TaskSource(Protocol):
    """A finite, indexable, reproducible collection of tasks of one domain.

        source = load_source("math-easy", seed=0)
        for i in range(len(source)):
            task = source[i]          # same seed and index -> same task

    A source may also have `task_id(i)` (the id of task i without making it): the train/held-out split
    reads ids only, which matters for sources whose tasks are slow to generate.
    """

    name: str
    domain: str

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Task: ...
