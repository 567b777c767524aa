"""The learner on a tiny model: batching, one update per algorithm, learning on toy tasks, staleness, checkpoints."""
from __future__ import annotations

import dataclasses
import math
import uuid
from pathlib import Path
from typing import Sequence

import pytest
import torch
from safetensors.torch import load as load_safetensors
from transformers import AutoModelForCausalLM, PreTrainedModel

from learner.batching import NO_VERSION, collate, flatten
from learner.checkpoint_files import (
    BROADCAST_FILE,
    CHECKPOINT_FILES,
    file_entries,
    read_checkpoint,
    read_dir,
    verify_files,
    write_checkpoint,
    write_dir,
)
from learner.losses import token_logprobs
from learner.model import build_policy, frozen_reference
from learner.pairs import preference_pairs
from learner.checkpoint_store import prunable
from learner.update import Lineage, Trainer, TrainConfig, policy_lag, select_trajectories
from schemas.errors import CheckpointError, ConfigError, IntegrityError, ValidationError
from schemas.manifests import CheckpointManifest
from schemas.models import EOS_ID, PAD_ID
from schemas.packing import pack_floats, pack_ids
from schemas.records import DEMONSTRATION_VERSION, Trajectory, TrajectoryTurn

Turn = tuple[list[int], list[int], list[float], int]  # observation ids, generated ids, behaviour log-probs, version


def byte_ids(text: str) -> list[int]:
    return [b + 3 for b in text.encode()]  # ByT5: byte b is id b + 3


def make_trajectory(
    prompt: list[int], turns: Sequence[Turn], reward: float = 0.0, advantage: float = 0.0,
    group: str = "g0", status: str = "completed",
) -> Trajectory:
    packed = tuple(
        TrajectoryTurn(turn=i, policy_version=version, obs_text="", obs_tokens=pack_ids(obs), text="",
                       tokens=pack_ids(gen), logprobs=pack_floats(lps), finish_reason="stop")
        for i, (obs, gen, lps, version) in enumerate(turns)
    )
    return Trajectory(
        trajectory_id=uuid.uuid4().hex, episode_id=uuid.uuid4().hex, group_id=group, task_id="t", domain="math",
        run="test", status=status, task_spec="", prompt_text="", prompt_tokens=pack_ids(prompt), turns=packed,
        reward=reward, reward_components={}, reward_fn="exact", reward_version="1", advantage=advantage,
        group_reward_mean=0.0, group_reward_std=0.0, source_topic="t", source_offsets=(), started_ts=0, ended_ts=0,
    )


def tiny_model(seed: int = 0) -> PreTrainedModel:
    return build_policy(layers=2, width=64, heads=4, seed=seed)


@torch.no_grad()
def sample(model: torch.nn.Module, prompt: list[int], n: int, new_tokens: int, temperature: float = 1.0,
           generator: torch.Generator | None = None) -> tuple[list[list[int]], list[list[float]]]:
    """n samples from the policy with the log-prob of each sampled token at `temperature` (as workers record)."""
    ids = torch.tensor([prompt] * n)                                               # (n, P)
    logprobs = []
    for _ in range(new_tokens):
        logits = model(input_ids=ids).logits[:, -1].float() / temperature         # (n, V)
        dist = torch.log_softmax(logits, -1)
        token = torch.multinomial(dist.exp(), 1, generator=generator)             # (n, 1)
        logprobs.append(dist.gather(-1, token))
        ids = torch.cat([ids, token], dim=1)
    return ids[:, len(prompt):].tolist(), torch.cat(logprobs, dim=1).tolist()


def group_advantages(rewards: list[float]) -> list[float]:
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    return [(r - mean) / (std + 1e-6) for r in rewards]


def on_policy_group(model: torch.nn.Module, prompt: list[int], group: str, version: int = 0,
                    rewards: Sequence[float] = (1.0, 0.0, 0.5, 0.0)) -> list[Trajectory]:
    gens, lps = sample(model, prompt, len(rewards), new_tokens=3, generator=torch.Generator().manual_seed(1))
    advs = group_advantages(list(rewards))
    return [make_trajectory(prompt, [([], g, lp, version)], r, a, group)
            for g, lp, r, a in zip(gens, lps, rewards, advs)]


# --- batching -------------------------------------------------------------------------------------------

def test_collate_masks_prompt_and_observations_and_aligns_logprobs() -> None:
    traj = make_trajectory([10, 11], [([], [20, 21], [-0.1, -0.2], 3), ([30, 31, 32], [40], [-0.4], 4)], advantage=2.0)
    short = make_trajectory([10], [([], [50], [-0.5], 4)], advantage=-1.0)
    batch = collate([(traj, 1.0), (short, 0.5)], max_len=64)
    assert batch.input_ids.tolist() == [[10, 11, 20, 21, 30, 31, 32, 40], [10, 50] + [PAD_ID] * 6]
    assert batch.attention_mask.tolist() == [[1] * 8, [1, 1] + [0] * 6]
    # Targets are input_ids[:, 1:] = 11 20 21 30 31 32 40: only 20, 21 and 40 were generated.
    assert batch.loss_mask.tolist() == [[0, 1, 1, 0, 0, 0, 1], [1, 0, 0, 0, 0, 0, 0]]
    assert batch.old_logprobs[0].tolist() == pytest.approx([0, -0.1, -0.2, 0, 0, 0, -0.4])
    assert batch.versions[0].tolist() == [NO_VERSION, 3, 3, NO_VERSION, NO_VERSION, NO_VERSION, 4]
    assert batch.advantages.tolist() == [[0, 2, 2, 0, 0, 0, 2], [-0.5, 0, 0, 0, 0, 0, 0]]
    assert batch.truncated == 0 and batch.num_tokens == 10


def test_collate_truncates_at_max_len_and_counts_it() -> None:
    traj = make_trajectory([10, 11], [([], [20, 21, 22, 23], [-0.1] * 4, 0)])
    batch = collate([(traj, 1.0)], max_len=4)
    assert batch.input_ids.tolist() == [[10, 11, 20, 21]]
    assert batch.loss_mask.tolist() == [[0, 1, 1]]
    assert batch.truncated == 1


def test_tokens_without_logprobs_are_rejected() -> None:
    traj = make_trajectory([10], [([], [20, 21], [-0.1], 0)])
    with pytest.raises(ValidationError, match="length_mismatch"):
        flatten(traj)


def test_observation_and_behaviour_values_off_the_mask_do_not_change_the_loss() -> None:
    model = tiny_model()
    trainer = Trainer(model, TrainConfig(algorithm="grpo", kl_coef=0.1))
    traj = make_trajectory([10, 11], [([], [20, 21], [-5.0, -5.5], 0), ([30, 31], [40], [-6.0], 0)], advantage=1.0)
    batch = collate([(traj, 1.0)], max_len=64)
    base, _ = trainer.loss(batch)
    off = batch.loss_mask == 0
    noisy = dataclasses.replace(batch, old_logprobs=batch.old_logprobs.masked_fill(off, 40.0))
    assert trainer.loss(noisy)[0].item() == base.item()
    # Another tool output changes the context of the last token, so only the mask is compared there.
    other = make_trajectory([10, 11], [([], [20, 21], [-5.0, -5.5], 0), ([99, 98], [40], [-6.0], 0)], advantage=1.0)
    assert collate([(other, 1.0)], 64).loss_mask.tolist() == batch.loss_mask.tolist()


# --- configuration ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "fix"), [
    ({"algorithm": "a2c"}, "use one of"),
    ({"algorithm": "sft", "kl_coef": 0.1}, "set kl_coef=0"),
    ({"algorithm": "dpo", "lag_mode": "downweight"}, "set lag_mode='drop'"),
    ({"algorithm": "sft", "temperature": 0.7}, "set temperature=1.0"),
    ({"grad_accum": 0}, "set it to 1 or more"),
    ({"micro_batch_tokens": -1}, "0 (off) or more"),
    ({"clip_eps": 1.5}, "clip_eps must be in (0, 1)"),
    ({"lag_mode": "ignore"}, "use one of"),
])
def test_invalid_configs_say_the_fix(kwargs: dict[str, object], fix: str) -> None:
    with pytest.raises(ConfigError, match=fix.replace("(", r"\(").replace(")", r"\)")):
        TrainConfig(**kwargs)  # type: ignore[arg-type]


# --- staleness and status filtering ---------------------------------------------------------------------

def _versioned(version: int, status: str = "completed", reward: float = 1.0) -> Trajectory:
    return make_trajectory([10], [([], [20], [-1.0], version + 1), ([], [21], [-1.0], version)],
                           reward=reward, advantage=1.0, status=status)


def test_stale_trajectories_are_dropped_and_counted() -> None:
    trajs = [_versioned(10), _versioned(8), _versioned(7), _versioned(2)]   # lags 0, 2, 3, 8 (oldest turn)
    sel = select_trajectories(trajs, current_version=10, config=TrainConfig(max_policy_lag=2))
    assert [t for t, _ in sel.kept] == trajs[:2]
    assert sel.counts["stale/dropped"] == 2 and sel.counts["stale/downweighted"] == 0
    assert (sel.counts["policy_lag/0"], sel.counts["policy_lag/2"], sel.counts["policy_lag/3-4"],
            sel.counts["policy_lag/5-8"]) == (1, 1, 1, 1)


def test_stale_trajectories_are_downweighted_and_counted() -> None:
    trajs = [_versioned(10), _versioned(7), _versioned(6)]                    # lags 0, 3, 4
    config = TrainConfig(max_policy_lag=2, lag_mode="downweight", lag_decay=0.5)
    sel = select_trajectories(trajs, current_version=10, config=config)
    assert [w for _, w in sel.kept] == [1.0, 0.5, 0.25]
    assert sel.counts["stale/downweighted"] == 2 and sel.counts["stale/dropped"] == 0
    batch = collate(sel.kept, max_len=64)
    assert batch.advantages.sum(-1).tolist() == [2.0, 1.0, 0.5]              # 2 generated tokens, advantage 1


def _of_run(run: str, *versions: int) -> Trajectory:
    turns = [([], [20 + i], [-1.0], v) for i, v in enumerate(versions)]
    return dataclasses.replace(make_trajectory([10], turns, reward=1.0, advantage=1.0), run=run)


# "retrain" started from src:v5 (--init), and src itself started from root:v4; the learner is at v3
RETRAIN = Lineage(run="retrain", ancestors=(("src", 5), ("root", 4)))


@pytest.mark.parametrize("run, versions, lag", [
    ("retrain", (1, 2), 2),     # its own turns: 3 - 1
    ("src", (5,), 3),           # the checkpoint it started from: 3 updates since
    ("src", (2, 5), 6),         # 3 versions before it on src's path, then 3 updates: the oldest turn decides
    ("src", (7,), 5),           # a branch the retrain never took: v7 is 2 past v5 on src, v3 is 3 past it here
    ("root", (4,), 8),          # src's own origin: 3 here + 5 on src + 0
    ("root", (1,), 11),
])
def test_policy_lag_is_measured_along_the_lineage_never_negative(run: str, versions: tuple[int, ...], lag: int) -> None:
    assert policy_lag(_of_run(run, *versions), 3, RETRAIN) == lag


def test_turns_of_a_run_outside_the_lineage_train_offline_only_and_are_counted() -> None:
    # A learner at v0 on replayed history whose turns say v6: before lineage, a lag of -6 weighted 1 (GRPO
    # ratios against a policy this learner never was)
    history = [_of_run("src", 6), _of_run("src", 9)]
    fresh = Lineage(run="retrain")
    assert policy_lag(history[0], 0, fresh) is None
    sel = select_trajectories(history, current_version=0, config=TrainConfig(), lineage=fresh)
    assert sel.kept == [] and sel.counts["skipped/foreign"] == 2 and sel.counts["policy_lag/ahead"] == 0
    assert all("--init src:vK" in why for why in sel.dropped.values())
    sft = select_trajectories(history, current_version=0, config=TrainConfig(algorithm="sft"), lineage=fresh)
    assert len(sft.kept) == 2 and sft.counts["policy_lag/foreign"] == 2 and sft.counts["skipped/foreign"] == 0
    # --init src:v6: v6's turn is the learner's v0 (lag 0); v9's is 3 versions away on a branch it never took
    named = select_trajectories(history, 0, TrainConfig(max_policy_lag=2), Lineage("retrain", ancestors=(("src", 6),)))
    assert [t for t, _ in named.kept] == history[:1]
    assert (named.counts["policy_lag/0"], named.counts["policy_lag/3-4"], named.counts["stale/dropped"]) == (1, 1, 1)


def test_a_rebuild_counts_the_source_runs_versions_as_its_own() -> None:
    rebuild = Lineage(run="copy", replicates=("src",))
    assert policy_lag(_of_run("src", 4), 6, rebuild) == 2 and policy_lag(_of_run("other", 4), 6, rebuild) is None


def test_unfinished_episodes_are_skipped_and_sft_keeps_only_successes() -> None:
    trajs = [_versioned(0, "abandoned"), _versioned(0, "aborted"), _versioned(0, "error"),
             _versioned(0, "truncated"), _versioned(0, "completed", reward=0.2), _versioned(0, "completed")]
    grpo = select_trajectories(trajs, 0, TrainConfig())
    assert len(grpo.kept) == 3
    assert (grpo.counts["skipped/abandoned"], grpo.counts["skipped/aborted"], grpo.counts["skipped/error"]) == (1, 1, 1)
    sft = select_trajectories(trajs, 0, TrainConfig(algorithm="sft", sft_min_reward=1.0))
    # rejection sampling keeps what solved its task, truncated or not; the 0.2 one did not
    assert [t for t, _ in sft.kept] == [trajs[3], trajs[5]]
    assert sft.counts["skipped/unsuccessful"] == 1
    penalised = dataclasses.replace(trajs[5], reward=0.5, reward_components={"outcome/correct": 1.0,
                                                                               "penalty/truncated": 1.0})
    failed = dataclasses.replace(trajs[5], reward=0.1, reward_components={"outcome/correct": 0.0})
    sft = select_trajectories([penalised, failed], 0, TrainConfig(algorithm="sft", sft_min_reward=1.0))
    assert [t for t, _ in sft.kept] == [penalised]


def test_a_step_with_nothing_to_train_does_not_update() -> None:
    model = tiny_model()
    trainer = Trainer(model, TrainConfig(max_policy_lag=1))
    before = [p.detach().clone() for p in model.parameters()]
    metrics = trainer.step([_versioned(0), _versioned(0, "error")], current_version=5)
    assert metrics["train/updated"] == 0.0 and metrics["stale/dropped"] == 1 and metrics["skipped/error"] == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


# --- one update per algorithm ----------------------------------------------------------------------------

def _batch_for(model: torch.nn.Module) -> list[Trajectory]:
    groups = [on_policy_group(model, byte_ids(p), f"g{i}") for i, p in enumerate(["a=", "bb=", "c+c="])]
    return [t for group in groups for t in group]


@pytest.mark.parametrize(("algorithm", "extra"), [
    ("grpo", {"kl_coef": 0.05}), ("ppo", {"kl_coef": 0.05}), ("sft", {"sft_min_reward": 0.5}), ("dpo", {}),
])
def test_one_update_changes_every_parameter(algorithm: str, extra: dict[str, float]) -> None:
    model = tiny_model()
    trainer = Trainer(model, TrainConfig(algorithm=algorithm, lr=1e-3, grad_accum=2, **extra))  # type: ignore[arg-type]
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    metrics = trainer.step(_batch_for(model), current_version=0)
    assert metrics["train/updated"] == 1.0
    assert math.isfinite(metrics["loss/total"]) and metrics["stats/grad_norm"] > 0
    unchanged = [name for name, p in model.named_parameters() if torch.equal(before[name], p)]
    assert unchanged == []
    if trainer.reference is not None:  # the reference stays where it was
        assert all(torch.equal(before[n], p) for n, p in trainer.reference.named_parameters())


def test_metrics_are_namespaced() -> None:
    model = tiny_model()
    metrics = Trainer(model, TrainConfig(kl_coef=0.05)).step(_batch_for(model), current_version=0)
    for key in ("loss/policy", "loss/kl", "loss/total", "stats/clip_frac", "stats/grad_norm", "stats/approx_kl",
                "rollout/reward_mean", "policy_lag/0", "stale/dropped", "tokens/trained", "tokens/total"):
        assert key in metrics, key
    assert all("/" in key for key in metrics)
    assert metrics["rollout/reward_mean"] == pytest.approx(0.375)
    assert metrics["stats/clip_frac"] == 0.0   # on-policy: ratio 1


def test_gradient_accumulation_equals_the_whole_batch() -> None:
    grads = []
    for accum in (1, 3):
        model = tiny_model()
        trainer = Trainer(model, TrainConfig(kl_coef=0.05, grad_accum=accum, loss_agg="token-mean"))
        trajs = _batch_for(model)
        batches, _ = trainer.micro_batches([(t, 1.0) for t in trajs])
        trainer.accumulate(batches)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6, rtol=1e-4)


def test_a_token_budget_splits_micro_batches_within_it_and_keeps_the_gradient() -> None:
    grads, shapes = [], []
    for budget in (0, 40):
        model = tiny_model()
        trainer = Trainer(model, TrainConfig(kl_coef=0.05, micro_batch_tokens=budget, loss_agg="token-mean"))
        batches, _ = trainer.micro_batches([(t, 1.0) for t in _batch_for(model)])
        shapes.append([tuple(b.input_ids.shape) for b in batches])
        trainer.accumulate(batches)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert len(shapes[0]) == 1 and len(shapes[1]) > 1, shapes
    assert all(rows * width <= 40 or rows == 1 for rows, width in shapes[1]), shapes
    assert sum(rows for rows, _ in shapes[1]) == shapes[0][0][0]  # every trajectory, once
    assert torch.allclose(grads[0], grads[1], atol=1e-6, rtol=1e-4)


def test_gradient_checkpointing_gives_the_same_gradients() -> None:
    grads = []
    for checkpointing in (False, True):
        model = tiny_model()
        trainer = Trainer(model, TrainConfig(grad_checkpointing=checkpointing))
        batches, _ = trainer.micro_batches([(t, 1.0) for t in _batch_for(model)])
        trainer.accumulate(batches)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


def test_cpu_bf16_autocast_keeps_the_loss_finite() -> None:
    model = tiny_model()
    trainer = Trainer(model, TrainConfig(kl_coef=0.05, cpu_bf16=True))
    batches, _ = trainer.micro_batches([(t, 1.0) for t in _batch_for(model)])
    loss, _ = trainer.loss(batches[0])
    assert loss.dtype == torch.float32 and math.isfinite(loss.item())


# --- learning on toy tasks -------------------------------------------------------------------------------

DIGITS = byte_ids("0123456789")
PICK = byte_ids("Pick a digit:")


def test_sft_drives_the_loss_down() -> None:
    model = tiny_model()
    trainer = Trainer(model, TrainConfig(algorithm="sft", lr=3e-3, sft_min_reward=1.0))
    answer = byte_ids("hello") + [EOS_ID]
    data = [make_trajectory(byte_ids(p), [([], answer, [0.0] * len(answer), 0)], reward=1.0) for p in ("hi:", "yo:")]
    losses = [trainer.step(data, current_version=0)["loss/sft"] for _ in range(25)]
    assert losses[-1] < 0.25 * losses[0]


def test_an_sft_update_counts_the_demonstrations_greedy_decoding_already_writes_before_it_trains() -> None:
    """sft/greedy_match: the share of an SFT update's sequences the policy, before the update, decodes greedily token
    for token (what `generate` writes without sampling), over micro-batches and with sequences of other lengths; in
    all and per task source (here the domain: these specs name none)."""
    model = tiny_model(seed=3)
    prompts = [byte_ids(p) for p in ("ab:", "cde:", "f:", "ghij:")]
    demos = []
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=4 + i, pad_token_id=PAD_ID)
        greedy = out[0, len(prompt):].tolist()
        if i % 2:  # every other one differs from greedy decoding in its last token only
            greedy[-1] = DIGITS[0] if greedy[-1] != DIGITS[0] else DIGITS[1]
        demo = make_trajectory(prompt, [([], greedy, [0.0] * len(greedy), DEMONSTRATION_VERSION)], reward=1.0)
        demos.append(dataclasses.replace(demo, domain="short" if i == 0 else "long"))
    trainer = Trainer(model, TrainConfig(algorithm="sft", lr=1e-3, micro_batch_tokens=20))
    metrics = trainer.step(demos, current_version=0)
    assert metrics["batch/sequences"] == 4 and metrics["sft/greedy_match"] == 0.5
    assert metrics["sft/greedy_match/short"] == 1.0 and metrics["sft/greedy_match/long"] == pytest.approx(1 / 3)
    assert (metrics["sft/greedy_rows/short"], metrics["sft/greedy_rows/long"]) == (1.0, 3.0)
    assert not [k for k in metrics if k.startswith("sft/greedy_reproduced")]
    grpo = Trainer(tiny_model(), TrainConfig(algorithm="grpo", lr=1e-3)).step(_batch_for(tiny_model()), 0)
    assert "sft/greedy_match" not in grpo  # a figure of imitation only


def _warm_start_on_digits(model: PreTrainedModel) -> None:
    """SFT on every digit equally: the policy then says a uniformly random digit (reward 0.1 on average)."""
    sft = Trainer(model, TrainConfig(algorithm="sft", lr=1e-2))
    data = [make_trajectory(PICK, [([], [d, EOS_ID], [0.0, 0.0], 0)], reward=1.0) for d in DIGITS]
    for _ in range(30):
        sft.step(data, current_version=0)


def _seven_rate(model: torch.nn.Module, generator: torch.Generator) -> float:
    gens, _ = sample(model, PICK, 64, new_tokens=1, generator=generator)
    return sum(g[0] == byte_ids("7")[0] for g in gens) / len(gens)


def test_grpo_raises_the_mean_reward_on_a_verifiable_task() -> None:
    """"Say 7": reward 1 for the digit 7. Workers sample and record log-probs; rewards and group-normalised
    advantages are computed here, as the streams service would; the policy version advances every step."""
    torch.manual_seed(0)
    model = tiny_model()
    _warm_start_on_digits(model)
    generator = torch.Generator().manual_seed(0)
    start = _seven_rate(model, generator)
    trainer = Trainer(model, TrainConfig(algorithm="grpo", lr=3e-3, max_policy_lag=1))
    seven = byte_ids("7")[0]
    for version in range(15):
        gens, lps = sample(model, PICK, 32, new_tokens=2, generator=generator)   # 4 groups of 8, one batch
        rewards = [float(g[0] == seven) for g in gens]
        trajs = []
        for first in range(0, 32, 8):
            rows = range(first, first + 8)
            advs = group_advantages([rewards[i] for i in rows])
            trajs += [make_trajectory(PICK, [([], gens[i], lps[i], version)], rewards[i], a, f"{version}-{first}")
                      for i, a in zip(rows, advs)]
        trainer.step(trajs, current_version=version)
    end = _seven_rate(model, generator)
    assert start < 0.3 and end > start + 0.4, (start, end)


# --- preference pairs -------------------------------------------------------------------------------------

def test_pairs_take_best_and_worst_and_skip_ties() -> None:
    a = [make_trajectory([10], [([], [20], [-1.0], 0)], reward=r, group="a") for r in (0.5, 1.0, 0.0)]
    tie = [make_trajectory([10], [([], [20], [-1.0], 0)], reward=1.0, group="tie") for _ in range(3)]
    alone = [make_trajectory([10], [([], [20], [-1.0], 0)], reward=1.0, group="alone")]
    pairs, skipped = preference_pairs(a + tie + alone)
    assert len(pairs) == 1 and skipped == 2
    assert (pairs[0].chosen, pairs[0].rejected, pairs[0].margin) == (a[1], a[2], 1.0)


# --- checkpoints -----------------------------------------------------------------------------------------

def _trained() -> tuple[Trainer, list[Trajectory]]:
    model = tiny_model()
    trainer = Trainer(model, TrainConfig(lr=1e-3, kl_coef=0.05))
    trajs = _batch_for(model)
    trainer.step(trajs, current_version=0)
    return trainer, trajs


def test_checkpoint_loads_with_from_pretrained_and_gives_identical_logits(tmp_path: Path) -> None:
    trainer, _ = _trained()
    files = write_checkpoint(trainer.state_dict_for_checkpoint())
    assert set(files) == set(CHECKPOINT_FILES) - {BROADCAST_FILE}  # the bfloat16 copy only when asked
    loaded = AutoModelForCausalLM.from_pretrained(write_dir(files, tmp_path), local_files_only=True)
    ids = torch.tensor([byte_ids("checkpoint?")])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, trainer.model(input_ids=ids).logits)
    assert read_dir(tmp_path) == files


def test_a_bf16_broadcast_carries_the_weights_rounded_to_nearest_in_half_the_bytes(tmp_path: Path) -> None:
    trainer, _ = _trained()
    files = write_checkpoint(trainer.state_dict_for_checkpoint(), broadcast_bf16=True)
    assert set(files) == set(CHECKPOINT_FILES)
    full, half = load_safetensors(files["model.safetensors"]), load_safetensors(files[BROADCAST_FILE])
    assert set(half) == set(full) and all(t.dtype == torch.bfloat16 for t in half.values())
    for name, weights in full.items():
        assert torch.equal(half[name], weights.to(torch.bfloat16))
        # round to nearest: no weight moves more than half a bfloat16 step (2**-8 of its magnitude)
        assert torch.all((half[name].float() - weights).abs() <= weights.abs() * 2.0 ** -8 + 1e-30)
    assert len(files[BROADCAST_FILE]) < 0.52 * len(files["model.safetensors"])
    # the directory still loads as the float32 model it was (from_pretrained reads model.safetensors)
    loaded = AutoModelForCausalLM.from_pretrained(write_dir(files, tmp_path), local_files_only=True)
    assert loaded.dtype == torch.float32
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in full.items())
    assert read_checkpoint(files).model.keys() == full.keys()


def test_checkpoint_resume_continues_exactly() -> None:
    trainer, trajs = _trained()
    state = read_checkpoint(write_checkpoint(trainer.state_dict_for_checkpoint()))
    resumed = Trainer(tiny_model(seed=1), TrainConfig(lr=1e-3, kl_coef=0.05), reference=trainer.reference)
    resumed.load_checkpoint_state(state.model, state.moments(), state.trainer)
    assert resumed.step_count == 1
    a, b = trainer.step(trajs, current_version=1), resumed.step(trajs, current_version=1)
    assert a["loss/total"] == b["loss/total"]
    assert all(torch.equal(p, q) for p, q in zip(trainer.model.parameters(), resumed.model.parameters()))


def test_checkpoint_files_carry_sha256_for_the_manifest() -> None:
    trainer, _ = _trained()
    files = write_checkpoint(trainer.state_dict_for_checkpoint())
    entries = file_entries(files)
    manifest = CheckpointManifest(run="r", version=1, step=1, algorithm="grpo", files=entries, offsets={0: 5},
                                  batch_ids=["b"], model_config=read_checkpoint(files).model_config)
    verify_files(files, CheckpointManifest.from_json(manifest.to_json()).files)
    tampered = {**files, "model.safetensors": files["model.safetensors"][:-1] + b"\0"}
    with pytest.raises(IntegrityError):
        verify_files(tampered, entries)


def test_checkpoint_of_another_model_is_refused() -> None:
    trainer, _ = _trained()
    state = read_checkpoint(write_checkpoint(trainer.state_dict_for_checkpoint()))
    other = Trainer(build_policy(layers=1, width=64, heads=4, seed=0), TrainConfig())
    with pytest.raises(CheckpointError):
        other.load_checkpoint_state(state.model, state.moments())
    with pytest.raises(CheckpointError, match="lacks"):
        read_checkpoint({"model.safetensors": b""})


def test_policy_builds_from_a_local_dir(tmp_path: Path) -> None:
    trainer, _ = _trained()
    write_dir(write_checkpoint(trainer.state_dict_for_checkpoint()), tmp_path)
    policy = build_policy(tmp_path)
    reference = frozen_reference(policy)
    ids = torch.tensor([byte_ids("dir")])
    attn = torch.ones_like(ids)
    expected = token_logprobs(trainer.model, ids, attn)
    assert torch.allclose(token_logprobs(reference, ids, attn), expected)
    assert policy.training and not reference.training
    assert not any(p.requires_grad for p in reference.parameters())


# --- what the ratios assume: sampling settings, demonstrations --------------------------------------------

def _sampled(temperature: float | None, top_p: float | None = None) -> Trajectory:
    base = _versioned(0)
    turns = tuple(dataclasses.replace(t, temperature=temperature, top_p=top_p) for t in base.turns)
    return dataclasses.replace(base, turns=turns)


def test_data_sampled_at_another_temperature_is_refused_and_counted() -> None:
    trajs = [_sampled(1.0, 1.0), _sampled(0.7), _sampled(1.0, 0.9), _sampled(None)]
    sel = select_trajectories(trajs, current_version=0, config=TrainConfig(temperature=1.0))
    assert [t for t, _ in sel.kept] == [trajs[0], trajs[3]]
    assert sel.counts["skipped/sampling_mismatch"] == 2
    assert sel.counts["sampling/unrecorded"] == 1   # data from before turns recorded it: kept, but counted
    cooler = select_trajectories(trajs, current_version=0, config=TrainConfig(temperature=0.7))
    assert [t for t, _ in cooler.kept] == [trajs[1], trajs[3]]


def _demonstration() -> Trajectory:
    demo = make_trajectory([10], [([], [20, 21], [0.0, 0.0], DEMONSTRATION_VERSION)], reward=1.0)
    return dataclasses.replace(demo, reward_components={"outcome/correct": 1.0, "status/demonstration": 1.0})


def test_demonstrations_are_imitated_by_sft_and_never_used_for_ratios() -> None:
    demo, rollout = _demonstration(), _versioned(9)
    sft = select_trajectories([demo, rollout], current_version=40, config=TrainConfig(algorithm="sft"))
    assert [t for t, _ in sft.kept] == [demo]      # however late it arrives: no policy made it, it is never stale
    assert sft.counts["batch/demonstrations"] == 1 and sft.counts["stale/dropped"] == 1
    grpo = select_trajectories([demo, rollout], current_version=9, config=TrainConfig())
    assert [t for t, _ in grpo.kept] == [rollout] and grpo.counts["skipped/demonstration"] == 1


def test_an_sft_step_on_demonstrations_lowers_their_loss() -> None:
    model = tiny_model()
    trainer = Trainer(model, TrainConfig(algorithm="sft", lr=1e-2))
    first = trainer.step([_demonstration()] * 4, current_version=0)
    for _ in range(5):
        last = trainer.step([_demonstration()] * 4, current_version=0)
    assert first["train/updated"] == 1.0 and last["loss/sft"] < first["loss/sft"]


def test_a_retention_lets_each_version_go_once_and_never_v0_the_reference_or_every_nth() -> None:
    let_go = [prunable(v, keep_last=2, keep_every=5, protected={0, 4}) for v in range(1, 16)]
    assert [v for v in let_go if v is not None] == [1, 2, 3, 6, 7, 8, 9, 11, 12, 13]
    assert all(prunable(v, keep_last=0, keep_every=0, protected={0}) is None for v in range(20))
