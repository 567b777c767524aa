"""Settings of the learner service, from the command line; bad combinations are refused with the fix."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from infra.settings import cache_dir
from schemas.errors import ConfigError
from schemas.topics import Topics


@dataclass(frozen=True)
class LearnerSettings:
    ns: str
    algorithm: str = "grpo"
    sft_updates: int = 0  # warm start: this many SFT updates before `algorithm`
    lr: float = 1e-4
    updates_per_checkpoint: int = 2
    max_updates: int | None = None
    idle_exit_s: float | None = None  # stop after this long without data (None: wait forever)
    max_policy_lag: int = 4
    lag_mode: str = "drop"
    temperature: float = 1.0
    kl_coef: float = 0.0
    clip_eps: float = 0.2
    grad_accum: int = 1
    max_len: int = 2048
    layers: int = 4
    width: int = 256
    model_dir: str | None = None
    seed: int = 0
    prefetch: int = 2
    cache_dir: str = str(cache_dir() / "shards")
    cache_bytes: int = 2 << 30
    grad_checkpointing: bool = False

    def __post_init__(self) -> None:
        Topics(self.ns)
        checks = [
            (self.updates_per_checkpoint >= 1, "--updates-per-checkpoint must be >= 1"),
            (self.max_updates is None or self.max_updates >= 1, "--max-updates must be >= 1 (or omit it)"),
            (self.sft_updates >= 0, "--sft-updates must be >= 0"),
            (self.algorithm in ("grpo", "ppo", "sft", "dpo"), f"--algorithm {self.algorithm!r}: grpo, ppo, sft or dpo"),
            (self.lr > 0, "--lr must be > 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    @property
    def topics(self) -> Topics:
        return Topics(self.ns)

    @property
    def group(self) -> str:
        return f"{self.ns}.learner"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m learner", description="Train on scored batches, publish checkpoints.")
    p.add_argument("--ns", default=os.environ.get("TRAJPIPE_NS"))
    p.add_argument("--algorithm", default="grpo")
    p.add_argument("--sft-updates", type=int, default=0, help="SFT warm-start updates before --algorithm")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--updates-per-checkpoint", type=int, default=2)
    p.add_argument("--max-updates", type=int, default=None)
    p.add_argument("--idle-exit", type=float, default=None, help="stop after S seconds without a batch")
    p.add_argument("--max-policy-lag", type=int, default=4)
    p.add_argument("--lag-mode", default="drop", choices=["drop", "downweight"])
    p.add_argument("--temperature", type=float, default=1.0, help="the rollout temperature (for the ratios)")
    p.add_argument("--kl-coef", type=float, default=0.0)
    p.add_argument("--clip-eps", type=float, default=0.2)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--model-dir", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--cache-dir", default=str(cache_dir() / "shards"))
    p.add_argument("--grad-checkpointing", action="store_true")
    return p


def from_args(argv: list[str] | None = None) -> LearnerSettings:
    a = parser().parse_args(argv)
    if not a.ns:
        raise ConfigError("--ns is required (or set TRAJPIPE_NS)")
    return LearnerSettings(
        ns=a.ns, algorithm=a.algorithm, sft_updates=a.sft_updates, lr=a.lr,
        updates_per_checkpoint=a.updates_per_checkpoint, max_updates=a.max_updates, idle_exit_s=a.idle_exit,
        max_policy_lag=a.max_policy_lag, lag_mode=a.lag_mode, temperature=a.temperature, kl_coef=a.kl_coef,
        clip_eps=a.clip_eps, grad_accum=a.grad_accum, max_len=a.max_len, layers=a.layers, width=a.width,
        model_dir=a.model_dir, seed=a.seed, prefetch=a.prefetch, cache_dir=str(Path(a.cache_dir)),
        grad_checkpointing=a.grad_checkpointing,
    )
