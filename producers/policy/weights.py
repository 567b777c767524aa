"""Weights as safetensors (never pickle): read a state source, write one file, copy a state into a model."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from producers.policy.interface import WeightSource
from schemas.errors import CheckpointError


def safetensors_files(source: str | os.PathLike[str]) -> list[Path]:
    """The safetensors file itself, or every safetensors file of a checkpoint directory, sorted."""
    path = Path(source)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.is_file() and f.suffix == ".safetensors" for f in files):
        raise CheckpointError(f"{path}: expected a .safetensors file or a directory holding some")
    return files


def read_state(source: WeightSource) -> dict[str, torch.Tensor]:
    """A state dict from a mapping, a safetensors file, or a directory of safetensors shards."""
    if isinstance(source, Mapping):
        return dict(source)
    state: dict[str, torch.Tensor] = {}
    for file in safetensors_files(source):
        try:
            state.update(load_file(str(file)))
        except Exception as exc:  # safetensors raises its own SafetensorError for corrupt headers
            raise CheckpointError(f"{file}: not a readable safetensors file: {exc}") from exc
    return state


def _storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    """Equal for tensors that are the same memory (tied weights)."""
    return tensor.untyped_storage().data_ptr(), int(tensor.storage_offset())


def unaliased(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state with tensors that share storage (tied embeddings) kept once, contiguous, on the CPU."""
    seen: set[tuple[int, int]] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        key = _storage_key(tensor)
        if key in seen:
            continue
        seen.add(key)
        out[name] = tensor.detach().to("cpu").contiguous()
    return out


def write_state_file(state: Mapping[str, torch.Tensor], path: str | os.PathLike[str]) -> Path:
    """One safetensors file holding `state` (safetensors refuses shared storage, hence unaliased)."""
    save_file(unaliased(state), str(path))
    return Path(path)


def _alias_names(model: torch.nn.Module) -> dict[str, set[str]]:
    """For each state-dict name, every name sharing its storage (itself included)."""
    by_ptr: dict[tuple[int, int], set[str]] = {}
    for name, tensor in model.state_dict().items():
        by_ptr.setdefault(_storage_key(tensor), set()).add(name)
    return {name: group for group in by_ptr.values() for name in group}


def check_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Raise CheckpointError unless `state` covers every weight of `model` with the right shapes."""
    own = model.state_dict()
    # A tied weight saved under one name only (how save_pretrained writes them) is still complete.
    missing = {n for n, group in _alias_names(model).items() if not group & set(state)}
    _raise_on_misfit(missing, set(state) - set(own), _wrong_shapes(_shapes_of(own), _shapes_of(state)))


@torch.no_grad()
def copy_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy `state` into the model's own tensors in place (checked first, so a bad state changes nothing)."""
    check_state(model, state)
    own = model.state_dict()
    for name, tensor in state.items():
        own[name].copy_(tensor)


def safetensors_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes from safetensors headers, without reading the tensors."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                shapes.update({name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()})
        except Exception as exc:  # safetensors raises its own SafetensorError for corrupt headers
            raise CheckpointError(f"{file}: not a readable safetensors file: {exc}") from exc
    return shapes


def check_shapes(reference: Mapping[str, tuple[int, ...]], given: Mapping[str, tuple[int, ...]],
                 optional: frozenset[str] = frozenset()) -> None:
    """Raise CheckpointError unless `given` has exactly the reference tensors (bar `optional` extras)."""
    missing = set(reference) - set(given)
    _raise_on_misfit(missing, set(given) - set(reference) - optional, _wrong_shapes(reference, given))


def _shapes_of(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {name: tuple(tensor.shape) for name, tensor in state.items()}


def _wrong_shapes(reference: Mapping[str, tuple[int, ...]], given: Mapping[str, tuple[int, ...]]) -> set[str]:
    return {n for n in set(given) & set(reference) if tuple(given[n]) != tuple(reference[n])}


def _raise_on_misfit(missing: set[str], unexpected: set[str], wrong: set[str]) -> None:
    if missing or unexpected or wrong:
        raise CheckpointError(
            f"weights do not fit the model: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}, wrong shape {sorted(wrong)[:5]}"
        )
