"""Next-token choice from logits: temperature, nucleus filter, and the behaviour log-prob of the choice."""
from __future__ import annotations

import torch

from producers.policy.interface import Sampling


def behaviour_logprobs(logits: torch.Tensor, temperature: float, greedy: bool) -> torch.Tensor:
    """log_softmax(logits / T) in float32, [B, V]; greedy decoding reports T = 1 (see interface.py)."""
    scaled = logits.float() if greedy else logits.float() / temperature
    return torch.log_softmax(scaled, dim=-1)


def nucleus_filter(logprobs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The log-probs with every token outside the top-p nucleus set to -inf, [B, V]."""
    if top_p >= 1.0:
        return logprobs
    sorted_lp, order = logprobs.sort(dim=-1, descending=True)
    probs = sorted_lp.exp()
    # A token stays if the mass ranked above it is still short of top_p, so the top token always stays.
    outside = (probs.cumsum(dim=-1) - probs) >= top_p
    sorted_lp = sorted_lp.masked_fill(outside, float("-inf"))
    return torch.full_like(logprobs, float("-inf")).scatter(-1, order, sorted_lp)


def choose_tokens(
    logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The next token of each row and its behaviour log-prob: ([B] int64, [B] float32)."""
    logprobs = behaviour_logprobs(logits, sampling.temperature, sampling.greedy)
    if sampling.greedy:
        tokens = logprobs.argmax(dim=-1)
    else:
        probs = nucleus_filter(logprobs, sampling.top_p).exp()
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
