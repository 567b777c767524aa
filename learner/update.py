"""One learner update: filter the trajectories, accumulate gradients over micro-batches, clip, step.

    trainer = Trainer(build_policy(), TrainConfig(algorithm="grpo", lr=1e-5, kl_coef=0.01))
    metrics = trainer.step(trajectories, current_version=7)   # {"loss/policy": ..., "stale/dropped": ...}
    files = write_checkpoint(trainer.state_dict_for_checkpoint())

Algorithms: "grpo" (PPO-clip on the group-normalised sequence advantage, k3 KL to the reference in the loss),
"ppo" (the same clipped objective on per-token advantages, the KL folded into them as a reward penalty),
"sft" (NLL on successful trajectories), "dpo" (best vs worst of each group).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence, TypeVar

import torch
from torch import Tensor
from transformers import PreTrainedModel

from learner.batching import NO_VERSION, Batch, collate
from learner.checkpoint_files import (
    CheckpointState,
    OptimizerState,
    flatten_optimizer_state,
    load_model_tensors,
    model_tensors,
    unflatten_optimizer_state,
)
from learner.losses import (
    LOSS_AGGS,
    dpo_loss,
    grpo_loss,
    kl_shaped_advantages,
    loss_denominator,
    sequence_logprobs,
    sft_loss,
    token_logprobs,
)
from learner.model import autocast_context, frozen_reference, model_device, set_grad_checkpointing
from learner.pairs import PreferencePair, preference_pairs
from schemas.errors import CheckpointError, ConfigError
from schemas.records import Trajectory

ALGORITHMS = ("grpo", "ppo", "sft", "dpo")
LAG_MODES = ("drop", "downweight")
TRAINABLE_STATUSES = ("completed", "truncated")
SKIPPED_STATUSES = ("abandoned", "aborted", "error")
# (low, high, label) of the policy-lag histogram; high None means unbounded.
LAG_BUCKETS = ((0, 0, "0"), (1, 1, "1"), (2, 2, "2"), (3, 4, "3-4"), (5, 8, "5-8"), (9, None, "9+"))

Weighted = tuple[Trajectory, float]
T = TypeVar("T")


@dataclass(frozen=True)
class TrainConfig:
    algorithm: str = "grpo"
    lr: float = 1e-5
    weight_decay: float = 0.0
    grad_accum: int = 1                 # micro-batches per optimizer update
    max_grad_norm: float = 1.0
    clip_eps: float = 0.2
    clip_eps_high: float | None = None  # None: symmetric clipping
    kl_coef: float = 0.0
    beta: float = 0.1                   # DPO temperature
    loss_agg: str = "token-mean"
    temperature: float = 1.0            # must equal the rollout temperature, or the ratios are wrong
    max_policy_lag: int = 4
    lag_mode: str = "drop"
    lag_decay: float = 0.5              # downweight: weight = lag_decay ** (lag - max_policy_lag)
    max_len: int = 1024
    sft_min_reward: float = 1.0
    grad_checkpointing: bool = False
    cpu_bf16: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        problems = [message for bad, message in self._checks() if bad]
        if problems:
            raise ConfigError("invalid TrainConfig: " + "; ".join(problems))

    def _checks(self) -> list[tuple[bool, str]]:
        no_advantages = self.algorithm in ("sft", "dpo")
        return [
            (self.algorithm not in ALGORITHMS, f"algorithm={self.algorithm!r}: use one of {ALGORITHMS}"),
            (self.lag_mode not in LAG_MODES, f"lag_mode={self.lag_mode!r}: use one of {LAG_MODES}"),
            (self.loss_agg not in LOSS_AGGS, f"loss_agg={self.loss_agg!r}: use one of {LOSS_AGGS}"),
            (self.lr <= 0, "lr must be > 0, e.g. 1e-5"),
            (self.grad_accum < 1, "grad_accum is the number of micro-batches per update: set it to 1 or more"),
            (self.max_grad_norm <= 0, "max_grad_norm must be > 0; use a large value such as 1e9 to not clip"),
            (not 0 < self.clip_eps < 1, "clip_eps must be in (0, 1), e.g. 0.2"),
            (self.clip_eps_high is not None and self.clip_eps_high <= 0, "clip_eps_high must be > 0, or None"),
            (self.kl_coef < 0, "kl_coef must be >= 0"),
            (no_advantages and self.kl_coef > 0, f"{self.algorithm} has no KL term: set kl_coef=0 (dpo uses beta)"),
            (self.algorithm == "dpo" and self.beta <= 0, "dpo needs beta > 0, e.g. 0.1"),
            (no_advantages and self.lag_mode == "downweight",
             f"lag_mode='downweight' scales advantages, which {self.algorithm} has none of: set lag_mode='drop'"),
            (self.temperature <= 0, "temperature must be > 0 and equal the rollout temperature"),
            (no_advantages and self.temperature != 1.0,
             f"{self.algorithm} trains at temperature 1: set temperature=1.0"),
            (self.max_policy_lag < 0, "max_policy_lag must be >= 0"),
            (not 0 < self.lag_decay < 1, "lag_decay must be in (0, 1), e.g. 0.5"),
            (self.max_len < 2, "max_len must be >= 2 tokens"),
        ]

    @property
    def needs_reference(self) -> bool:
        return self.algorithm == "dpo" or (self.algorithm in ("grpo", "ppo") and self.kl_coef > 0)


# --- which trajectories train, and with what weight ------------------------------------------------------

@dataclass(frozen=True)
class Selection:
    kept: list[Weighted]
    counts: dict[str, float]


def policy_lag(trajectory: Trajectory, current_version: int) -> int:
    """How many versions behind the learner the oldest turn of the trajectory was generated."""
    return current_version - min(turn.policy_version for turn in trajectory.turns)


def lag_bucket(lag: int) -> str:
    for low, high, label in LAG_BUCKETS:
        if lag >= low and (high is None or lag <= high):
            return label
    return "ahead"  # negative: generated by a version newer than the learner's (e.g. after a rollback)


def skip_reason(trajectory: Trajectory, config: TrainConfig) -> str | None:
    if trajectory.status in SKIPPED_STATUSES:
        return trajectory.status
    if trajectory.status not in TRAINABLE_STATUSES:
        return "other"
    if not any(turn.tokens for turn in trajectory.turns):
        return "empty"
    # SFT imitates (rejection sampling): only what solved its task is worth copying.
    if config.algorithm == "sft" and outcome(trajectory) < config.sft_min_reward:
        return "unsuccessful"
    return None


def outcome(trajectory: Trajectory) -> float:
    """How well the task was solved: the best `outcome/*` reward component, else the total reward."""
    parts = [v for k, v in trajectory.reward_components.items() if k.startswith("outcome/")]
    return max(parts) if parts else trajectory.reward


def staleness_weight(lag: int, config: TrainConfig) -> float:
    if lag <= config.max_policy_lag:
        return 1.0
    return 0.0 if config.lag_mode == "drop" else config.lag_decay ** (lag - config.max_policy_lag)


def empty_counts() -> dict[str, float]:
    # Every key present, zero or not, so dashboards see stable series.
    keys = [f"skipped/{reason}" for reason in (*SKIPPED_STATUSES, "other", "empty", "unsuccessful")]
    keys += ["stale/dropped", "stale/downweighted", "policy_lag/ahead"]
    keys += [f"policy_lag/{label}" for _, _, label in LAG_BUCKETS]
    return {key: 0.0 for key in keys}


def select_trajectories(trajectories: Sequence[Trajectory], current_version: int, config: TrainConfig) -> Selection:
    """Drop what must not train (counted), and weight what is stale."""
    counts, kept = empty_counts(), []
    for trajectory in trajectories:
        reason = skip_reason(trajectory, config)
        if reason is not None:
            counts[f"skipped/{reason}"] += 1
            continue
        lag = policy_lag(trajectory, current_version)
        counts[f"policy_lag/{lag_bucket(lag)}"] += 1
        weight = staleness_weight(lag, config)
        counts["stale/dropped"] += float(weight == 0.0)
        counts["stale/downweighted"] += float(0.0 < weight < 1.0)
        if weight > 0.0:
            kept.append((trajectory, weight))
    return Selection(kept, counts)


def rollout_stats(kept: Sequence[Weighted]) -> dict[str, float]:
    if not kept:
        return {"batch/trajectories": 0.0}
    rewards = torch.tensor([trajectory.reward for trajectory, _ in kept], dtype=torch.float64)
    return {
        "batch/trajectories": float(len(kept)),
        "rollout/reward_mean": rewards.mean().item(),
        "rollout/reward_std": rewards.std(unbiased=False).item(),
        "rollout/advantage_mean": sum(t.advantage * w for t, w in kept) / len(kept),
    }


def split(units: Sequence[T], parts: int) -> list[list[T]]:
    """Contiguous, nearly equal chunks; never an empty one."""
    size = max(1, math.ceil(len(units) / parts))
    return [list(units[i:i + size]) for i in range(0, len(units), size)]


def pair_items(pairs: Sequence[PreferencePair]) -> list[Weighted]:
    """Chosen sequences first, then rejected ones: row i pairs with row i + N."""
    return [(pair.chosen, 1.0) for pair in pairs] + [(pair.rejected, 1.0) for pair in pairs]


def add_weighted(total: dict[str, float], part: Mapping[str, float], share: float) -> None:
    for key, value in part.items():
        total[key] = total.get(key, 0.0) + share * value


# --- the trainer ----------------------------------------------------------------------------------------

class Trainer:
    """Owns the policy, its frozen reference (when the loss needs one) and the optimizer."""

    def __init__(self, model: PreTrainedModel, config: TrainConfig, reference: PreTrainedModel | None = None) -> None:
        torch.manual_seed(config.seed)  # nothing here samples, but a model with dropout draws from it
        self.model, self.config = model, config
        set_grad_checkpointing(model, config.grad_checkpointing)
        # On resume pass the base model as `reference`: a copy of the restored policy would move the anchor.
        if reference is None and config.needs_reference:
            reference = frozen_reference(model)
        self.reference = reference
        self.named_params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        params = [p for _, p in self.named_params]
        self.optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
        self.device = model_device(model)
        self.step_count = 0

    def step(self, trajectories: Sequence[Trajectory], current_version: int) -> dict[str, float]:
        """One optimizer update on these trajectories; returns namespaced metrics."""
        selection = select_trajectories(trajectories, current_version, self.config)
        metrics = {**selection.counts, **rollout_stats(selection.kept)}
        batches, pairing = self.micro_batches(selection.kept)
        metrics.update(pairing)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        metrics.update(self.accumulate(batches, current_version))
        if metrics.get("tokens/trained", 0.0) == 0.0:
            return {**metrics, "train/updated": 0.0, "train/step": float(self.step_count)}
        metrics.update(self.apply_gradients())
        return metrics

    def micro_batches(self, kept: Sequence[Weighted]) -> tuple[list[Batch], dict[str, float]]:
        """grad_accum padded batches (and pairing counts); DPO batches hold chosen rows, then rejected rows."""
        if self.config.algorithm != "dpo":
            return [collate(chunk, self.config.max_len) for chunk in split(kept, self.config.grad_accum)], {}
        pairs, skipped = preference_pairs(trajectory for trajectory, _ in kept)
        chunks = split(pairs, self.config.grad_accum)
        counts = {"pairs/built": float(len(pairs)), "pairs/skipped_groups": float(skipped)}
        return [collate(pair_items(chunk), self.config.max_len) for chunk in chunks], counts

    def accumulate(self, batches: Sequence[Batch], current_version: int) -> dict[str, float]:
        """Backward over every micro-batch, each scaled by its share of the loss denominator, so the summed
        gradient equals that of the whole batch in one piece."""
        sizes = [self.denominator(batch) for batch in batches]
        metrics = token_stats(batches, current_version)
        for batch, size in zip(batches, sizes):
            if size == 0:
                continue
            share = size / sum(sizes)  # the micro-batch's part of the whole batch's mean
            loss, parts = self.loss(batch.to(self.device))
            (loss * share).backward()
            add_weighted(metrics, parts, share)
        return metrics

    def denominator(self, batch: Batch) -> float:
        if self.config.algorithm == "dpo":
            return float(batch.input_ids.shape[0] // 2)
        agg = "token-mean" if self.config.algorithm == "sft" else self.config.loss_agg
        return loss_denominator(batch.loss_mask, agg)

    def loss(self, batch: Batch) -> tuple[Tensor, dict[str, float]]:
        """The loss of one micro-batch (already on the device) and its metrics."""
        with autocast_context(self.device, self.config.cpu_bf16):
            logprobs = token_logprobs(self.model, batch.input_ids, batch.attention_mask, self.config.temperature)
            ref_logprobs = self.reference_logprobs(batch)                                     # (B, T-1) | None
        if self.config.algorithm == "sft":
            return sft_loss(logprobs, batch.loss_mask)
        if self.config.algorithm == "dpo":
            assert ref_logprobs is not None, "dpo always has a reference"
            return self.dpo(logprobs, ref_logprobs, batch.loss_mask)
        return self.policy_gradient(logprobs, ref_logprobs, batch)

    @torch.no_grad()
    def reference_logprobs(self, batch: Batch) -> Tensor | None:
        if self.reference is None:
            return None
        return token_logprobs(self.reference, batch.input_ids, batch.attention_mask, self.config.temperature)

    def policy_gradient(
        self, logprobs: Tensor, ref_logprobs: Tensor | None, batch: Batch
    ) -> tuple[Tensor, dict[str, float]]:
        cfg, advantages, kl_coef = self.config, batch.advantages, self.config.kl_coef                # (B, T-1)
        if cfg.algorithm == "ppo" and ref_logprobs is not None:
            # PPO puts the KL in the reward; the loss still reports it (kl_coef 0 there).
            advantages = kl_shaped_advantages(advantages, batch.old_logprobs, ref_logprobs, batch.loss_mask, kl_coef)
            kl_coef = 0.0
        return grpo_loss(
            logprobs, batch.old_logprobs, advantages, batch.loss_mask,
            clip_eps=cfg.clip_eps, clip_eps_high=cfg.clip_eps_high, kl_coef=kl_coef,
            ref_logprobs=ref_logprobs, loss_agg=cfg.loss_agg,
        )

    def dpo(self, logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor) -> tuple[Tensor, dict[str, float]]:
        policy = sequence_logprobs(logprobs, mask)                                                  # (2N,)
        ref = sequence_logprobs(ref_logprobs, mask)                                                 # (2N,)
        n = policy.shape[0] // 2
        return dpo_loss(policy[:n], policy[n:], ref[:n], ref[n:], self.config.beta)

    def apply_gradients(self) -> dict[str, float]:
        """Clip and step; a non-finite gradient skips the update (counted) instead of poisoning the weights."""
        params = [p for _, p in self.named_params]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm))
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            return {"stats/grad_norm": grad_norm, "train/updated": 0.0, "train/nonfinite_grad": 1.0,
                    "train/step": float(self.step_count)}
        self.optimizer.step()
        self.step_count += 1
        return {"stats/grad_norm": grad_norm, "stats/lr": self.optimizer.param_groups[0]["lr"],
                "train/updated": 1.0, "train/nonfinite_grad": 0.0, "train/step": float(self.step_count)}

    # --- checkpoint state: flat tensors + JSON, never pickle -----------------------------------------------

    def state_dict_for_checkpoint(self) -> CheckpointState:
        optimizer = flatten_optimizer_state(self.optimizer.state_dict())
        optimizer.meta["param_names"] = [name for name, _ in self.named_params]
        return CheckpointState(
            model=model_tensors(self.model),
            model_config=json.loads(self.model.config.to_json_string(use_diff=False)),
            optimizer=optimizer,
            trainer={"step": self.step_count, "algorithm": self.config.algorithm, "config": asdict(self.config)},
        )

    def load_checkpoint_state(
        self,
        model_state: Mapping[str, Tensor],
        optim_state: OptimizerState,
        trainer_state: Mapping[str, Any] | None = None,
    ) -> None:
        """Restore weights, optimizer moments and the step count written by `state_dict_for_checkpoint`."""
        names = [name for name, _ in self.named_params]
        if optim_state.meta.get("param_names", names) != names:
            raise CheckpointError("optimizer state was written for other parameters; build the same model to resume")
        load_model_tensors(self.model, model_state)
        self.optimizer.load_state_dict(unflatten_optimizer_state(optim_state))
        if trainer_state is not None:
            self.step_count = int(trainer_state["step"])


def token_stats(batches: Sequence[Batch], current_version: int) -> dict[str, float]:
    """Token counts, truncations and the token-weighted policy lag of what this update trains on."""
    trained = sum(float(batch.loss_mask.sum()) for batch in batches)
    lag_sum = sum(float(((current_version - b.versions) * (b.versions != NO_VERSION)).sum()) for b in batches)
    return {
        "tokens/total": float(sum(batch.num_tokens for batch in batches)),
        "tokens/trained": trained,
        "batch/sequences": float(sum(batch.input_ids.shape[0] for batch in batches)),
        "batch/truncated": float(sum(batch.truncated for batch in batches)),
        "policy_lag/token_mean": lag_sum / trained if trained else 0.0,
    }
