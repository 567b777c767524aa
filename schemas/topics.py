"""Topic names of a run namespace, with their partition counts and configs."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from schemas.errors import ConfigError

_NS = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_-]{0,100}$")
# Tables of the streams app; Faust names their changelogs "<app id>-<table>-changelog".
STREAM_TABLES = ("episodes", "seen", "groups", "taskstats")


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    config: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Topics:
    """Every topic of namespace `ns`; `partitions` applies to the keyed data topics."""

    ns: str
    partitions: int = 4

    def __post_init__(self) -> None:
        if not _NS.match(self.ns):
            raise ConfigError(f"namespace {self.ns!r}: use letters, digits, '_' or '-' (at most 101 chars)")
        if self.partitions < 1:
            raise ConfigError(f"partitions must be >= 1, got {self.partitions}")

    @property
    def events(self) -> str:
        return f"{self.ns}.rollout.events"

    @property
    def deadletter(self) -> str:
        return f"{self.ns}.rollout.deadletter"

    @property
    def trajectories(self) -> str:
        return f"{self.ns}.trajectories"

    @property
    def scored(self) -> str:
        return f"{self.ns}.trajectories.scored"

    @property
    def batches(self) -> str:
        return f"{self.ns}.trajectory.batches"

    @property
    def checkpoints(self) -> str:
        return f"{self.ns}.policy.checkpoints"

    @property
    def metrics(self) -> str:
        return f"{self.ns}.pipeline.metrics"

    @property
    def task_stats(self) -> str:
        return f"{self.ns}.task.stats"

    @property
    def streams_app_id(self) -> str:
        return f"{self.ns}.streams"

    def changelog(self, table: str) -> str:
        return f"{self.streams_app_id}-{table}-changelog"

    def specs(self) -> list[TopicSpec]:
        p = self.partitions
        compact = {"cleanup.policy": "compact"}
        keep = {"retention.ms": "-1"}
        specs = [
            TopicSpec(self.events, p, dict(keep)),
            TopicSpec(self.deadletter, 1, dict(keep)),
            TopicSpec(self.trajectories, p, dict(keep)),
            TopicSpec(self.scored, p, dict(keep)),
            TopicSpec(self.batches, 1, dict(keep)),
            TopicSpec(self.checkpoints, 1, dict(compact)),
            TopicSpec(self.metrics, 1),
            TopicSpec(self.task_stats, 1, dict(compact)),
        ]
        specs += [TopicSpec(self.changelog(t), p, dict(compact)) for t in STREAM_TABLES]
        return specs
