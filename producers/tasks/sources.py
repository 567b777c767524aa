"""Task sources by name, for settings and command lines."""
from __future__ import annotations

import inspect
from typing import Any, Callable

from producers.tasks.arithmetic import DigitAdditionSource, ReasoningGymSource
from producers.tasks.humaneval import HumanEvalSource
from producers.tasks.table_qa import TableQASource
from producers.tasks.task import TaskSource
from schemas.errors import ConfigError

SOURCES: dict[str, Callable[..., TaskSource]] = {
    "humaneval": HumanEvalSource,
    "math": ReasoningGymSource,
    "math-easy": DigitAdditionSource,
    "table": TableQASource,
}


def seeded_source(name: str, seed: int) -> TaskSource:
    """A source by name with `seed` when it takes one (HumanEval is a fixed list and takes none)."""
    accepts_seed = "seed" in inspect.signature(SOURCES[name]).parameters if name in SOURCES else False
    return load_source(name, seed=seed) if accepts_seed else load_source(name)


def load_source(name: str, **kwargs: Any) -> TaskSource:
    """A task source by name; kwargs go to its constructor (seed, size, ...)."""
    if name not in SOURCES:
        raise ConfigError(f"unknown task source {name!r}; choose one of {sorted(SOURCES)}")
    try:
        return SOURCES[name](**kwargs)
    except TypeError as exc:
        raise ConfigError(f"task source {name!r}: bad arguments {kwargs}: {exc}") from exc
