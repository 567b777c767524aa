"""The public environment interface: a domain that an installed package adds, found by its entry points.

A package declares its environments and reward functions in its pyproject.toml:

    [project.entry-points."trajpipe.environments"]
    vowels = "my_package:VowelCount"               # events of domain "env/vowels"

    [project.entry-points."trajpipe.rewards"]
    "brevity:1" = "my_package:brevity"              # python -m streams --reward brevity:1

and nothing in this repository changes (examples/trajpipe-example-env is such a package). An environment is a
class (made with no arguments) or an instance with:

    version: str                                 # recorded in every task spec as "env_version"
    size: int                                    # tasks per seed: task(seed, i) for 0 <= i < size
    task(seed, index) -> EnvTask                 # reproducible: the same seed and index, the same task
    verify(spec, answer) -> {component: value}   # values in [0, 1]; "outcome/correct" is required
  optional:
    max_turns: int = 1                           # the episode ends after this many policy turns at most
    feedback(spec, answer) -> str | None         # the observation the policy sees next; None ends the episode
    versions: set[str] = {version}               # task versions verify() still scores (old logs re-score)
    length_budget: int = 256                     # generated tokens before the overlong penalty reaches 1

Tasks: rollout workers draw them as `--sources env:<name>` (`env:*`: every installed environment), with the
held-out split every source has (by task id) and `EnvTask.demonstration` for SFT. The episode: the policy
sees `prompt`, its answer goes to `feedback` (run in the rollout worker, never in the sandbox: an
environment that executes model-written code must use the code domain's sandbox), and the episode ends when
feedback returns None or after max_turns. A turn's feedback calls run at once, each in a thread of the
worker (`--tool-workers`), so a feedback that waits on a remote tool or checker costs one wait a turn: it
must be safe to call from several threads. The verifier: `streams/` calls `verify` with the recorded task spec
and the last turn's text only, so history re-scores. Components are namespaced like the built-in ones
(outcome/..., process/...); the truncation and length penalties are added by the pipeline.

An event whose environment is not installed is dead-lettered as `unknown_environment`; a verify that raises,
or returns no outcome, is dead-lettered as `reward_error`. Neither stops a worker.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Callable, Mapping, Optional, Protocol

from schemas.errors import ConfigError
from schemas.tasks import ENV_NAME as NAME
from schemas.tasks import ENVIRONMENT as FAMILY  # events of environment <name> have domain "env/<name>"

ENVIRONMENTS_GROUP = "trajpipe.environments"
REWARDS_GROUP = "trajpipe.rewards"
OUTCOME = "outcome/correct"
DEFAULT_LENGTH_BUDGET = 256


@dataclass(frozen=True)
class EnvTask:
    """One task of an environment: what the policy is shown, and the JSON verifier data its verify reads."""

    task_id: str
    prompt: str
    spec: Mapping[str, Any] = field(default_factory=dict)
    demonstration: Optional[str] = None  # a gold answer for SFT, where the environment has one


class Environment(Protocol):
    version: str
    size: int

    def task(self, seed: int, index: int) -> EnvTask: ...

    def verify(self, spec: Mapping[str, Any], answer: str) -> Mapping[str, float]: ...


def domain_of(name: str) -> str:
    return f"{FAMILY}/{name}"


def name_of(domain: str) -> Optional[str]:
    """The environment's name for a domain "env/<name>", else None."""
    family, _, name = domain.partition("/")
    return name if family == FAMILY and NAME.fullmatch(name) else None


@functools.lru_cache(maxsize=None)
def _entry_points(group: str) -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=group)}


def installed() -> list[str]:
    """The names of every installed environment (entry points of group trajpipe.environments)."""
    return sorted(name for name in _entry_points(ENVIRONMENTS_GROUP) if NAME.fullmatch(name))


def is_installed(name: str) -> bool:
    return name in _entry_points(ENVIRONMENTS_GROUP)


@functools.lru_cache(maxsize=None)
def load(name: str) -> Any:
    """The installed environment `name`, made once per process; ConfigError if it is not installed or broken."""
    if not NAME.fullmatch(name):
        raise ConfigError(f"environment name {name!r} must match {NAME.pattern}")
    found = _entry_points(ENVIRONMENTS_GROUP).get(name)
    if found is None:
        raise ConfigError(f"environment {name!r} is not installed: no entry point {name!r} in group "
                          f"{ENVIRONMENTS_GROUP} (installed: {', '.join(installed()) or 'none'}); install the "
                          "package that provides it")
    try:
        target = found.load()
        env = target() if isinstance(target, type) else target
    except Exception as exc:  # a third-party package: any failure to import or construct it
        raise ConfigError(f"environment {name!r} ({found.value}) cannot be loaded: {exc!r}") from exc
    missing = [a for a in ("version", "size", "task", "verify") if not hasattr(env, a)]
    if missing:
        raise ConfigError(f"environment {name!r} ({found.value}) lacks {', '.join(missing)}: see schemas.environments")
    return env


def accepted_versions(env: Any) -> set[str]:
    return {str(v) for v in getattr(env, "versions", None) or {env.version}}


def reward_functions() -> dict[tuple[str, str], Callable[..., float]]:
    """Installed reward functions by (name, version), from entry points "name:version" of trajpipe.rewards.

    Each is called as fn(trajectory, components) -> total, with the components the pipeline measured; the
    components it is given are what it records (a reward version weighs, it does not measure)."""
    found: dict[tuple[str, str], Callable[..., float]] = {}
    for key, ep in _entry_points(REWARDS_GROUP).items():
        name, sep, version = key.partition(":")
        if not sep or not name or not version:
            raise ConfigError(f"reward entry point {key!r} ({ep.value}) must be named 'name:version'")
        try:
            found[(name, version)] = ep.load()
        except Exception as exc:
            raise ConfigError(f"reward function {key!r} ({ep.value}) cannot be loaded: {exc!r}") from exc
    return found
