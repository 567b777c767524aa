"""The policy model: the small Llama built from its config, a local checkpoint directory, saving one."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from schemas.errors import CheckpointError, ConfigError
from schemas.models import tiny_llama_config


def build_tiny_model(seed: int = 0, config: dict[str, Any] | None = None) -> Any:
    """A freshly initialised LlamaForCausalLM from `config` (default: tiny_llama_config()), float32, eval."""
    from transformers import LlamaConfig, LlamaForCausalLM

    # fork_rng: seed the init without moving the caller's global RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(**(config or tiny_llama_config())))
    return model.float().eval()


def load_local_model(model_dir: str | os.PathLike[str], dtype: torch.dtype = torch.float32) -> Any:
    """A causal LM from a local Hugging Face checkpoint directory; never reaches a model hub."""
    from transformers import AutoModelForCausalLM

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise ConfigError(f"{path} is not a checkpoint directory (no config.json): pass a local model dir")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=dtype)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load the model in {path}: {exc}") from exc
    return model.eval()


def save_pretrained_dir(model: Any, tokenizer: Any | None, path: str | os.PathLike[str]) -> Path:
    """Write config.json + model.safetensors (+ tokenizer files), loadable by from_pretrained."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    if tokenizer is not None:
        getattr(tokenizer, "hf", tokenizer).save_pretrained(str(out))
    if list(out.glob("*.bin")) or not list(out.glob("*.safetensors")):
        raise CheckpointError(f"{out}: expected safetensors weights and no pickle files")
    return out
