"""Installed environments as task sources: `env:<name>` is the environment of entry point <name>
(schemas.environments), `env:*` every installed one.

    python -m producers --ns NS --sources env:vowels            # after `pip install` of the package

Task i of a seed is the environment's task(seed, i), in domain "env/<name>"; its spec records the
environment's version ("env_version") beside the environment's own keys, so `streams/` verifies it with the
same environment and refuses a version it no longer scores.
"""
from __future__ import annotations

from typing import Any, Optional

from producers.tasks.task import Task
from schemas import environments
from schemas.tasks import ENVIRONMENT, make_spec

PREFIX = f"{ENVIRONMENT}:"


def expand(names: list[str]) -> list[str]:
    """`env:*` -> one `env:<name>` per installed environment; other names as they are."""
    out: list[str] = []
    for name in names:
        out += [PREFIX + n for n in environments.installed()] if name == PREFIX + "*" else [name]
    return out


class EnvironmentSource:
    """One installed environment as a task source (ConfigError when it is not installed)."""

    def __init__(self, name: str, seed: int = 0, size: Optional[int] = None) -> None:
        self.env: Any = environments.load(name)
        self.seed = seed
        self.size = int(self.env.size if size is None else min(size, self.env.size))
        self.name, self.domain = PREFIX + name, environments.domain_of(name)
        self.max_turns = int(getattr(self.env, "max_turns", 1))

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Task:
        if not 0 <= index < self.size:
            raise IndexError(f"{self.name} task index {index} out of range 0..{self.size - 1}")
        task = self.env.task(self.seed, index)
        spec = make_spec(self.domain, **{**dict(task.spec), "env_version": str(self.env.version)})
        return Task(task_id=f"{self.domain}/{task.task_id}", domain=self.domain, prompt=task.prompt, spec=spec,
                    max_turns=self.max_turns, demonstration=task.demonstration)


def feedback(task: Task, answer: str) -> Optional[str]:
    """What an environment's episode shows the policy after `answer`, or None when it ends there."""
    env = environments.load(environments.name_of(task.domain) or "")
    respond = getattr(env, "feedback", None)
    return None if respond is None else respond(task.spec, answer)
