"""Task sources by name, for settings and command lines."""
from __future__ import annotations

import inspect
from typing import Any, Callable

from producers.tasks import environments
from producers.tasks.arithmetic import DigitAdditionSource, QuestionAdditionSource, ReasoningGymSource
from producers.tasks.humaneval import HumanEvalSource
from producers.tasks.reasoning_gym import PREFIX, ReasoningGymDomain
from producers.tasks.strings import LENGTH_PREFIX, StringReversalSource, by_length
from producers.tasks.table_qa import TableQASource
from producers.tasks.task import TaskSource
from producers.tasks.terminal import TerminalSource
from schemas.errors import ConfigError

SOURCES: dict[str, Callable[..., TaskSource]] = {
    "add": QuestionAdditionSource,
    "humaneval": HumanEvalSource,
    "math": ReasoningGymSource,
    "math-easy": DigitAdditionSource,
    "reverse": StringReversalSource,
    "table": TableQASource,
    "terminal": TerminalSource,
}


def seeded_source(name: str, seed: int) -> TaskSource:
    """A source by name with `seed` when it takes one (HumanEval is a fixed list and takes none)."""
    if name.startswith((PREFIX, environments.PREFIX, LENGTH_PREFIX)):
        return load_source(name, seed=seed)
    accepts_seed = "seed" in inspect.signature(SOURCES[name]).parameters if name in SOURCES else False
    return load_source(name, seed=seed) if accepts_seed else load_source(name)


def load_source(name: str, **kwargs: Any) -> TaskSource:
    """A task source by name (or `rg:<generator>`, a reasoning-gym dataset, `env:<name>`, an installed
    environment, or `reverse-N`, the reversals of N-letter words); kwargs go to its constructor."""
    if name.startswith(PREFIX):
        return ReasoningGymDomain(name.removeprefix(PREFIX), **kwargs)
    if name.startswith(environments.PREFIX):
        return environments.EnvironmentSource(name.removeprefix(environments.PREFIX), **kwargs)
    if name.startswith(LENGTH_PREFIX):
        return by_length(name, **kwargs)
    if name not in SOURCES:
        raise ConfigError(f"unknown task source {name!r}; choose one of {sorted(SOURCES)}, or rg:<dataset> / rg:*, "
                          "env:<name> / env:* (installed environments) or reverse-N (N-letter words)")
    try:
        return SOURCES[name](**kwargs)
    except TypeError as exc:
        raise ConfigError(f"task source {name!r}: bad arguments {kwargs}: {exc}") from exc
