"""The checkpoint manifest (JSON beside the weights): sha256 per file, consumed offsets, model config."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from schemas.errors import ManifestError

CHECKPOINT_FORMAT = "trajpipe.checkpoint/1"


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
