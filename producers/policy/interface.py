"""The policy interface: sampling settings, one generated completion, and the backend protocol.

Usage loop of a rollout worker:

    backend = make_backend("transformers", seed=0)
    groups = backend.generate(["12+30="], n=4, sampling=Sampling(temperature=1.0, max_new_tokens=32, seed=7))
    for gen in groups[0]:            # the n samples of prompt 0: one GRPO group
        gen.tokens, gen.logprobs     # one behaviour log-prob per generated token, EOS included
    backend.load_weights("/cache/ckpt-12/model.safetensors", version=12)   # no restart

Behaviour log-prob convention (the learner must compute the same quantity):
    logprob[t] = log_softmax(logits[t] / T)[token[t]]    for T = sampling.temperature > 0
    logprob[t] = log_softmax(logits[t])[token[t]]        for greedy decoding (T == 0), i.e. T taken as 1
Top-p changes which tokens can be drawn, never the recorded value: the log-prob is under the full
temperature-scaled distribution, not the renormalised nucleus. (The vLLM backend can only report that
for top_p == 1 and refuses top_p < 1; see vllm_backend.py.)
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Mapping, Protocol, Sequence, runtime_checkable

from schemas.errors import ConfigError

if TYPE_CHECKING:
    from torch import Tensor

FinishReason = Literal["stop", "length"]
# Temperatures below this decode greedily (the same threshold vLLM uses).
GREEDY_BELOW = 1e-5

Prompts = Sequence[Sequence[int]] | Sequence[str]
WeightSource = Mapping[str, "Tensor"] | str | os.PathLike[str]


@dataclass(frozen=True)
class Sampling:
    """How to sample: temperature (0 = greedy), nucleus top_p, a length cap, and an optional seed."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ConfigError(f"sampling temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"sampling top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"sampling max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


@dataclass(frozen=True)
class Generation:
    """One sampled completion: tokens (EOS included when it stopped there) and their behaviour log-probs."""

    tokens: list[int]
    logprobs: list[float]
    text: str
    finish_reason: FinishReason

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.logprobs):
            raise ValueError(f"{len(self.tokens)} tokens but {len(self.logprobs)} log-probs")


@runtime_checkable
class Tokenizer(Protocol):
    """Text <-> token ids as the policy sees them."""

    def encode(self, text: str) -> list[int]: ...

    def prompt(self, text: str) -> list[int]:
        """A task prompt as the policy sees it (a chat model's user turn, else the plain encoding)."""
        ...

    def completion(self, text: str) -> list[int]:
        """Text the policy would generate after a prompt, ended by its EOS (demonstrations)."""
        ...

    def decode(self, ids: Sequence[int]) -> str: ...

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    @property
    def pad_token_id(self) -> int: ...


@runtime_checkable
class PolicyBackend(Protocol):
    """A policy that samples completions with behaviour log-probs and takes new weights while running."""

    @property
    def version(self) -> int:
        """The policy version of the weights now loaded."""
        ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    def generate(self, prompts: Prompts, n: int, sampling: Sampling) -> list[list[Generation]]:
        """n completions for each prompt (token ids or text), in prompt order."""
        ...

    def load_weights(self, state: WeightSource, version: int) -> None:
        """Replace the weights in place (a state dict, a safetensors file, or a directory of them)."""
        ...
