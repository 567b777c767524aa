"""The task_spec contract: the JSON verifier data a task carries from the task source to the reward functions.

A task_spec is a JSON object, written by `producers/` into EpisodeStarted.task_spec and read back by
`streams/` from Trajectory.task_spec. Both sides use this module, so neither imports the other.

Common keys
    v        int, format version (optional, default 1). A reader refuses a newer version.
    domain   "code" | "math" | "table" | "text" | "terminal" | "rg/<generator>" | "env/<name>" (optional; when present it must equal
             the event's domain).
    length_budget  int, generated tokens before the overlong penalty reaches 1 (optional).

code   entry_point str   name of the function the tests call
       tests       str   Python source defining `check(candidate)` (HumanEval's `test` field)
       prompt      str   code prefix the completion continues (optional)
       timeout_s   float sandbox time limit (optional)
math   answer      str   gold final answer, e.g. "7", "-204", "1/2", "\\frac{1}{2}"
       source      str   generator, e.g. "reasoning_gym:basic_arithmetic" or "builtin:digit_add" (optional)
       seed, index int   where the generator produced it, to regenerate it (optional)
       Verified downstream by exact rational compare, then math-verify equivalence of `answer`; the
       generator itself is not needed to score.
table  answer      str   gold number, already rounded, e.g. "38.25"
       tolerance   float an answer x is correct when |x - answer| <= tolerance
       cells       list  [{"statement", "row", "column", "value"}]: the table cells the answer needs
       decimals    int   digits the answer is rounded to, half up (optional)
       unit        str   "percent" | "ratio" | "usd_thousands" (optional)
       kind        str   question kind, e.g. "gross_margin" (optional)
text   answer      str   the exact expected text, e.g. "dcba"; compared with the first line of the answer
       source, seed, index   where the generator produced it (optional), e.g. "builtin:reverse"
rg/<generator>   one domain per reasoning-gym dataset, e.g. "rg/leg_counting"
       generator   str   the dataset's name (the domain's part after "rg/")
       seed, index, size  int   reasoning_gym.create_dataset(generator, seed=seed, size=size, **config)[index]
       config      dict  the dataset's options (optional)
       answer      str   the gold answer (optional): for demonstrations and readers; scoring re-generates
                         the task and calls the dataset's own score_answer, never trusting the event
terminal files      dict  the repository the episode starts from: path -> text
         module     str   the module the tests import (the repository bundled, then `from module import *`)
         entry_point str  the function check() is given
         tests      str   Python source defining `check(candidate)`: the verdict of run_tests and submit
         max_steps  int   tool calls before the episode ends unsubmitted (optional)
         family     str   e.g. "humaneval-bug", "import-fix" (optional)
env/<name>       an installed environment's domain (schemas.environments)
       env_version str   the environment's version that made the task; every other key is its own

Unknown keys are ignored by readers, so a writer may add keys without a version bump.
"""
from __future__ import annotations

import json
import re
from typing import Any, Mapping

from schemas.errors import PipelineError

SPEC_VERSION = 1
DOMAINS = ("code", "math", "table", "text", "terminal")
# A family of domains, one per dataset: "rg/<generator>" is reasoning-gym's generator <generator>, its tasks
# re-generated from (generator, seed, index, size) and verified by the generator's own score_answer.
REASONING_GYM = "rg"
# A family of domains added by installed packages: "env/<name>" is the environment of entry point <name> of
# group trajpipe.environments (schemas.environments).
ENVIRONMENT = "env"
_GENERATOR = re.compile(r"[a-z][a-z0-9_]*")
ENV_NAME = re.compile(r"[a-z][a-z0-9_-]*")

_NUMBER = (int, float)
_REQUIRED: dict[str, dict[str, tuple[type, ...]]] = {
    "code": {"entry_point": (str,), "tests": (str,)},
    "math": {"answer": (str,)},
    "table": {"answer": (str,), "tolerance": _NUMBER, "cells": (list,)},
    "text": {"answer": (str,)},
    "terminal": {"files": (dict,), "module": (str,), "entry_point": (str,), "tests": (str,)},
    REASONING_GYM: {"generator": (str,), "seed": (int,), "index": (int,), "size": (int,)},
    ENVIRONMENT: {"env_version": (str,)},
}
_OPTIONAL: dict[str, dict[str, tuple[type, ...]]] = {
    "code": {"prompt": (str,), "timeout_s": _NUMBER},
    "math": {"source": (str,), "seed": (int,), "index": (int,)},
    "table": {"decimals": (int,), "unit": (str,), "kind": (str,)},
    "text": {"source": (str,), "seed": (int,), "index": (int,)},
    "terminal": {"max_steps": (int,), "family": (str,)},
    # the gold answer, for demonstrations and for readers; scoring re-generates the task and never reads it
    REASONING_GYM: {"answer": (str,), "config": (dict,)},
    ENVIRONMENT: {},
}
_COMMON: dict[str, tuple[type, ...]] = {"v": (int,), "domain": (str,), "length_budget": (int,)}
_CELL: dict[str, tuple[type, ...]] = {"statement": (str,), "row": (str,), "column": (str,), "value": _NUMBER}


class TaskSpecError(PipelineError):
    """A task_spec that is not valid JSON or breaks this contract; the message names the key."""


def _check_type(where: str, key: str, value: Any, types: tuple[type, ...]) -> None:
    # bool is an int subclass; a flag where a number belongs is a writer bug.
    if isinstance(value, bool) or not isinstance(value, types):
        names = " or ".join(t.__name__ for t in types)
        raise TaskSpecError(f"{where}: key {key!r} must be {names}, got {type(value).__name__}")


def _check_keys(where: str, spec: Mapping[str, Any], types: Mapping[str, tuple[type, ...]], required: bool) -> None:
    for key, allowed in types.items():
        if key not in spec:
            if required:
                raise TaskSpecError(f"{where}: missing required key {key!r}")
            continue
        _check_type(where, key, spec[key], allowed)


def _check_cells(cells: list[Any]) -> None:
    if not cells:
        raise TaskSpecError("table task_spec: 'cells' must name at least one cell")
    for i, cell in enumerate(cells):
        if not isinstance(cell, Mapping):
            raise TaskSpecError(f"table task_spec: cells[{i}] must be an object")
        _check_keys(f"table task_spec cells[{i}]", cell, _CELL, required=True)


def domain_kind(domain: str) -> str | None:
    """The contract a domain's specs keep: the domain itself, "rg" for "rg/<generator>", "env" for
    "env/<name>" (whether that environment is installed is the reader's question), None if unknown."""
    if domain in DOMAINS:
        return domain
    family, _, member = domain.partition("/")
    if family == REASONING_GYM and _GENERATOR.fullmatch(member):
        return REASONING_GYM
    return ENVIRONMENT if family == ENVIRONMENT and ENV_NAME.fullmatch(member) else None


def is_domain(domain: str) -> bool:
    return domain_kind(domain) is not None


def _resolve_domain(spec: Mapping[str, Any], domain: str | None) -> str:
    found = spec.get("domain", domain)
    if domain is not None and found != domain:
        raise TaskSpecError(f"task_spec domain {found!r} differs from the episode's domain {domain!r}")
    if not isinstance(found, str) or domain_kind(found) is None:
        raise TaskSpecError(f"task_spec domain {found!r} is not one of {DOMAINS} nor {REASONING_GYM}/<generator> "
                            f"nor {ENVIRONMENT}/<name>")
    return found


def validate_spec(spec: Any, domain: str | None = None) -> dict[str, Any]:
    """The spec as a plain dict if it keeps the contract for `domain` (or its own "domain" key)."""
    if not isinstance(spec, Mapping):
        raise TaskSpecError(f"task_spec must be a JSON object, got {type(spec).__name__}")
    _check_keys("task_spec", spec, _COMMON, required=False)
    if spec.get("v", SPEC_VERSION) > SPEC_VERSION:
        raise TaskSpecError(f"task_spec version {spec['v']} is newer than this reader ({SPEC_VERSION})")
    found = _resolve_domain(spec, domain)
    kind = domain_kind(found) or found
    _check_keys(f"{found} task_spec", spec, _REQUIRED[kind], required=True)
    _check_keys(f"{found} task_spec", spec, _OPTIONAL[kind], required=False)
    if kind == "table":
        _check_cells(spec["cells"])
    if kind == REASONING_GYM and spec["generator"] != found.partition("/")[2]:
        raise TaskSpecError(f"{found} task_spec: generator {spec['generator']!r} is not the domain's")
    return dict(spec)


def make_spec(domain: str, **fields: Any) -> dict[str, Any]:
    """A validated spec for `domain`, stamped with the format version and the domain."""
    return validate_spec({"v": SPEC_VERSION, "domain": domain, **fields}, domain)


def encode_task_spec(spec: Mapping[str, Any]) -> str:
    """Canonical JSON (sorted keys) so the same task always gives byte-identical events."""
    checked = validate_spec(spec)
    return json.dumps(checked, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def decode_task_spec(text: str, domain: str | None = None) -> dict[str, Any]:
    """Parse and validate a task_spec; raises TaskSpecError with the reason."""
    try:
        spec = json.loads(text)
    except (TypeError, ValueError) as exc:
        raise TaskSpecError(f"task_spec is not valid JSON: {exc}") from exc
    return validate_spec(spec, domain)
