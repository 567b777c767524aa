"""The policy model contract shared by producers and learner: config of the small CPU model, tokenizer name."""
from __future__ import annotations

from typing import Any

# ByT5Tokenizer(): 3 special ids (pad 0, eos 1, unk 2), bytes at 3..258, then 125 extra ids.
BYTE_VOCAB = 384
PAD_ID, EOS_ID = 0, 1
TOKENIZER = "byt5"


def tiny_llama_config(layers: int = 4, width: int = 256, heads: int = 4, max_positions: int = 2048) -> dict[str, Any]:
    """A few-M-parameter Llama config (a plain dict, so this module needs no torch)."""
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": BYTE_VOCAB,
        "hidden_size": width,
        "intermediate_size": width * 4,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "pad_token_id": PAD_ID,
        "bos_token_id": EOS_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": "float32",
    }
