"""The policy tokenizer: ByT5 bytes by default, or a local checkpoint's own tokenizer files."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Sequence

from schemas.errors import ConfigError
from schemas.models import EOS_ID

# Any of these in a checkpoint directory means it ships its own tokenizer.
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json")


class PolicyTokenizer:
    """Encode and decode as the policy does; `hf` is the underlying transformers tokenizer."""

    def __init__(self, hf: Any, extra_eos: Iterable[int] = ()) -> None:
        self.hf = hf
        eos = {i for i in [hf.eos_token_id, *extra_eos] if i is not None}
        self._eos = frozenset(eos or {EOS_ID})
        self._pad = hf.pad_token_id if hf.pad_token_id is not None else min(self._eos)

    def encode(self, text: str) -> list[int]:
        """Token ids of a prompt: the tokenizer's own leading specials (a BOS), never a trailing EOS."""
        ids: list[int] = list(self.hf(text, add_special_tokens=True)["input_ids"])
        # ByT5 appends EOS to every encoding; a prompt must not end the episode before it starts.
        while ids and ids[-1] in self._eos:
            ids.pop()
        return ids

    def prompt(self, text: str) -> list[int]:
        """Token ids of a task prompt as the policy should see it: a chat model's user turn and the start of
        its answer (its own chat template), plain text for a model without one (the byte-level model)."""
        if getattr(self.hf, "chat_template", None):
            ids = self.hf.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=True)
            return [int(i) for i in (ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)]
        return self.encode(text)

    def completion(self, text: str) -> list[int]:
        """Token ids of text the policy would generate after a prompt: no specials, then its EOS."""
        ids = [i for i in self.hf(text, add_special_tokens=False)["input_ids"] if i not in self._eos]
        eos = self.hf.eos_token_id if self.hf.eos_token_id in self._eos else min(self._eos)
        return ids + [int(eos)]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.hf.decode(list(ids), skip_special_tokens=True))

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos

    @property
    def pad_token_id(self) -> int:
        return int(self._pad)


def has_tokenizer_files(model_dir: str | os.PathLike[str]) -> bool:
    return any((Path(model_dir) / name).is_file() for name in TOKENIZER_FILES)


def load_hf_tokenizer(model_dir: str | os.PathLike[str] | None) -> Any:
    """The checkpoint's tokenizer when it has files, else ByT5 (which needs none)."""
    from transformers import AutoTokenizer, ByT5Tokenizer

    if model_dir is None or not has_tokenizer_files(model_dir):
        return ByT5Tokenizer()
    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load the tokenizer of {model_dir}: {exc}") from exc


def encode_prompts(prompts: Sequence[Sequence[int]] | Sequence[str], tokenizer: PolicyTokenizer) -> list[list[int]]:
    """Token ids of each prompt; text is encoded, ids are checked to be non-empty."""
    ids = [tokenizer.encode(p) if isinstance(p, str) else [int(t) for t in p] for p in prompts]
    for i, row in enumerate(ids):
        if not row:
            raise ValueError(f"prompt {i} is empty: the policy needs at least one token to condition on")
    return ids
