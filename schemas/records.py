"""Frozen dataclasses mirroring the .avsc files one to one (field names and order)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional, Union


@dataclass(frozen=True)
class EpisodeStarted:
    SCHEMA: ClassVar[str] = "trajpipe.EpisodeStarted"
    prompt_text: str
    prompt_tokens: bytes
    task_spec: str
    group_size: int
    max_turns: int
    temperature: float
    max_new_tokens: int


@dataclass(frozen=True)
class ClaimCheck:
    SCHEMA: ClassVar[str] = "trajpipe.ClaimCheck"
    key: str
    sha256: str
    size: int


@dataclass(frozen=True)
class PolicyTurn:
    SCHEMA: ClassVar[str] = "trajpipe.PolicyTurn"
    turn: int
    obs_text: str
    obs_tokens: bytes
    text: str
    tokens: bytes
    logprobs: bytes
    finish_reason: str = "stop"
    claim: Optional[ClaimCheck] = None


@dataclass(frozen=True)
class SandboxResult:
    SCHEMA: ClassVar[str] = "trajpipe.SandboxResult"
    turn: int
    outcome: str
    tests_passed: int
    tests_total: int
    stdout: str
    stderr: str
    duration_ms: int
    backend: str


@dataclass(frozen=True)
class EpisodeEnded:
    SCHEMA: ClassVar[str] = "trajpipe.EpisodeEnded"
    status: str
    num_turns: int
    detail: str = ""


Body = Union[EpisodeStarted, PolicyTurn, SandboxResult, EpisodeEnded]


@dataclass(frozen=True)
class RolloutEvent:
    SCHEMA: ClassVar[str] = "trajpipe.RolloutEvent"
    event_id: str
    run: str
    episode_id: str
    group_id: str
    task_id: str
    domain: str
    policy_version: int
    producer_id: str
    ts: int
    seq: int
    body: Body


@dataclass(frozen=True)
class TrajectoryTurn:
    SCHEMA: ClassVar[str] = "trajpipe.TrajectoryTurn"
    turn: int
    policy_version: int
    obs_text: str
    obs_tokens: bytes
    text: str
    tokens: bytes
    logprobs: bytes
    finish_reason: str
    outcome: str = ""
    tests_passed: int = 0
    tests_total: int = 0
    stderr: str = ""


@dataclass(frozen=True)
class SourcePosition:
    SCHEMA: ClassVar[str] = "trajpipe.SourcePosition"
    partition: int
    offset: int


@dataclass(frozen=True)
class Trajectory:
    SCHEMA: ClassVar[str] = "trajpipe.Trajectory"
    trajectory_id: str
    episode_id: str
    group_id: str
    task_id: str
    domain: str
    run: str
    status: str
    task_spec: str
    prompt_text: str
    prompt_tokens: bytes
    turns: tuple[TrajectoryTurn, ...]
    reward: float
    reward_components: dict[str, float]
    reward_fn: str
    reward_version: str
    advantage: float
    group_reward_mean: float
    group_reward_std: float
    source_topic: str
    source_offsets: tuple[SourcePosition, ...]
    started_ts: int
    ended_ts: int
    group_size: int = 0


@dataclass(frozen=True)
class BatchManifest:
    SCHEMA: ClassVar[str] = "trajpipe.BatchManifest"
    batch_id: str
    run: str
    bucket: str
    key: str
    sha256: str
    size: int
    num_trajectories: int
    num_tokens: int
    source_topic: str
    partition: int
    first_offset: int
    last_offset: int
    policy_version_min: int
    policy_version_max: int
    reward_mean: float
    reward_std: float
    trajectory_ids: tuple[str, ...]
    ts: int


@dataclass(frozen=True)
class CheckpointPublished:
    SCHEMA: ClassVar[str] = "trajpipe.CheckpointPublished"
    run: str
    version: int
    step: int
    bucket: str
    prefix: str
    manifest_key: str
    manifest_sha256: str
    algorithm: str
    batch_ids: tuple[str, ...]
    ts: int


@dataclass(frozen=True)
class DeadLetter:
    SCHEMA: ClassVar[str] = "trajpipe.DeadLetter"
    reason: str
    detail: str
    stage: str
    source_topic: str
    partition: int
    offset: int
    key: Optional[bytes]
    original: bytes
    ts: int


@dataclass(frozen=True)
class PipelineMetric:
    SCHEMA: ClassVar[str] = "trajpipe.PipelineMetric"
    source: str
    name: str
    value: float
    labels: dict[str, str] = field(default_factory=dict)
    window_start: int = 0
    window_end: int = 0


@dataclass(frozen=True)
class TaskStats:
    SCHEMA: ClassVar[str] = "trajpipe.TaskStats"
    task_id: str
    domain: str
    attempts: int
    passes: int
    ts: int


TOP_LEVEL = (RolloutEvent, Trajectory, BatchManifest, CheckpointPublished, DeadLetter, PipelineMetric, TaskStats)
BODY_TYPES = (EpisodeStarted, PolicyTurn, SandboxResult, EpisodeEnded)
