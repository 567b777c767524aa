"""The task_spec contract: the JSON verifier data a task carries from the task source to the reward functions.

A task_spec is a JSON object, written by `producers/` into EpisodeStarted.task_spec and read back by
`streams/` from Trajectory.task_spec. Both sides use this module, so neither imports the other.

Common keys
    v        int, format version (optional, default 1). A reader refuses a newer version.
    domain   "code" | "math" | "table" (optional; when present it must equal the event's domain).
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

Unknown keys are ignored by readers, so a writer may add keys without a version bump.
"""
from __future__ import annotations

import json
from typing import Any, Mapping

from schemas.errors import PipelineError

SPEC_VERSION = 1
DOMAINS = ("code", "math", "table")

_NUMBER = (int, float)
_REQUIRED: dict[str, dict[str, tuple[type, ...]]] = {
    "code": {"entry_point": (str,), "tests": (str,)},
    "math": {"answer": (str,)},
    "table": {"answer": (str,), "tolerance": _NUMBER, "cells": (list,)},
}
_OPTIONAL: dict[str, dict[str, tuple[type, ...]]] = {
    "code": {"prompt": (str,), "timeout_s": _NUMBER},
    "math": {"source": (str,), "seed": (int,), "index": (int,)},
    "table": {"decimals": (int,), "unit": (str,), "kind": (str,)},
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


def _resolve_domain(spec: Mapping[str, Any], domain: str | None) -> str:
    found = spec.get("domain", domain)
    if domain is not None and found != domain:
        raise TaskSpecError(f"task_spec domain {found!r} differs from the episode's domain {domain!r}")
    if found not in DOMAINS:
        raise TaskSpecError(f"task_spec domain {found!r} is not one of {DOMAINS}")
    return str(found)


def validate_spec(spec: Any, domain: str | None = None) -> dict[str, Any]:
    """The spec as a plain dict if it keeps the contract for `domain` (or its own "domain" key)."""
    if not isinstance(spec, Mapping):
        raise TaskSpecError(f"task_spec must be a JSON object, got {type(spec).__name__}")
    _check_keys("task_spec", spec, _COMMON, required=False)
    if spec.get("v", SPEC_VERSION) > SPEC_VERSION:
        raise TaskSpecError(f"task_spec version {spec['v']} is newer than this reader ({SPEC_VERSION})")
    found = _resolve_domain(spec, domain)
    _check_keys(f"{found} task_spec", spec, _REQUIRED[found], required=True)
    _check_keys(f"{found} task_spec", spec, _OPTIONAL[found], required=False)
    if found == "table":
        _check_cells(spec["cells"])
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
