"""Policy backends behind one interface: sampled completions with behaviour log-probs, hot-loaded weights."""
from producers.policy.factory import BACKENDS, make_backend
from producers.policy.interface import Generation, PolicyBackend, Sampling, Tokenizer
from producers.policy.models import build_tiny_model, load_local_model, save_pretrained_dir

__all__ = [
    "BACKENDS", "Generation", "PolicyBackend", "Sampling", "Tokenizer",
    "build_tiny_model", "load_local_model", "make_backend", "save_pretrained_dir",
]
