"""The vLLM policy backend for GPU hosts: the PolicyBackend interface with in-place weight reloads.

vllm is an optional extra installed in an environment of its own; it is imported only when this backend
is built. Written for vLLM 0.33 (current when written); it needs >= 0.10.2 for `logprobs_mode`. It uses:

    LLM(model=dir, seed=, skip_tokenizer_init=True, logprobs_mode="processed_logprobs",
        worker_extension_cls="producers.policy.vllm_worker.WeightReloadExtension", **engine_kw)
    LLM.generate([{"prompt_token_ids": ids}, ...], [SamplingParams(...) per prompt], use_tqdm=False)
    SamplingParams(n=, temperature=, top_p=, max_tokens=, logprobs=0, seed=, stop_token_ids=, detokenize=False)
    LLM.collective_rpc("load_safetensors_weights", args=(path,)); LLM.reset_prefix_cache()

Log-probs: vLLM's "processed_logprobs" are taken after temperature scaling and after top-k/top-p masking,
so with top_p == 1 they are exactly log_softmax(logits / T), the convention of interface.py (and greedy
requests get log_softmax(logits), T = 1, as in the CPU backend). With top_p < 1 vLLM renormalises over the
nucleus, which would bias the learner's importance ratio, so this backend refuses top_p < 1.

Tokenization stays on our side (skip_tokenizer_init): prompts arrive as ids, EOS is passed as a stop token
id (vLLM keeps it as the last output token, with its log-prob) and text is decoded with our tokenizer.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from producers.policy.interface import FinishReason, Generation, Prompts, Sampling, WeightSource
from producers.policy.models import build_tiny_model, save_pretrained_dir
from producers.policy.tokenizer import PolicyTokenizer, encode_prompts, load_hf_tokenizer
from producers.policy.weights import (
    check_shapes,
    safetensors_files,
    safetensors_shapes,
    unaliased,
    write_state_file,
)
from schemas.errors import CheckpointError, ConfigError, PipelineError

EXTENSION = "producers.policy.vllm_worker.WeightReloadExtension"
RELOAD_METHOD = "load_safetensors_weights"
LOGPROBS_MODE = "processed_logprobs"
# vLLM's Llama skips this name when embeddings are tied, so a state dict may carry it or not.
TIED_HEAD = frozenset({"lm_head.weight"})


class VLLMBackend:
    """A PolicyBackend over a vllm.LLM engine that stays up across weight updates."""

    def __init__(self, llm: Any, tokenizer: PolicyTokenizer, model_dir: str | os.PathLike[str],
                 version: int = 0, workdir: tempfile.TemporaryDirectory[str] | None = None) -> None:
        self._llm = llm
        self._tokenizer = tokenizer
        self._shapes = safetensors_shapes(safetensors_files(model_dir))
        self._optional = TIED_HEAD if _read_config(model_dir).get("tie_word_embeddings") else frozenset()
        self._version = version
        self._workdir = workdir  # holds a generated model dir alive as long as the engine

    @classmethod
    def create(cls, model_dir: str | os.PathLike[str] | None = None, seed: int = 0,
               config: dict[str, Any] | None = None, version: int = 0, **engine_kw: Any) -> VLLMBackend:
        """An engine on `model_dir`, or on the seeded small model written to a temporary directory."""
        workdir = None
        if model_dir is None:
            workdir = tempfile.TemporaryDirectory(prefix="trajpipe-policy-")
            model_dir = save_pretrained_dir(build_tiny_model(seed, config), load_hf_tokenizer(None), workdir.name)
        elif config is not None:
            raise ConfigError("give either model_dir (a checkpoint) or config (a fresh model), not both")
        tokenizer = PolicyTokenizer(load_hf_tokenizer(model_dir), extra_eos=_declared_eos(model_dir))
        llm = _make_llm(str(model_dir), seed, engine_kw)
        return cls(llm, tokenizer, model_dir, version=version, workdir=workdir)

    @property
    def version(self) -> int:
        return self._version

    @property
    def tokenizer(self) -> PolicyTokenizer:
        return self._tokenizer

    def generate(self, prompts: Prompts, n: int, sampling: Sampling) -> list[list[Generation]]:
        _check_sampling(sampling, n)
        ids = encode_prompts(prompts, self._tokenizer)
        # Greedy samples are identical: ask once, copy n times (older vLLM refuses n > 1 when greedy).
        asked = 1 if sampling.greedy else n
        params = [self._params(sampling, asked, seed_offset=i * n) for i in range(len(ids))]
        outputs = self._llm.generate([{"prompt_token_ids": row} for row in ids], params, use_tqdm=False)
        groups = [[self._generation(c) for c in out.outputs] for out in outputs]
        return [[_copy(g[0]) for _ in range(n)] if sampling.greedy else g for g in groups]

    def load_weights(self, state: WeightSource, version: int) -> None:
        """Check names and shapes against the served checkpoint, then load on every worker in place."""
        with tempfile.TemporaryDirectory(prefix="trajpipe-weights-") as tmp:
            files = self._state_files(state, Path(tmp))
            try:
                for file in files:
                    self._llm.collective_rpc(RELOAD_METHOD, args=(str(file),))
            except Exception as exc:
                raise CheckpointError(f"vLLM failed to load {[f.name for f in files]}: {exc}; "
                                      "the engine may hold partial weights: load a good version") from exc
        # Cached prefix KV was computed by the old weights.
        self._llm.reset_prefix_cache()
        self._version = version

    def close(self) -> None:
        """Drop the engine and any generated model directory."""
        self._llm = None
        if self._workdir is not None:
            self._workdir.cleanup()

    def _state_files(self, state: WeightSource, tmp: Path) -> list[Path]:
        if isinstance(state, (str, os.PathLike)):
            files = safetensors_files(state)
            check_shapes(self._shapes, safetensors_shapes(files), self._optional)
            return files
        tensors = unaliased(state)
        check_shapes(self._shapes, {name: tuple(t.shape) for name, t in tensors.items()}, self._optional)
        return [write_state_file(tensors, tmp / "state.safetensors")]

    def _params(self, sampling: Sampling, n: int, seed_offset: int) -> Any:
        from vllm import SamplingParams

        return SamplingParams(
            n=n,
            temperature=0.0 if sampling.greedy else sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=sampling.max_new_tokens,
            logprobs=0,  # the sampled token's own log-prob, no top-k alternatives
            # vLLM seeds the n children of a request with seed + index: keep prompts' ranges disjoint.
            seed=None if sampling.seed is None else sampling.seed + seed_offset,
            stop_token_ids=sorted(self._tokenizer.eos_token_ids),
            detokenize=False,
        )

    def _generation(self, completion: Any) -> Generation:
        tokens = [int(t) for t in completion.token_ids]
        steps = completion.logprobs
        if steps is None or len(steps) != len(tokens):
            raise PipelineError(f"vLLM returned {0 if steps is None else len(steps)} log-prob steps "
                                f"for {len(tokens)} tokens")
        logprobs = [float(step[token].logprob) for step, token in zip(steps, tokens)]
        return Generation(tokens, logprobs, self._tokenizer.decode(tokens), _finish_reason(completion))


def _make_llm(model_dir: str, seed: int, engine_kw: dict[str, Any]) -> Any:
    from vllm import LLM

    try:
        return LLM(model=model_dir, seed=seed, skip_tokenizer_init=True, logprobs_mode=LOGPROBS_MODE,
                   worker_extension_cls=EXTENSION, **engine_kw)
    except TypeError as exc:  # an engine argument this vLLM does not know
        raise ConfigError(f"this vLLM rejects an engine argument ({exc}); the backend needs vllm >= 0.10.2") from exc


def _check_sampling(sampling: Sampling, n: int) -> None:
    if n < 1:
        raise ConfigError(f"n (samples per prompt) must be >= 1, got {n}")
    if sampling.top_p < 1.0 and not sampling.greedy:
        raise ConfigError(
            f"top_p={sampling.top_p} with the vllm backend: vLLM reports log-probs renormalised over the "
            "nucleus, not log_softmax(logits / T) as the learner computes; use top_p=1.0"
        )


def _finish_reason(completion: Any) -> FinishReason:
    reason = completion.finish_reason
    if reason == "stop":
        return "stop"
    if reason == "length":
        return "length"
    raise PipelineError(f"vLLM finished a sequence with reason {reason!r}, expected 'stop' or 'length'")


def _copy(gen: Generation) -> Generation:
    return Generation(list(gen.tokens), list(gen.logprobs), gen.text, gen.finish_reason)


def _read_config(model_dir: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{model_dir} is not a checkpoint directory (no config.json): pass a local model dir")
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def _declared_eos(model_dir: str | os.PathLike[str]) -> list[int]:
    """EOS ids from config.json and generation_config.json (each an int or a list)."""
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        path = Path(model_dir) / name
        value = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
        ids += [] if value is None else [value] if isinstance(value, int) else list(value)
    return ids
