"""The contracts of the pipeline: Avro schemas, records, codec, topic names, object keys, manifests, errors."""
from schemas.codec import Codec, codec, decode, encode
from schemas.errors import DecodeError, PipelineError
from schemas.records import (
    BatchManifest,
    CheckpointPublished,
    ClaimCheck,
    DeadLetter,
    EpisodeEnded,
    EpisodeStarted,
    PipelineMetric,
    PolicyTurn,
    RolloutEvent,
    SandboxResult,
    SourcePosition,
    TaskStats,
    Trajectory,
    TrajectoryTurn,
)
from schemas.topics import Topics

__all__ = [
    "BatchManifest", "CheckpointPublished", "ClaimCheck", "Codec", "DeadLetter", "DecodeError",
    "EpisodeEnded", "EpisodeStarted", "PipelineError", "PipelineMetric", "PolicyTurn", "RolloutEvent",
    "SandboxResult", "SourcePosition", "TaskStats", "Topics", "Trajectory", "TrajectoryTurn",
    "codec", "decode", "encode",
]
