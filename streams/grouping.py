"""Grouping: collect the G trajectories of a group_id, then group-normalised advantages (GRPO).

    state = add_member(state, Member(read_summary(raw), raw))   # raw: the record as it came
    if is_complete(state) or timed out:
        result = finalize(state, eps=1e-6, drop_zero_variance=True)
        result.scored          # [(member, advantage)] of the trainable members, by trajectory_id

Only trainable members (status completed or truncated, and not marked status/not_trainable by the reward
function) enter the mean and std and go to the scored topic; abandoned, aborted and error members are
counted and stay on <ns>.trajectories only. std is the population std of the trainable rewards;
advantage = (r - mean) / (std + eps). A group whose trainable rewards are all equal (or that has fewer
than two) teaches nothing: it is dropped when drop_zero_variance, else emitted with advantage 0; a group of
demonstrations (gold completions for SFT, advantage 0) is always emitted.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Optional

from schemas.records import TaskStats, evolve
from streams.fastcodec import Summary
from streams.rewards import DEMONSTRATION, NOT_TRAINABLE, TRAINABLE_STATUSES

# Rewards closer than this are equal: their differences are float noise, not signal.
ZERO_VARIANCE = 1e-9
OUTCOME_PREFIX = "outcome/"


@dataclass(frozen=True)
class Member:
    summary: Summary
    raw: bytes  # the Trajectory record as it came: the changelog value, and the scored record once patched

    @property
    def trajectory_id(self) -> str:
        return self.summary.trajectory_id


@dataclass(frozen=True)
class GroupState:
    group_id: str
    size: int  # G, 0 when no member said
    first_ts: int  # earliest ended_ts of a member: event time the group started waiting
    partition: int = 0  # of <ns>.trajectories, where its members arrive
    members: tuple[Member, ...] = ()
    # Wall time (monotonic) its first member arrived on this worker; not stored.
    since: float = field(default_factory=time.monotonic, compare=False)

    @property
    def trajectory_ids(self) -> tuple[str, ...]:
        return tuple(m.trajectory_id for m in self.members)


@dataclass(frozen=True)
class ClosedGroup:
    """What is kept of an emitted group: enough to recognise a duplicate or a straggler."""

    closed_ts: int
    trajectory_ids: tuple[str, ...]
    timed_out: bool = False
    partition: int = 0
    since: float = field(default_factory=time.monotonic, compare=False)


@dataclass(frozen=True)
class GroupResult:
    scored: list[tuple[Member, float]]  # (member, advantage)
    trainable: int
    mean: float
    std: float
    zero_variance: bool
    dropped: bool
    passes: int
    ended_ts: int


@dataclass(frozen=True)
class TaskCount:
    domain: str
    attempts: int = 0
    passes: int = 0
    ts: int = 0


def add_member(state: Optional[GroupState], member: Member, partition: int = 0) -> GroupState:
    """The group with one more member; the same state when that trajectory id is already in it."""
    head = member.summary
    if state is None:
        state = GroupState(head.group_id, head.group_size, head.ended_ts, partition)
    if head.trajectory_id in state.trajectory_ids:
        return state
    return evolve(state, size=state.size or head.group_size, first_ts=min(state.first_ts, head.ended_ts),
                   members=state.members + (member,))


def is_complete(state: GroupState) -> bool:
    return state.size > 0 and len(state.members) >= state.size


def is_trainable(head: Summary) -> bool:
    return head.status in TRAINABLE_STATUSES and not head.reward_components.get(NOT_TRAINABLE, 0.0)


def passed(head: Summary) -> bool:
    """Solved: some outcome component is full (all tests passed, the answer is correct)."""
    return any(v >= 1.0 - ZERO_VARIANCE for k, v in head.reward_components.items() if k.startswith(OUTCOME_PREFIX))


def mean_std(rewards: list[float]) -> tuple[float, float]:
    """Mean and population std, summed in the given order (callers sort, so the bytes are reproducible)."""
    if not rewards:
        return 0.0, 0.0
    mean = math.fsum(rewards) / len(rewards)
    return mean, math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / len(rewards))


def advantages(rewards: list[float], eps: float) -> tuple[float, float, list[float]]:
    """(mean, std, (r - mean) / (std + eps) per reward); all zero when the rewards do not vary."""
    mean, std = mean_std(rewards)
    if len(rewards) < 2 or std <= ZERO_VARIANCE:
        return mean, std, [0.0] * len(rewards)
    return mean, std, [(r - mean) / (std + eps) for r in rewards]


def finalize(state: GroupState, eps: float, drop_zero_variance: bool) -> GroupResult:
    """The trainable members of a group (sorted by trajectory id) with their advantages, and the counts."""
    members = sorted(state.members, key=lambda m: m.trajectory_id)
    trainable = [m for m in members if is_trainable(m.summary)]
    mean, std, advs = advantages([m.summary.reward for m in trainable], eps)
    zero_variance = len(trainable) < 2 or std <= ZERO_VARIANCE
    # A demonstration teaches by imitation, not by its advantage: it is never dropped for lack of variance.
    demonstrations = bool(trainable) and all(m.summary.reward_components.get(DEMONSTRATION) for m in trainable)
    dropped = zero_variance and drop_zero_variance and not demonstrations
    return GroupResult(scored=[] if dropped else list(zip(trainable, advs)), trainable=len(trainable), mean=mean,
                       std=std, zero_variance=zero_variance, dropped=dropped,
                       passes=sum(passed(m.summary) for m in trainable),
                       ended_ts=max((m.summary.ended_ts for m in members), default=0))


def close(state: GroupState, timed_out: bool) -> ClosedGroup:
    return ClosedGroup(closed_ts=max(m.summary.ended_ts for m in state.members),
                       trajectory_ids=state.trajectory_ids, timed_out=timed_out, partition=state.partition)


def count_task(count: Optional[TaskCount], domain: str, result: GroupResult) -> TaskCount:
    """The per-partition task counters after one more group: attempts are its trainable members."""
    count = count or TaskCount(domain)
    return TaskCount(domain, count.attempts + result.trainable, count.passes + result.passes,
                     max(count.ts, result.ended_ts))


def task_key(partition: int, task_id: str) -> bytes:
    """The key of a task's counts from one partition, in the table and on the <ns>.task.stats feed."""
    return f"{partition}|{task_id}".encode()


def task_stats(task_id: str, counts: list[TaskCount]) -> TaskStats:
    """The task's pass rate summed over the partitions of <ns>.trajectories that counted it."""
    return TaskStats(task_id=task_id, domain=counts[0].domain, attempts=sum(c.attempts for c in counts),
                     passes=sum(c.passes for c in counts), ts=max(c.ts for c in counts))
