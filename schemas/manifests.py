"""The checkpoint manifest (JSON beside the weights): sha256 per file, consumed offsets, model config."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from schemas.errors import ManifestError

CHECKPOINT_FORMAT = "trajpipe.checkpoint/1"
# The weights a checkpoint's manifest lists: float32 always, and the bfloat16 copy of a learner's --broadcast-bf16,
# which rollout workers following it load instead.
WEIGHTS_FILE = "model.safetensors"
BROADCAST_FILE = "model.bf16.safetensors"
# The optimizer state (Adam's moments and step counts) that a version carries under --moments-every: where a
# restarted learner resumes, and what `--init RUN:vK --init-moments` carries.
OPTIMIZER_FILE = "optimizer.safetensors"
OPTIMIZER_META_FILE = "optimizer.json"
MOMENT_FILES = (OPTIMIZER_FILE, OPTIMIZER_META_FILE)


def has_moments(names: Iterable[str]) -> bool:
    """Whether a checkpoint of these files (or manifest entries) carries the optimizer state."""
    return set(MOMENT_FILES) <= set(names)

# The learner says this on stderr when it made its last update (--max-updates, or --rl-updates after the SFT
# phase), followed by the update count: a supervisor reads it to know the run is over.
LEARNER_FINISHED_LINE = "made its last update:"
# ... and this, followed by the update count and why, when its SFT phase ends before --sft-updates.
SFT_PHASE_ENDS_LINE = "SFT phase ends after"


@dataclass(frozen=True)
class FileEntry:
    sha256: str
    size: int


@dataclass(frozen=True)
class CheckpointManifest:
    run: str
    version: int
    step: int
    algorithm: str
    files: dict[str, FileEntry]
    # Next offset to consume per partition of the batches topic, after this checkpoint's data.
    offsets: dict[int, int]
    batch_ids: list[str]
    model_config: dict[str, Any] = field(default_factory=dict)
    created_ts: int = 0
    format: str = CHECKPOINT_FORMAT
    # Batches consumed since the previous version that trained nothing, with the reason (all stale, ...).
    skipped_batches: dict[str, str] = field(default_factory=dict)
    # The local model folder the run started from ("" for the small model built from its config): a worker
    # needs its tokenizer and architecture to load these weights.
    base_model: str = ""
    # Trajectories of this version's batches that did not train, and why (stale, untrainable status, an SFT
    # batch's unsuccessful ones, every one of a skipped batch): what lineage reports as "not trained".
    untrained: dict[str, str] = field(default_factory=dict)
    # "RUN:vK" when this run's v0 is run RUN's checkpoint K (`python -m learner --init`): the turns of RUN's
    # trajectories are K + |K - s| versions away from this run's v0, not s.
    init_from: str = ""
    # Every batch consumed since the previous version, trained or skipped, in the order the learner read
    # them: a rebuild replays them in this order when the batches topic no longer has them.
    read_order: list[str] = field(default_factory=list)
    # Batches the learner reads to make the next version (its updates per checkpoint times its batches per
    # update, in the phase that follows); 0 when not said. A rollout worker that has made its quota compares it
    # with what the batches topic holds past `offsets`: while the learner is short, waiting makes nothing.
    next_batches: int = 0

    @property
    def has_moments(self) -> bool:
        """Whether this version carries the optimizer state (a restart can resume from it)."""
        return has_moments(self.files)

    def to_json(self) -> bytes:
        doc = asdict(self)
        doc["offsets"] = {str(k): v for k, v in self.offsets.items()}
        return json.dumps(doc, sort_keys=True, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "CheckpointManifest":
        try:
            doc = json.loads(data)
            if doc.get("format") != CHECKPOINT_FORMAT:
                raise ManifestError(f"unknown checkpoint format {doc.get('format')!r}")
            doc["files"] = {k: FileEntry(**v) for k, v in doc["files"].items()}
            doc["offsets"] = {int(k): int(v) for k, v in doc["offsets"].items()}
            return cls(**doc)
        except ManifestError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ManifestError(f"malformed checkpoint manifest: {exc}") from exc
