"""Methods added to every vLLM GPU worker (via `worker_extension_cls`) to reload weights in place.

vLLM mixes this class into its Worker, so `self.model_runner` is the worker's own model runner.
Only a file path crosses the process boundary: tensors are read from safetensors inside the worker,
so nothing is pickled.
"""
from __future__ import annotations

from typing import Any


class WeightReloadExtension:
    """`llm.collective_rpc("load_safetensors_weights", args=(path,))` runs this on each worker."""

    model_runner: Any

    def load_safetensors_weights(self, path: str) -> int:
        """Load every tensor of one safetensors file into the running model; returns how many."""
        from safetensors import safe_open

        runner = self.model_runner
        # get_model() unwraps the CUDA-graph wrapper of recent vLLM; older runners only have .model.
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        with safe_open(path, framework="pt", device="cpu") as handle:
            names = list(handle.keys())
            # The model's own load_weights maps checkpoint names onto fused layers (qkv_proj, gate_up_proj)
            # and tensor-parallel shards, and copies into the existing buffers, so CUDA graphs stay valid.
            model.load_weights(weights=((name, handle.get_tensor(name)) for name in names))
        return len(names)
