"""The transformers policy backend: batched sampling with left padding and a KV cache, on CPU by default."""
from __future__ import annotations

import os
import random
from typing import Any, Iterator, Sequence

import torch

from producers.policy.interface import Generation, Prompts, Sampling, WeightSource
from producers.policy.models import build_tiny_model, load_local_model
from producers.policy.sampling import choose_tokens
from producers.policy.tokenizer import PolicyTokenizer, encode_prompts, load_hf_tokenizer
from producers.policy.weights import copy_state, read_state
from schemas.errors import ConfigError


class TransformersBackend:
    """A PolicyBackend over a transformers causal LM; generation is its own loop so log-probs are exact."""

    def __init__(
        self,
        model: Any,
        tokenizer: PolicyTokenizer,
        device: str | torch.device = "cpu",
        max_batch_size: int = 64,
        version: int = 0,
    ) -> None:
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self._tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self._version = version
        self._eos = torch.tensor(sorted(tokenizer.eos_token_ids), device=self.device)

    @classmethod
    def create(
        cls,
        model_dir: str | os.PathLike[str] | None = None,
        seed: int = 0,
        config: dict[str, Any] | None = None,
        **kw: Any,
    ) -> TransformersBackend:
        """The seeded small model from `config`, or the checkpoint in `model_dir` (local files only)."""
        if model_dir is not None and config is not None:
            raise ConfigError("give either model_dir (a checkpoint) or config (a fresh model), not both")
        model = build_tiny_model(seed, config) if model_dir is None else load_local_model(model_dir)
        tokenizer = PolicyTokenizer(load_hf_tokenizer(model_dir), extra_eos=_config_eos(model))
        return cls(model, tokenizer, **kw)

    @property
    def version(self) -> int:
        return self._version

    @property
    def tokenizer(self) -> PolicyTokenizer:
        return self._tokenizer

    def generate(self, prompts: Prompts, n: int, sampling: Sampling) -> list[list[Generation]]:
        if n < 1:
            raise ConfigError(f"n (samples per prompt) must be >= 1, got {n}")
        ids = encode_prompts(prompts, self._tokenizer)
        self._check_length(ids, sampling)
        rows = [row for row in ids for _ in range(n)]
        generator = self._generator(sampling.seed)
        flat: list[Generation] = []
        for chunk in _chunks(rows, self.max_batch_size):
            flat.extend(self._generate_batch(chunk, sampling, generator))
        return [flat[i * n:(i + 1) * n] for i in range(len(ids))]

    def load_weights(self, state: WeightSource, version: int) -> None:
        copy_state(self.model, read_state(state))
        self._version = version

    def _check_length(self, ids: list[list[int]], sampling: Sampling) -> None:
        limit = getattr(self.model.config, "max_position_embeddings", None)
        longest = max(len(row) for row in ids) + sampling.max_new_tokens
        if limit is not None and longest > limit:
            raise ConfigError(
                f"prompt + max_new_tokens reaches {longest} positions, the model has {limit}: "
                "shorten the prompt or lower max_new_tokens"
            )

    def _generator(self, seed: int | None) -> torch.Generator:
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed if seed is not None else random.SystemRandom().randrange(2**63))
        return generator

    @torch.inference_mode()
    def _generate_batch(
        self, rows: list[list[int]], sampling: Sampling, generator: torch.Generator
    ) -> list[Generation]:
        input_ids, mask = self._left_pad(rows)
        # Positions count real tokens only, so a left-padded row sees the positions it would see alone.
        positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                         use_cache=True, logits_to_keep=1)
        next_pos = positions[:, -1:] + 1
        tokens, logprobs = [], []
        done = torch.zeros(len(rows), dtype=torch.bool, device=self.device)
        for step in range(sampling.max_new_tokens):
            token, logprob = choose_tokens(out.logits[:, -1, :], sampling, generator)
            tokens.append(token)
            logprobs.append(logprob)
            done |= torch.isin(token, self._eos)
            if bool(done.all()) or step == sampling.max_new_tokens - 1:
                break
            mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=-1)
            out = self.model(input_ids=token.unsqueeze(-1), attention_mask=mask, position_ids=next_pos,
                             past_key_values=out.past_key_values, use_cache=True)
            next_pos = next_pos + 1
        return self._finish(torch.stack(tokens, dim=1), torch.stack(logprobs, dim=1))

    def _left_pad(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(row) for row in rows)
        ids = torch.full((len(rows), width), self._tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
            mask[i, width - len(row):] = 1
        return ids.to(self.device), mask.to(self.device)

    def _finish(self, tokens: torch.Tensor, logprobs: torch.Tensor) -> list[Generation]:
        """Cut each row after its first EOS; rows kept running after it only to stay in the batch."""
        result = []
        for row_tokens, row_logprobs in zip(tokens.tolist(), logprobs.tolist()):
            stop = next((i for i, t in enumerate(row_tokens) if t in self._tokenizer.eos_token_ids), None)
            end = len(row_tokens) if stop is None else stop + 1
            kept = row_tokens[:end]
            result.append(Generation(kept, row_logprobs[:end], self._tokenizer.decode(kept),
                                     "length" if stop is None else "stop"))
        return result


def _config_eos(model: Any) -> list[int]:
    """EOS ids the model config declares (an int or a list), besides the tokenizer's own."""
    declared = getattr(model.config, "eos_token_id", None)
    if declared is None:
        return []
    return [int(declared)] if isinstance(declared, int) else [int(i) for i in declared]


def _chunks(rows: Sequence[list[int]], size: int) -> Iterator[list[list[int]]]:
    for start in range(0, len(rows), size):
        yield list(rows[start:start + size])
