"""Choose a policy backend by name: `transformers` (CPU default) or `vllm` (GPU hosts, optional extra)."""
from __future__ import annotations

import importlib.util
from typing import Any

from producers.policy.interface import PolicyBackend
from schemas.errors import ConfigError

BACKENDS = ("transformers", "vllm")


def make_backend(name: str = "transformers", model_dir: str | None = None, seed: int = 0, **kw: Any) -> PolicyBackend:
    """A ready backend; `model_dir` is a local checkpoint, None means the seeded small model."""
    if name == "transformers":
        from producers.policy.hf_backend import TransformersBackend

        return TransformersBackend.create(model_dir, seed=seed, **kw)
    if name == "vllm":
        require_vllm()
        from producers.policy.vllm_backend import VLLMBackend

        return VLLMBackend.create(model_dir, seed=seed, **kw)
    raise ConfigError(f"unknown policy backend {name!r}: choose one of {', '.join(BACKENDS)}")


def require_vllm() -> None:
    """Raise ConfigError with the fix when vllm is not importable here."""
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "the vllm policy backend needs the `vllm` extra, which is not installed in this environment: "
            "install it in an environment of its own (pip install 'trajpipe[vllm]' on a GPU host), since "
            "vllm pins torch/transformers/click versions that clash with faust-streaming; "
            "or use the `transformers` backend"
        )
