"""Loss functions against references written out from the formulas, and against TRL where it is installed."""
from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from learner.losses import (
    aggregate,
    dpo_loss,
    gather_logprobs,
    grpo_loss,
    k3_kl,
    kl_shaped_advantages,
    sequence_logprobs,
    sft_loss,
    token_logprobs,
)
from learner.model import build_policy

Grid = list[list[float]]

# Two sequences, four target positions; each generated token hits one region of the clipped objective
# (eps 0.2): ratios e^0.3 = 1.35 and e^-0.4 = 0.67 are outside [0.8, 1.2], e^0.1 and e^-0.1 inside.
LOGPROBS = [[-1.0, -0.7, -2.0, -0.5], [-0.3, -1.6, -1.1, -0.9]]
OLD = [[-1.0, -1.0, -1.6, -0.6], [-0.6, -1.2, -1.0, -0.8]]
REF = [[-1.2, -0.9, -1.7, -0.4], [-0.5, -1.5, -1.3, -1.0]]
MASK = [[0.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]]
ADV = [1.5, -0.7]


def reference_grpo(
    lp: Grid, old: Grid, ref: Grid, mask: Grid, adv: list[float], eps_low: float, eps_high: float,
    kl_coef: float, agg: str,
) -> tuple[float, float]:
    """Plain-float PPO-clip + k3 KL; returns (loss, clip fraction)."""
    per_seq, totals, clipped, count = [], 0.0, 0, 0
    for i in range(len(lp)):
        values = []
        for t in range(len(lp[i])):
            if mask[i][t] == 0:
                continue
            ratio = math.exp(lp[i][t] - old[i][t])
            bounded = min(max(ratio, 1 - eps_low), 1 + eps_high)
            surrogate = min(ratio * adv[i], bounded * adv[i])
            d = ref[i][t] - lp[i][t]
            kl = math.exp(d) - d - 1
            values.append(-surrogate + kl_coef * kl)
            clipped += (adv[i] > 0 and ratio > 1 + eps_high) or (adv[i] < 0 and ratio < 1 - eps_low)
            count += 1
        per_seq.append(sum(values) / len(values))
        totals += sum(values)
    loss = totals / count if agg == "token-mean" else sum(per_seq) / len(per_seq)
    return loss, clipped / count


def tensors() -> dict[str, torch.Tensor]:
    return {
        "lp": torch.tensor(LOGPROBS), "old": torch.tensor(OLD), "ref": torch.tensor(REF),
        "mask": torch.tensor(MASK), "adv": torch.tensor(ADV),
    }


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("eps_high", [None, 0.28])
@pytest.mark.parametrize("kl_coef", [0.0, 0.3])
def test_grpo_loss_matches_written_out_formula(agg: str, eps_high: float | None, kl_coef: float) -> None:
    x = tensors()
    loss, metrics = grpo_loss(x["lp"], x["old"], x["adv"], x["mask"], clip_eps=0.2, clip_eps_high=eps_high,
                              kl_coef=kl_coef, ref_logprobs=x["ref"], loss_agg=agg)
    expected, clip_frac = reference_grpo(LOGPROBS, OLD, REF, MASK, ADV, 0.2, eps_high or 0.2, kl_coef, agg)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert metrics["stats/clip_frac"] == pytest.approx(clip_frac)
    assert metrics["loss/total"] == pytest.approx(metrics["loss/policy"] + kl_coef * metrics["loss/kl"], rel=1e-5)


def test_clip_fraction_counts_the_binding_side_only() -> None:
    x = tensors()
    _, metrics = grpo_loss(x["lp"], x["old"], x["adv"], x["mask"], clip_eps=0.2)
    # Seq 0 (A > 0): ratio 1.35 clipped, 0.67 not (min keeps it). Seq 1 (A < 0): 1.35 not, 0.67 clipped.
    assert metrics["stats/clip_frac"] == pytest.approx(2 / 6)


def test_clipped_and_masked_tokens_get_no_gradient() -> None:
    x = tensors()
    lp = x["lp"].clone().requires_grad_(True)
    loss, _ = grpo_loss(lp, x["old"], x["adv"], x["mask"], clip_eps=0.2)
    loss.backward()
    assert lp.grad is not None
    grad = lp.grad
    assert grad[0, 0] == 0 and grad[1, 3] == 0          # masked
    assert grad[0, 1] == 0 and grad[1, 1] == 0          # clipped: ratio 1.35 with A > 0, 0.67 with A < 0
    assert grad[0, 2] != 0 and grad[1, 0] != 0          # the same ratios on the other side of the min


def test_on_policy_ratio_is_one_and_gradient_is_advantage() -> None:
    x = tensors()
    lp = x["old"].clone().requires_grad_(True)
    loss, metrics = grpo_loss(lp, x["old"], x["adv"], x["mask"], clip_eps=0.2)
    loss.backward()
    assert metrics["stats/ratio_mean"] == pytest.approx(1.0)
    assert metrics["stats/approx_kl"] == pytest.approx(0.0, abs=1e-7)
    assert metrics["stats/clip_frac"] == 0.0
    n = sum(map(sum, MASK))
    assert lp.grad is not None
    assert lp.grad[0, 1].item() == pytest.approx(-ADV[0] / n)   # d(-r A / n)/d lp at r = 1
    assert lp.grad[1, 1].item() == pytest.approx(-ADV[1] / n)


def test_masked_positions_do_not_change_the_loss() -> None:
    """Prompt and observation tokens (mask 0) may carry anything, even inf, without changing the loss."""
    x = tensors()
    base, _ = grpo_loss(x["lp"], x["old"], x["adv"], x["mask"], 0.2, kl_coef=0.1, ref_logprobs=x["ref"])
    noisy = x["lp"].clone()
    noisy[x["mask"] == 0] = torch.tensor([-50.0, float("-inf")])
    old = x["old"].clone()
    old[x["mask"] == 0] = 30.0
    changed, _ = grpo_loss(noisy, old, x["adv"], x["mask"], 0.2, kl_coef=0.1, ref_logprobs=x["ref"])
    assert changed.item() == base.item()
    assert sft_loss(noisy, x["mask"])[0].item() == sft_loss(x["lp"], x["mask"])[0].item()


def test_k3_kl_is_zero_at_the_reference_and_positive_elsewhere() -> None:
    x = tensors()
    assert torch.all(k3_kl(x["ref"], x["ref"], x["mask"]) == 0)
    kl = k3_kl(x["lp"], x["ref"], x["mask"])
    d = REF[0][1] - LOGPROBS[0][1]
    assert kl[0, 1].item() == pytest.approx(math.exp(d) - d - 1, rel=1e-6)
    assert torch.all(kl[x["mask"] == 1] > 0)


def test_per_token_advantages_are_ppo_clip() -> None:
    x = tensors()
    broadcast = x["adv"].unsqueeze(-1).expand(-1, 4)
    a, _ = grpo_loss(x["lp"], x["old"], x["adv"], x["mask"], 0.2)
    b, _ = grpo_loss(x["lp"], x["old"], broadcast, x["mask"], 0.2)
    assert a.item() == pytest.approx(b.item())


def test_kl_shaped_advantages_add_the_penalty_to_go() -> None:
    x = tensors()
    shaped = kl_shaped_advantages(x["adv"], x["old"], x["ref"], x["mask"], kl_coef=0.5)
    for i in range(2):
        for t in range(4):
            future = [-0.5 * (OLD[i][s] - REF[i][s]) for s in range(t, 4) if MASK[i][s]]
            expected = (ADV[i] + sum(future)) * MASK[i][t]
            assert shaped[i, t].item() == pytest.approx(expected, abs=1e-6)


def test_aggregations() -> None:
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    assert aggregate(x, mask, "token-mean").item() == pytest.approx((1 + 2 + 6) / 3)
    assert aggregate(x, mask, "seq-mean-token-mean").item() == pytest.approx((1.5 + 6) / 2)
    assert aggregate(x, mask, "seq-mean-token-sum").item() == pytest.approx((3 + 6) / 2)
    with pytest.raises(ValueError, match="loss_agg"):
        aggregate(x, mask, "mean")


def test_sft_loss_is_masked_nll() -> None:
    x = tensors()
    loss, metrics = sft_loss(x["lp"], x["mask"])
    picked = [-LOGPROBS[i][t] for i in range(2) for t in range(4) if MASK[i][t]]
    assert loss.item() == pytest.approx(sum(picked) / len(picked))
    assert metrics["loss/sft"] == pytest.approx(loss.item())


def test_dpo_loss_matches_written_out_formula() -> None:
    pc, pr = [-3.0, -5.0, -2.5], [-4.0, -4.5, -2.5]
    rc, rr = [-3.5, -4.8, -2.0], [-3.9, -4.9, -3.0]
    beta = 0.2
    loss, metrics = dpo_loss(torch.tensor(pc), torch.tensor(pr), torch.tensor(rc), torch.tensor(rr), beta=beta)
    margins = [beta * ((pc[i] - rc[i]) - (pr[i] - rr[i])) for i in range(3)]
    expected = sum(-math.log(1 / (1 + math.exp(-m))) for m in margins) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["rewards/accuracy"] == pytest.approx(sum(m > 0 for m in margins) / 3)
    assert metrics["rewards/margin"] == pytest.approx(sum(margins) / 3, rel=1e-6)
    assert metrics["rewards/chosen"] == pytest.approx(sum(beta * (pc[i] - rc[i]) for i in range(3)) / 3, rel=1e-6)


def test_dpo_loss_is_log2_when_policy_equals_reference() -> None:
    logps = torch.tensor([-3.0, -1.0])
    loss, metrics = dpo_loss(logps, logps - 1, logps, logps - 1, beta=0.1)
    assert loss.item() == pytest.approx(math.log(2))
    assert metrics["rewards/accuracy"] == 0.0


def test_sequence_logprobs_sum_the_masked_tokens() -> None:
    x = tensors()
    expected = [sum(LOGPROBS[i][t] for t in range(4) if MASK[i][t]) for i in range(2)]
    assert sequence_logprobs(x["lp"], x["mask"]).tolist() == pytest.approx(expected)


def test_token_logprobs_use_the_temperature_and_next_tokens() -> None:
    model = build_policy(layers=1, width=32, heads=2, seed=0)
    ids = torch.tensor([[5, 9, 11, 7], [3, 4, 0, 0]])
    attn = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    got = token_logprobs(model, ids, attn, temperature=0.7)                     # (2, 3)
    logits = model(input_ids=ids, attention_mask=attn).logits / 0.7             # (2, 4, V)
    manual = torch.log_softmax(logits, -1)
    assert got.shape == (2, 3)
    assert got[0, 1].item() == pytest.approx(manual[0, 1, 11].item(), abs=1e-5)
    assert torch.allclose(gather_logprobs(logits[:, :-1], ids[:, 1:]), got, atol=1e-5)


# --- TRL's own loss code, where it is installed ----------------------------------------------------------

class _Accelerator:
    device = torch.device("cpu")

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return tensor

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    gather_for_metrics = gather


def _trl_grpo(loss_type: str, kl_coef: float, eps_high: float) -> float:
    """TRL's GRPOTrainer._compute_loss on our tensors: a stand-in `self` with only what the method reads."""
    trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    x = tensors()
    stub = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (x["lp"], torch.zeros_like(x["lp"]), None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level="token", beta=kl_coef, args=SimpleNamespace(use_bias_correction_kl=False, delta=None),
        loss_type=loss_type, epsilon_low=0.2, epsilon_high=eps_high, use_vllm=False,
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        _entropy_bonus_enabled=False, accelerator=_Accelerator(), _metrics=defaultdict(lambda: defaultdict(list)),
    )
    inputs: dict[str, Any] = {
        "prompt_ids": torch.ones(2, 1, dtype=torch.long), "prompt_mask": torch.ones(2, 1, dtype=torch.long),
        "completion_ids": torch.ones(2, 4, dtype=torch.long), "completion_mask": x["mask"],
        "advantages": x["adv"], "old_per_token_logps": x["old"], "ref_per_token_logps": x["ref"],
    }
    return float(trl_grpo.GRPOTrainer._compute_loss(stub, None, inputs))


@pytest.mark.parametrize(("trl_type", "agg"), [("bnpo", "token-mean"), ("grpo", "seq-mean-token-mean")])
@pytest.mark.parametrize("kl_coef", [0.0, 0.04])
def test_grpo_loss_agrees_with_trl(trl_type: str, agg: str, kl_coef: float) -> None:
    x = tensors()
    ours, _ = grpo_loss(x["lp"], x["old"], x["adv"], x["mask"], clip_eps=0.2, clip_eps_high=0.28,
                        kl_coef=kl_coef, ref_logprobs=x["ref"], loss_agg=agg)
    assert ours.item() == pytest.approx(_trl_grpo(trl_type, kl_coef, 0.28), rel=1e-5)


class _FixedLogps:
    """Stands in for the model: TRL's DPO reads per-token log-probs from the forward output."""

    def __init__(self, logps: torch.Tensor) -> None:
        self.logps = logps

    def __call__(self, **kwargs: Any) -> SimpleNamespace:
        column = self.logps.unsqueeze(-1)                                        # (2N, 1)
        return SimpleNamespace(log_probs=column, entropy=torch.zeros_like(column), mean_logits=torch.zeros_like(column),
                               is_top1=torch.zeros_like(column, dtype=torch.bool))


def test_dpo_loss_agrees_with_trl() -> None:
    trl_dpo = pytest.importorskip("trl.trainer.dpo_trainer")
    pc, pr = torch.tensor([-3.0, -5.0, -2.5]), torch.tensor([-4.0, -4.5, -2.5])
    rc, rr = torch.tensor([-3.5, -4.8, -2.0]), torch.tensor([-3.9, -4.9, -3.0])
    stub = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=_Accelerator(), aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=["sigmoid"], loss_weights=[1.0],
        beta=0.2, use_weighting=False, _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0,
        _tp_size=1,
    )
    inputs = {
        "input_ids": torch.ones(6, 2, dtype=torch.long), "attention_mask": torch.ones(6, 2, dtype=torch.long),
        "completion_mask": torch.tensor([[0, 1]] * 6), "ref_chosen_logps": rc, "ref_rejected_logps": rr,
    }
    theirs = trl_dpo.DPOTrainer._compute_loss(stub, _FixedLogps(torch.cat([pc, pr])), inputs, return_outputs=False)
    ours, metrics = dpo_loss(pc, pr, rc, rr, beta=0.2)
    assert ours.item() == pytest.approx(float(theirs), rel=1e-6)
    assert metrics["rewards/accuracy"] == pytest.approx(stub._metrics["train"]["rewards/accuracies"][0])
    assert metrics["rewards/margin"] == pytest.approx(stub._metrics["train"]["rewards/margins"][0], rel=1e-6)


def test_dual_clip_bounds_a_stale_token_with_a_negative_advantage() -> None:
    # One stale token whose ratio exploded to 50 (its behaviour log-prob was tiny) with A = -1, beside
    # three on-policy tokens with A = +1. Unbounded, the stale token's 50 * |A| outweighs everything else.
    lp = torch.tensor([[-0.1, -1.0, -1.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-0.1 - math.log(50.0), -1.0, -1.0, -1.0]])
    mask = torch.ones(1, 4)
    adv = torch.tensor([[-1.0, 1.0, 1.0, 1.0]])
    loose, _ = grpo_loss(lp, old, adv, mask, clip_eps=0.2)
    assert loose.item() == pytest.approx((50.0 - 3.0) / 4, rel=1e-5)
    loss, metrics = grpo_loss(lp, old, adv, mask, clip_eps=0.2, dual_clip=3.0)
    assert loss.item() == pytest.approx((3.0 - 3.0) / 4, abs=1e-6)          # capped at c * |A| = 3
    assert metrics["stats/dual_clip_frac"] == pytest.approx(0.25)
    loss.backward()
    assert lp.grad is not None
    assert lp.grad[0, 0].item() == 0.0                                        # the capped token pushes nothing
    assert lp.grad[0, 1:].tolist() == pytest.approx([-0.25] * 3)              # the others keep their gradient


def test_dual_clip_leaves_ordinary_ratios_alone() -> None:
    t = tensors()
    plain, _ = grpo_loss(t["lp"], t["old"], t["adv"], t["mask"], clip_eps=0.2)
    dual, _ = grpo_loss(t["lp"], t["old"], t["adv"], t["mask"], clip_eps=0.2, dual_clip=3.0)
    assert dual.item() == pytest.approx(plain.item())
