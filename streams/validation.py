"""Cleaning: decode a rollout event and check what a trajectory relies on; every rejection has a reason code.

    event = decode_event(message_value)    # DecodeError(reason) for bytes that are not a RolloutEvent
    validate(event)                        # ValidationError(reason) for content that breaks an invariant

Both are pure. What needs the episode's history (turn order, a SandboxResult's turn) is checked by
`streams.assembly.fold`.
"""
from __future__ import annotations

import math
from array import array
from dataclasses import dataclass
from typing import Optional

from schemas import environments
from schemas.errors import DecodeError, ValidationError
from schemas.packing import unpack_floats
from schemas.records import (
    DEMONSTRATION_VERSION,
    EpisodeEnded,
    EpisodeStarted,
    PolicyTurn,
    RolloutEvent,
    SandboxResult,
)
from schemas.tasks import DOMAINS, is_domain
from streams import fastcodec

END_STATUSES = ("completed", "truncated", "aborted", "error")
OUTCOMES = ("passed", "failed", "syntax_error", "runtime_error", "timeout", "memory_exceeded",
            "output_truncated", "infra_error")
ENVELOPE_FIELDS = ("event_id", "run", "episode_id", "group_id", "task_id", "domain", "producer_id")
# Packed floats are little-endian; on such a host they are read without a copy.
_LITTLE = array("f", [1.0]).tobytes() == b"\x00\x00\x80\x3f"


@dataclass(frozen=True)
class Limits:
    """Sizes past which an event is refused as `oversize` (a runaway producer, not a real episode)."""

    max_turns: int = 64
    max_group_size: int = 1024
    max_tokens: int = 262_144  # per turn, and for the prompt
    max_text_chars: int = 4_000_000  # per text field
    # float32 log-probs of the sampled token may round to a hair above 0; anything larger is a bug.
    logprob_tolerance: float = 1e-6


DEFAULT_LIMITS = Limits()


def decode_event(data: Optional[bytes]) -> RolloutEvent:
    """The RolloutEvent in a message value; DecodeError for anything else (another record, garbage)."""
    if data is None:
        raise DecodeError("truncated", "the message has no value (a tombstone)")
    return fastcodec.decode_event(data)


def validate(event: RolloutEvent, limits: Limits = DEFAULT_LIMITS) -> None:
    """Raise ValidationError when the event alone breaks an invariant; claim-checked turns are checked resolved."""
    _check_envelope(event)
    body = event.body
    if isinstance(body, EpisodeStarted):
        _check_started(body, limits)
    elif isinstance(body, PolicyTurn):
        _check_turn(body, limits)
    elif isinstance(body, SandboxResult):
        _check_sandbox(body, limits)
    elif isinstance(body, EpisodeEnded):
        _check_ended(body, limits)


def _reject(reason: str, detail: str) -> None:
    raise ValidationError(reason, detail)


def _check_envelope(event: RolloutEvent) -> None:
    for name in ENVELOPE_FIELDS:
        if not getattr(event, name):
            _reject("missing_field", f"envelope field {name!r} is empty")
    for name in ("episode_id", "group_id"):  # table keys: a key starting with NUL is the worker's own record
        value = getattr(event, name)
        if not value.isprintable():
            _reject("bad_id", f"envelope field {name} = {value[:80]!r} holds a control character")
    if not is_domain(event.domain):
        _reject("unknown_domain", f"domain {event.domain!r} is not one of {', '.join(DOMAINS)} nor rg/<generator> "
                                  "nor env/<name>")
    environment = environments.name_of(event.domain)
    if environment is not None and not environments.is_installed(environment):
        _reject("unknown_environment", f"environment {environment!r} (domain {event.domain}) is not installed in "
                                       f"this worker: no entry point {environment!r} in group "
                                       f"{environments.ENVIRONMENTS_GROUP}; install the package that provides it")
    version_ok = event.policy_version >= 0 or event.policy_version == DEMONSTRATION_VERSION
    if event.ts <= 0 or not version_ok or event.seq < 0:
        _reject("bad_step", f"ts={event.ts}, policy_version={event.policy_version}, seq={event.seq}: "
                            f"each must be >= 0 (ts > 0; policy_version {DEMONSTRATION_VERSION} marks a demonstration)")


def _check_started(body: EpisodeStarted, limits: Limits) -> None:
    if not body.task_spec:
        _reject("missing_field", "EpisodeStarted.task_spec is empty")
    if not body.prompt_tokens:
        _reject("missing_field", "EpisodeStarted.prompt_tokens is empty")
    _check_ids("prompt_tokens", body.prompt_tokens, limits)
    _check_text("prompt_text", body.prompt_text, limits)
    if not 1 <= body.group_size <= limits.max_group_size:
        _reject("oversize" if body.group_size > 0 else "bad_step",
                f"group_size={body.group_size}: must be in 1..{limits.max_group_size}")
    if not 1 <= body.max_turns <= limits.max_turns:
        _reject("oversize" if body.max_turns > 0 else "bad_step",
                f"max_turns={body.max_turns}: must be in 1..{limits.max_turns}")
    if not math.isfinite(body.temperature) or body.temperature < 0 or body.max_new_tokens < 1:
        _reject("bad_step", f"temperature={body.temperature}, max_new_tokens={body.max_new_tokens}")


def _check_turn(body: PolicyTurn, limits: Limits) -> None:
    if body.claim is not None:
        _reject("claim_unavailable", f"turn {body.turn}: the claim-checked payload was not resolved")
    if body.turn < 0 or body.turn >= limits.max_turns:
        _reject("bad_step", f"turn={body.turn}: must be in 0..{limits.max_turns - 1}")
    if not body.tokens:
        _reject("missing_field", f"turn {body.turn}: no generated tokens")
    _check_ids("tokens", body.tokens, limits)
    _check_ids("obs_tokens", body.obs_tokens, limits)
    if len(body.logprobs) % 4:
        _reject("length_mismatch", f"turn {body.turn}: logprobs has {len(body.logprobs)} bytes, not a multiple of 4")
    if len(body.logprobs) != len(body.tokens):
        _reject("length_mismatch", f"turn {body.turn}: {len(body.tokens) // 4} tokens but "
                                   f"{len(body.logprobs) // 4} log-probs")
    _check_logprobs(body, limits)
    _check_text("text", body.text, limits)
    _check_text("obs_text", body.obs_text, limits)


def _check_logprobs(body: PolicyTurn, limits: Limits) -> None:
    values = array("f", body.logprobs) if _LITTLE else array("f", unpack_floats(body.logprobs))
    # A sum is NaN or infinite exactly when some value is: one C loop instead of a Python one per token.
    if not math.isfinite(sum(values)):
        _reject("bad_logprob", f"turn {body.turn}: a log-prob is NaN or infinite")
    if max(values) > limits.logprob_tolerance:
        _reject("bad_logprob", f"turn {body.turn}: a log-prob is positive ({max(values):.3g})")


def _check_sandbox(body: SandboxResult, limits: Limits) -> None:
    if body.turn < 0:
        _reject("bad_step", f"SandboxResult.turn={body.turn}")
    if body.outcome not in OUTCOMES:
        _reject("schema_mismatch", f"sandbox outcome {body.outcome!r} is not one of {', '.join(OUTCOMES)}")
    if not 0 <= body.tests_passed <= max(body.tests_total, 0) or body.duration_ms < 0:
        _reject("bad_step", f"tests {body.tests_passed}/{body.tests_total}, duration_ms={body.duration_ms}")
    _check_text("stdout", body.stdout, limits)
    _check_text("stderr", body.stderr, limits)


def _check_ended(body: EpisodeEnded, limits: Limits) -> None:
    if body.status not in END_STATUSES:
        _reject("schema_mismatch", f"episode status {body.status!r} is not one of {', '.join(END_STATUSES)}")
    if not 0 <= body.num_turns <= limits.max_turns:
        _reject("bad_step", f"num_turns={body.num_turns}: must be in 0..{limits.max_turns}")


def _check_ids(name: str, data: bytes, limits: Limits) -> None:
    if len(data) % 4:
        _reject("length_mismatch", f"{name} has {len(data)} bytes, not a multiple of 4 (int32 ids)")
    if len(data) // 4 > limits.max_tokens:
        _reject("oversize", f"{name} has {len(data) // 4} tokens (limit {limits.max_tokens})")


def _check_text(name: str, text: str, limits: Limits) -> None:
    if len(text) > limits.max_text_chars:
        _reject("oversize", f"{name} has {len(text)} characters (limit {limits.max_text_chars})")

