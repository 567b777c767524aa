"""The checkpoint directory as bytes in memory: safetensors weights and optimizer state, JSON config and state.

A checkpoint written with `moments=False` has no optimizer files: its weights serve rollout workers, eval
and export; a learner resumes from the newest version that has them (see learner.service). One written with
`broadcast_bf16=True` also carries the weights rounded to bfloat16 (`model.bf16.safetensors`, half the bytes):
what rollout workers following the learner download and generate with; eval, export and a resume read the
float32 weights.

No pickle: tensors go to safetensors, everything else to JSON. The directory loads with
`AutoModelForCausalLM.from_pretrained(dir)` once written to disk.

    files = write_checkpoint(trainer.state_dict_for_checkpoint())    # {filename: bytes}
    entries = file_entries(files)                                     # sha256 per file for CheckpointManifest
    state = read_checkpoint(files)
    trainer.load_checkpoint_state(state.model, state.optimizer, state.trainer)
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
import torch
from torch import Tensor, nn

from schemas.errors import CheckpointError, IntegrityError
from schemas.manifests import (BROADCAST_FILE, MOMENT_FILES, OPTIMIZER_FILE, OPTIMIZER_META_FILE, WEIGHTS_FILE,
                               FileEntry, has_moments)
from schemas.packing import sha256_hex

MODEL_FILE = WEIGHTS_FILE
CONFIG_FILE = "config.json"
TRAINER_STATE_FILE = "trainer_state.json"
CHECKPOINT_FILES = (MODEL_FILE, BROADCAST_FILE, CONFIG_FILE, OPTIMIZER_FILE, OPTIMIZER_META_FILE, TRAINER_STATE_FILE)
REQUIRED_FILES = (MODEL_FILE, CONFIG_FILE, TRAINER_STATE_FILE)


@dataclass(frozen=True)
class OptimizerState:
    tensors: dict[str, Tensor]  # "state.<param index>.<name>" -> tensor (exp_avg, exp_avg_sq, step, ...)
    meta: dict[str, Any]        # param_groups, non-tensor per-param values, and whatever the trainer adds


@dataclass(frozen=True)
class CheckpointState:
    model: dict[str, Tensor]
    model_config: dict[str, Any]
    optimizer: OptimizerState | None  # None: a weights-only version
    trainer: dict[str, Any]

    def moments(self) -> OptimizerState:
        """The optimizer state, which a resume needs; CheckpointError for a weights-only version."""
        if self.optimizer is None:
            raise CheckpointError("this version carries no optimizer state (written weights-only, --moments-every): "
                                  "resume from a version that does")
        return self.optimizer


def model_tensors(model: nn.Module) -> dict[str, Tensor]:
    """The state dict on CPU with tied aliases (lm_head = embeddings) dropped: safetensors refuses shared
    storage, and from_pretrained re-ties them, as it does for save_pretrained's output."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    out: dict[str, Tensor] = {}
    for name, tensor in model.state_dict().items():
        identity = (tensor.data_ptr(), tuple(tensor.shape))
        if identity not in seen:
            seen.add(identity)
            out[name] = tensor.detach().cpu().contiguous().clone()
    return out


def load_model_tensors(model: nn.Module, tensors: Mapping[str, Tensor]) -> None:
    """Load weights written by `model_tensors`; any missing or unknown name is an error."""
    expected = set(model_tensors(model))
    missing, unknown = expected - set(tensors), set(tensors) - expected
    if missing or unknown:
        raise CheckpointError(
            f"checkpoint does not fit the model: missing {sorted(missing)}, unknown {sorted(unknown)}"
        )
    model.load_state_dict(dict(tensors), strict=False)


def flatten_optimizer_state(state_dict: dict[str, Any]) -> OptimizerState:
    """torch optimizer state_dict -> flat tensors + JSON-able meta."""
    tensors: dict[str, Tensor] = {}
    scalars: dict[str, Any] = {}
    for index, per_param in state_dict["state"].items():
        for name, value in per_param.items():
            key = f"state.{index}.{name}"
            if isinstance(value, Tensor):
                tensors[key] = value.detach().cpu().contiguous().clone()
            else:
                scalars[key] = value
    return OptimizerState(tensors, {"param_groups": state_dict["param_groups"], "scalars": scalars})


def unflatten_optimizer_state(state: OptimizerState) -> dict[str, Any]:
    """Inverse of `flatten_optimizer_state`, ready for `optimizer.load_state_dict`."""
    per_param: dict[int, dict[str, Any]] = {}
    values = {**state.tensors, **state.meta.get("scalars", {})}
    for key, value in values.items():
        _, index, name = key.split(".", 2)
        per_param.setdefault(int(index), {})[name] = value
    # JSON turned tuples (Adam's betas) into lists; torch compares them in places, so restore them.
    groups = [{k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in state.meta["param_groups"]]
    return {"state": per_param, "param_groups": groups}


def _json(doc: Any) -> bytes:
    try:
        return json.dumps(doc, sort_keys=True, indent=1).encode()
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint metadata is not JSON-serialisable: {exc}") from exc


def write_checkpoint(state: CheckpointState, moments: bool = True, broadcast_bf16: bool = False) -> dict[str, bytes]:
    """The files of a checkpoint directory, as bytes: five, or three without the optimizer's moments; one more
    with `broadcast_bf16` (the weights for rollout workers, in bfloat16)."""
    files = {
        # "format": "pt" is what from_pretrained expects in the safetensors header.
        MODEL_FILE: save_safetensors(state.model, metadata={"format": "pt"}),
        CONFIG_FILE: _json(state.model_config),
        TRAINER_STATE_FILE: _json(state.trainer),
    }
    if broadcast_bf16:
        files[BROADCAST_FILE] = save_safetensors(bf16_weights(state.model), metadata={"format": "pt"})
    if moments:
        optimizer = state.moments()
        files[OPTIMIZER_FILE] = save_safetensors(optimizer.tensors, metadata={"format": "pt"})
        files[OPTIMIZER_META_FILE] = _json(optimizer.meta)
    return files


def bf16_weights(model: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The floating-point tensors rounded to bfloat16 (to nearest even), the others as they are."""
    return {name: t.to(torch.bfloat16) if t.is_floating_point() else t for name, t in model.items()}


def read_checkpoint(files: Mapping[str, bytes]) -> CheckpointState:
    """Parse the files of `write_checkpoint`; a missing or unreadable file raises CheckpointError."""
    missing = [name for name in REQUIRED_FILES if name not in files]
    half = [name for name in MOMENT_FILES if name not in files] if any(n in files for n in MOMENT_FILES) else []
    if missing or half:
        raise CheckpointError(f"checkpoint lacks {missing + half}")
    try:
        optimizer = (OptimizerState(load_safetensors(files[OPTIMIZER_FILE]), json.loads(files[OPTIMIZER_META_FILE]))
                     if has_moments(files) else None)
        return CheckpointState(
            model=load_safetensors(files[MODEL_FILE]),
            model_config=json.loads(files[CONFIG_FILE]),
            optimizer=optimizer,
            trainer=json.loads(files[TRAINER_STATE_FILE]),
        )
    except (ValueError, KeyError) as exc:
        raise CheckpointError(f"unreadable checkpoint: {exc}") from exc


def file_entries(files: Mapping[str, bytes]) -> dict[str, FileEntry]:
    """sha256 and size per file, for `schemas.manifests.CheckpointManifest.files`."""
    return {name: FileEntry(sha256=sha256_hex(data), size=len(data)) for name, data in sorted(files.items())}


def verify_files(files: Mapping[str, bytes], entries: Mapping[str, FileEntry]) -> None:
    """Raise IntegrityError unless every manifest entry is present with its sha256 and size."""
    for name, entry in entries.items():
        data = files.get(name)
        if data is None or len(data) != entry.size or sha256_hex(data) != entry.sha256:
            raise IntegrityError(f"checkpoint file {name}: missing, or sha256/size differs from the manifest")


def write_dir(files: Mapping[str, bytes], path: str | Path) -> Path:
    """Write the files into a directory (created if needed), e.g. for from_pretrained."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (root / name).write_bytes(data)
    return root


def read_dir(path: str | Path) -> dict[str, bytes]:
    """The checkpoint files found in a directory."""
    root = Path(path)
    return {name: (root / name).read_bytes() for name in CHECKPOINT_FILES if (root / name).exists()}

