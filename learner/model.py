"""The policy model of the learner: built from the tiny config or a local checkpoint dir, its frozen reference.

    policy = build_policy()                      # tiny Llama, ByT5 byte vocabulary
    policy = build_policy("/path/to/hf_dir")     # any local Hugging Face causal LM
    reference = frozen_reference(policy)         # for the KL term; never updated
    with autocast_context(model_device(policy)): ...
"""
from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import ContextManager

import torch
from transformers import AutoModelForCausalLM, ByT5Tokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from schemas.models import tiny_llama_config


def build_policy(
    model_dir: str | Path | None = None,
    layers: int = 4,
    width: int = 256,
    heads: int = 4,
    seed: int | None = None,
) -> PreTrainedModel:
    """A float32 policy in train mode; `seed` makes the random init of the tiny model reproducible."""
    if seed is not None:
        torch.manual_seed(seed)
    model: PreTrainedModel
    if model_dir is not None:
        # local_files_only: this machine cannot reach a model hub, and must not try.
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True)
    else:
        model = LlamaForCausalLM(LlamaConfig(**tiny_llama_config(layers=layers, width=width, heads=heads)))
    model.train()
    return model


def build_tokenizer() -> ByT5Tokenizer:
    """The byte tokenizer of the tiny policy: needs no files."""
    return ByT5Tokenizer()


def set_grad_checkpointing(model: PreTrainedModel, enabled: bool) -> None:
    """Trade compute for activation memory; the KV cache is useless while training, so it goes too."""
    if enabled:
        # Non-reentrant checkpointing works with inputs that do not require grad (token ids).
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    elif model.is_gradient_checkpointing:
        model.gradient_checkpointing_disable()


def frozen_reference(model: PreTrainedModel) -> PreTrainedModel:
    """A copy of the policy as it is now, in eval mode with no gradients: the anchor of the KL term."""
    reference = copy.deepcopy(model)
    reference.eval()
    reference.requires_grad_(False)
    return reference


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def bf16_available(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_bf16_supported()


def autocast_context(device: torch.device, cpu_bf16: bool = False) -> ContextManager[object]:
    """bf16 autocast on GPUs that support it; on CPU only when asked (it is often slower there)."""
    if bf16_available(device):
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    if device.type == "cpu" and cpu_bf16:
        return torch.autocast(device_type="cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()
