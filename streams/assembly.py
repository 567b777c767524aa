"""Assembly: fold the clean events of one episode, in log order, into the state that becomes its trajectory.

    state = None
    for event, position in events_of_one_episode:
        if state is not None and is_duplicate(state, event):
            continue                                  # counted, dropped
        state = fold(state, event, position)          # ValidationError(bad_step | unknown_episode)
        if state.ended is not None:
            trajectory = to_trajectory(state, source_topic)

All pure. An episode that never ends is closed by the sweeper with `to_trajectory(state, topic, ABANDONED)`
once it has been idle past the timeout (see streams.eventtime). After close the episode is remembered as a `ClosedEpisode`, which
tells a late duplicate (a known event id) from a late event (dead-lettered as unknown_episode).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from operator import attrgetter
from typing import Optional

from schemas.errors import ValidationError
from schemas.keys import trajectory_id
from schemas.records import (
    EpisodeEnded,
    EpisodeStarted,
    PolicyTurn,
    RolloutEvent,
    SandboxResult,
    SourcePosition,
    Trajectory,
    TrajectoryTurn,
    build,
    evolve,
)

ABANDONED = "abandoned"
ERROR = "error"  # closed by the worker for a fault of its own making (too large to keep), never trained
# Envelope fields every event of an episode must agree on.
EPISODE_FIELDS = ("group_id", "task_id", "domain", "run")
_episode_fields = attrgetter(*EPISODE_FIELDS)  # read in one C call per event (the hot path of fold)


@dataclass(frozen=True)
class EpisodeState:
    episode_id: str
    group_id: str
    task_id: str
    domain: str
    run: str
    started: EpisodeStarted
    started_ts: int
    last_ts: int
    turns: tuple[TrajectoryTurn, ...] = ()
    positions: tuple[SourcePosition, ...] = ()
    event_ids: tuple[str, ...] = ()
    seqs: tuple[int, ...] = ()  # of the events taken, in the order taken
    # Claim-checked PolicyTurns, as logged: their payload is fetched again when the episode closes, so
    # open episodes never hold large payloads in memory.
    claims: tuple[RolloutEvent, ...] = ()
    ended: Optional[EpisodeEnded] = None

    @property
    def partition(self) -> int:
        return self.positions[0].partition


@dataclass(frozen=True, slots=True)
class ClosedEpisode:
    """What is kept of an episode after its trajectory is out: enough to recognise its duplicates, in
    constant size per episode (event ids would cost ~80 bytes an event for the whole dedupe horizon).

    The events taken are seqs 0..last_seq except `missing` (normally none): a later copy of one of them is a
    duplicate; any other event of the episode came late.
    """

    status: str
    closed_ts: int
    last_seq: int
    missing: tuple[int, ...] = ()
    partition: int = 0
    # Wall time (monotonic) it closed on this worker; not stored: a recovered marker starts its horizon anew.
    since: float = field(default_factory=time.monotonic, compare=False)


def is_duplicate(state: EpisodeState, event: RolloutEvent) -> bool:
    return event.event_id in state.event_ids


def open_episode(event: RolloutEvent, position: SourcePosition) -> EpisodeState:
    """The state after the first event of an episode, which must be its EpisodeStarted."""
    if not isinstance(event.body, EpisodeStarted):
        raise ValidationError("unknown_episode", f"{type(event.body).__name__} for episode {event.episode_id}, "
                                                 "which has not started (no EpisodeStarted seen)")
    return EpisodeState(
        episode_id=event.episode_id, group_id=event.group_id, task_id=event.task_id, domain=event.domain,
        run=event.run, started=event.body, started_ts=event.ts, last_ts=event.ts,
        positions=(position,), event_ids=(event.event_id,), seqs=(event.seq,),
    )


def fold(state: Optional[EpisodeState], event: RolloutEvent, position: SourcePosition) -> EpisodeState:
    """The state with one more (validated, non-duplicate) event; ValidationError if it does not fit."""
    if state is None:
        return open_episode(event, position)
    _check_same_episode(state, event)
    body = event.body
    if isinstance(body, PolicyTurn):
        changes = _add_turn(state, event, body)
    elif isinstance(body, SandboxResult):
        changes = _add_result(state, body)
    elif isinstance(body, EpisodeEnded):
        changes = _end(state, body)
    else:
        raise ValidationError("bad_step", f"a second EpisodeStarted for episode {state.episode_id}")
    # One copy of the state an event (fold runs once per event): the body's changes and the event's own.
    return evolve(state, positions=state.positions + (position,), event_ids=state.event_ids + (event.event_id,),
                  seqs=state.seqs + (event.seq,), last_ts=max(state.last_ts, event.ts), **changes)


def _check_same_episode(state: EpisodeState, event: RolloutEvent) -> None:
    if state.ended is None and _episode_fields(event) == _episode_fields(state):
        return
    if state.ended is not None:
        raise ValidationError("bad_step", f"{type(event.body).__name__} after EpisodeEnded of {state.episode_id}")
    for name in EPISODE_FIELDS:
        if getattr(event, name) != getattr(state, name):
            raise ValidationError("bad_step", f"{name} {getattr(event, name)!r} differs from the episode's "
                                              f"{getattr(state, name)!r}")


# A turn's fields before its sandbox result: new turns are copies of it with the PolicyTurn's fields (the frozen
# dataclass's __init__ sets each field through object.__setattr__; the event's fields are already checked).
_NEW_TURN = TrajectoryTurn(turn=0, policy_version=0, obs_text="", obs_tokens=b"", text="", tokens=b"", logprobs=b"",
                           finish_reason="")


def _add_turn(state: EpisodeState, event: RolloutEvent, body: PolicyTurn) -> dict[str, object]:
    last = state.turns[-1].turn if state.turns else -1
    if body.turn <= last:
        raise ValidationError("bad_step", f"turn {body.turn} after turn {last}: turn numbers must increase")
    if body.turn >= state.started.max_turns:
        raise ValidationError("bad_step", f"turn {body.turn} but the episode allows {state.started.max_turns}")
    turn = evolve(_NEW_TURN, turn=body.turn, policy_version=event.policy_version, obs_text=body.obs_text,
                  obs_tokens=body.obs_tokens, text=body.text, tokens=body.tokens, logprobs=body.logprobs,
                  finish_reason=body.finish_reason,
                  # Events written before turns carried it: the episode's own setting is the same fact.
                  temperature=state.started.temperature if body.temperature is None else body.temperature,
                  top_p=body.top_p)
    claims = state.claims + (event,) if body.claim is not None else state.claims
    return {"turns": state.turns + (turn,), "claims": claims}


def _add_result(state: EpisodeState, body: SandboxResult) -> dict[str, object]:
    index = next((i for i, t in enumerate(state.turns) if t.turn == body.turn), None)
    if index is None:
        raise ValidationError("bad_step", f"SandboxResult for turn {body.turn}, which has no PolicyTurn")
    if state.turns[index].outcome:
        raise ValidationError("bad_step", f"a second SandboxResult for turn {body.turn}")
    turn = evolve(state.turns[index], outcome=body.outcome, tests_passed=body.tests_passed,
                  tests_total=body.tests_total, stderr=body.stderr)
    return {"turns": state.turns[:index] + (turn,) + state.turns[index + 1:]}


def _end(state: EpisodeState, body: EpisodeEnded) -> dict[str, object]:
    if body.num_turns != len(state.turns):
        raise ValidationError("bad_step", f"EpisodeEnded says {body.num_turns} turns, {len(state.turns)} arrived")
    return {"ended": body}


def with_payloads(state: EpisodeState, resolved: dict[int, PolicyTurn]) -> EpisodeState:
    """The state with the token payloads of claim-checked turns (by turn number) filled in."""
    turns = tuple(
        replace(t, obs_tokens=resolved[t.turn].obs_tokens, tokens=resolved[t.turn].tokens,
                logprobs=resolved[t.turn].logprobs) if t.turn in resolved else t
        for t in state.turns
    )
    return replace(state, turns=turns, claims=())


def status_of(state: EpisodeState) -> Optional[str]:
    return state.ended.status if state.ended is not None else None


def to_trajectory(state: EpisodeState, source_topic: str, status: Optional[str] = None) -> Trajectory:
    """The unscored trajectory: status from EpisodeEnded unless given (the sweeper gives `abandoned`)."""
    final = status or status_of(state)
    if final is None:
        raise ValueError(f"episode {state.episode_id} has not ended; pass status={ABANDONED!r} to close it")
    return build(
        Trajectory, trajectory_id=trajectory_id(state.episode_id), episode_id=state.episode_id, group_id=state.group_id,
        task_id=state.task_id, domain=state.domain, run=state.run, status=final,
        task_spec=state.started.task_spec, prompt_text=state.started.prompt_text,
        prompt_tokens=state.started.prompt_tokens, turns=state.turns, reward=0.0, reward_components={},
        reward_fn="", reward_version="", advantage=0.0, group_reward_mean=0.0, group_reward_std=0.0,
        source_topic=source_topic, source_offsets=tuple(sorted(state.positions, key=_position_key)),
        started_ts=state.started_ts, ended_ts=state.last_ts, group_size=state.started.group_size,
    )


def _position_key(p: SourcePosition) -> tuple[int, int]:
    return p.partition, p.offset


def close(state: EpisodeState, status: str) -> ClosedEpisode:
    last = max(state.seqs)
    missing = tuple(sorted(set(range(last + 1)) - set(state.seqs))) if len(state.seqs) <= last else ()
    return ClosedEpisode(status=status, closed_ts=state.last_ts, last_seq=last, missing=missing,
                         partition=state.partition)


def classify_late(closed: ClosedEpisode, event: RolloutEvent) -> None:
    """Nothing for a duplicate of an event already in the trajectory; ValidationError for a late event."""
    if event.seq > closed.last_seq or event.seq in closed.missing:
        raise ValidationError("unknown_episode", f"episode {event.episode_id} was already closed as "
                                                 f"{closed.status}; this {type(event.body).__name__} came late")
