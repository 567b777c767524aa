"""Data mixing across task sources by weight, with a curriculum that skips tasks that teach nothing."""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from typing import Mapping, MutableMapping, Sequence

from producers.tasks.task import Task, TaskSource
from schemas.errors import PipelineError

ALWAYS_SOLVED = "always_solved"
NEVER_SOLVED = "never_solved"
DOMAIN = "domain_"  # a skip of a whole source: domain_always_solved, domain_never_solved


class TasksExhausted(PipelineError):
    """Every task of every source is skipped by a curriculum that does not probe (probe=0)."""


@dataclass(frozen=True)
class Curriculum:
    """Skip a task once it has `min_attempts` attempts and a pass rate of exactly 1.0 or 0.0; skip a whole
    source (a domain) once the tasks drawn from it most recently have `domain_min_attempts` attempts together,
    all passed or none (with a hundred domains, single tasks come round too rarely to gather attempts of their
    own). The domain's verdict reads its latest tasks only, so a domain the policy has learned since its first
    failures is retired as always solved.

    Such a task gives every sample of a GRPO group the same reward: zero advantage, no gradient. But the
    policy changes: a `probe` share of draws ignores the verdicts, so a task or a domain the policy learns
    later comes back (one pass ends "never solved"), and when every task is retired the draws go on as
    probes instead of stopping the worker.
    """

    min_attempts: int = 8
    domain_min_attempts: int = 32
    probe: float = 0.05

    def __post_init__(self) -> None:
        if not 0.0 <= self.probe <= 1.0:
            raise ValueError(f"the curriculum's probe share must be in [0, 1], got {self.probe}")

    def verdict(self, attempts: int, passes: int, at_least: int | None = None) -> str | None:
        if attempts < (self.min_attempts if at_least is None else at_least):
            return None
        if passes >= attempts:
            return ALWAYS_SOLVED
        return NEVER_SOLVED if passes == 0 else None

    def domain_verdict(self, attempts: int, passes: int) -> str | None:
        found = self.verdict(attempts, passes, self.domain_min_attempts)
        return None if found is None else DOMAIN + found


class _Cursor:
    """Walks a source in a seeded random order, reshuffled each epoch."""

    def __init__(self, source: TaskSource, rng: random.Random) -> None:
        self.source, self._rng = source, rng
        self._order: list[int] = []

    def next(self) -> Task:
        if not self._order:
            self._order = list(range(len(self.source)))
            self._rng.shuffle(self._order)
        return self.source[self._order.pop()]


def resolve_weights(sources: Sequence[TaskSource], weights: Mapping[str, float] | None) -> list[float]:
    """A weight per source: keyed by source name, else by domain (shared equally by that domain's sources)."""
    if not weights:
        return [1.0] * len(sources)
    per_domain = Counter(s.domain for s in sources if s.name not in weights)
    resolved = [weights[s.name] if s.name in weights else weights.get(s.domain, 0.0) / per_domain[s.domain]
                for s in sources]
    if any(w < 0 for w in resolved) or sum(resolved) <= 0:
        raise ValueError(f"task weights {dict(weights)} give no positive weight to sources "
                         f"{[s.name for s in sources]}; key them by source name or domain")
    return resolved


class TaskMixer:
    """Draws tasks from several sources in proportion to their weights.

        mixer = TaskMixer([load_source("math-easy"), load_source("table")], {"math": 0.8, "table": 0.2}, seed=0)
        task = mixer.next()
        mixer.update_stats(task.task_id, attempts=8, passes=8)   # from the TaskStats topic
        mixer.skips                                               # Counter: always_solved / never_solved,
                                                                  # domain_always_solved / domain_never_solved
        mixer.probes, mixer.exhausted                             # draws that ignored the verdicts; of them,
                                                                  # those made because everything was retired
    """

    def __init__(self, sources: Sequence[TaskSource], weights: Mapping[str, float] | None = None, seed: int = 0,
                 stats: MutableMapping[str, tuple[int, int]] | None = None,
                 curriculum: Curriculum | None = Curriculum()) -> None:
        if not sources:
            raise ValueError("TaskMixer needs at least one task source")
        self.sources = list(sources)
        self.weights = resolve_weights(self.sources, weights)
        self.stats: MutableMapping[str, tuple[int, int]] = stats if stats is not None else {}
        self.curriculum = curriculum
        self.skips: Counter[str] = Counter()
        self.drawn: Counter[str] = Counter()
        # per source: the task ids it gave, oldest first (a task drawn again moves to the end)
        self.drawn_ids: list[dict[str, None]] = [{} for _ in self.sources]
        self.probes = 0
        self.exhausted = 0
        self._rng = random.Random(seed)
        self._cursors = [_Cursor(s, random.Random(f"{seed}:{s.name}")) for s in self.sources]

    def update_stats(self, task_id: str, attempts: int, passes: int) -> None:
        self.stats[task_id] = (attempts, passes)

    def skip_reason(self, task_id: str) -> str | None:
        if self.curriculum is None or task_id not in self.stats:
            return None
        return self.curriculum.verdict(*self.stats[task_id])

    def domain_skip_reason(self, pick: int) -> str | None:
        """Why source `pick` is skipped as a whole, from the pooled stats of the tasks drawn from it last: the
        newest tasks with stats, back until they hold `domain_min_attempts` attempts."""
        if self.curriculum is None:
            return None
        attempts = passes = 0
        for task_id in reversed(self.drawn_ids[pick]):
            if task_id in self.stats:
                a, p = self.stats[task_id]
                attempts, passes = attempts + a, passes + p
                if attempts >= self.curriculum.domain_min_attempts:
                    break
        return self.curriculum.domain_verdict(attempts, passes)

    def _draw_from(self, cursor: _Cursor) -> Task | None:
        # One full pass over the source at most: after that every task of it is skipped.
        for _ in range(len(cursor.source)):
            task = cursor.next()
            reason = self.skip_reason(task.task_id)
            if reason is None:
                return task
            self.skips[reason] += 1
        return None

    def next(self) -> Task:
        probe = self.curriculum.probe if self.curriculum is not None else 0.0
        if probe and self._rng.random() < probe:
            return self._probe()
        live = list(range(len(self.sources)))
        while live:
            pick = self._pick(live)
            domain = self.domain_skip_reason(pick) if self.weights[pick] > 0 else None
            if domain is not None:
                self.skips[domain] += 1
            task = self._draw_from(self._cursors[pick]) if self.weights[pick] > 0 and domain is None else None
            if task is not None:
                return self._took(pick, task)
            live.remove(pick)
        if probe:
            self.exhausted += 1
            return self._probe()
        raise TasksExhausted("the curriculum skips every task of every source (always or never solved); "
                             "add tasks or raise Curriculum.min_attempts")

    def _probe(self) -> Task:
        """A draw by weight alone, whatever the curriculum says of the task or its domain."""
        pick = self._pick([i for i, w in enumerate(self.weights) if w > 0])
        self.probes += 1
        return self._took(pick, self._cursors[pick].next())

    def _pick(self, live: list[int]) -> int:
        """One of the `live` sources, by weight."""
        return self._rng.choices(live, weights=[self.weights[i] for i in live])[0]

    def _took(self, pick: int, task: Task) -> Task:
        self.drawn[self.sources[pick].name] += 1
        ids = self.drawn_ids[pick]
        ids.pop(task.task_id, None)
        ids[task.task_id] = None
        return task

    def __iter__(self) -> "TaskMixer":
        return self

    def __next__(self) -> Task:
        return self.next()
