"""Learning benchmark: the streaming pipeline versus a synchronous in-process loop on the same task, schedule and
number of trajectories: held-out greedy success at equal trajectories and at equal wall time.

    python tests/benchmarks/bench_learning.py [--sft-updates 100 --rl-updates 80]   # ~25 minutes on 2 cores

The pipeline side is the demo (`python -m infra demo`, every service a process, evaluation through the
pipeline). The synchronous side calls the same code in turn in one process: demonstrations -> assembly ->
reward -> SFT updates, then generate -> assembly -> reward -> group advantages -> GRPO update, with the same
model, learning rates, batch size and checkpoint schedule, evaluating the same versions on the same
held-out tasks. Both curves go to runs/bench/learning.png. Figures only; nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from infra.demo import GOAL_FINAL, GOAL_RL_GAIN, sft_version  # noqa: E402
from learner.eval import wilson  # noqa: E402
from learner.model import build_policy  # noqa: E402
from learner.update import TrainConfig, Trainer  # noqa: E402
from producers.demonstrations import demonstration_events  # noqa: E402
from producers.episodes import EpisodeRunner  # noqa: E402
from producers.policy import make_backend  # noqa: E402
from producers.policy.interface import Sampling  # noqa: E402
from producers.settings import WorkerSettings  # noqa: E402
from producers.tasks import load_source  # noqa: E402
from producers.tasks.split import SplitSource  # noqa: E402
from schemas.models import tiny_llama_config  # noqa: E402
from schemas.records import RolloutEvent, Trajectory  # noqa: E402
from streams.scoring import Scorer  # noqa: E402
from tests.benchmarks.bench_e2e import score_events, to_trajectories  # noqa: E402
from tests.benchmarks.report import Figure, record  # noqa: E402

BATCH, GROUP, PROMPTS, NEW_TOKENS, LAYERS, WIDTH = 64, 8, 8, 8, 4, 256


class Synchronous:
    def __init__(self, args: argparse.Namespace) -> None:
        torch.set_num_threads(2)
        self.args = args
        self.policy = build_policy(layers=LAYERS, width=WIDTH, seed=0)
        self.backend = make_backend("transformers", None, seed=0, config=tiny_llama_config(layers=LAYERS, width=WIDTH))
        self.sync_weights(0)
        source = load_source("reverse", seed=0)
        self.train, held = SplitSource(source, "train"), SplitSource(source, "heldout")
        self.heldout = [held[i] for i in range(min(args.eval_episodes, len(held)))]
        self.scorer = Scorer.load("default", "1")
        self.events: list[RolloutEvent] = []
        settings = WorkerSettings(ns="sync", producer_id="sync", group_size=GROUP, prompts_per_step=PROMPTS,
                                  max_new_tokens=NEW_TOKENS, temperature=1.0)
        self.runner = EpisodeRunner(self.backend, None, self.events.append, settings)  # type: ignore[arg-type]
        self.rng = random.Random(0)
        self.curve: list[dict[str, float]] = []
        self.started = time.perf_counter()
        self.eval_s = 0.0

    def sync_weights(self, version: int) -> None:
        self.backend.load_weights(dict(self.policy.state_dict()), version)

    def evaluate(self, version: int, trajectories: int) -> None:
        started = time.perf_counter()
        gens = self.backend.generate([t.prompt for t in self.heldout], 1, Sampling(temperature=0.0,
                                                                                   max_new_tokens=NEW_TOKENS))
        wins = sum(g[0].text.strip().split("\n")[0].strip() == t.spec["answer"] for g, t in zip(gens, self.heldout))
        low, high = wilson(wins, len(self.heldout))
        self.eval_s += time.perf_counter() - started
        self.curve.append({"version": version, "trajectories": trajectories, "success": wins / len(self.heldout),
                           "ci_low": low, "ci_high": high,
                           "seconds": time.perf_counter() - self.started - self.eval_s})

    def run(self) -> list[dict[str, float]]:
        a, version, seen = self.args, 0, 0
        self.evaluate(0, 0)
        trainer = Trainer(self.policy, TrainConfig(algorithm="sft", lr=a.sft_lr))
        for update in range(1, a.sft_updates + 1):
            trainer.set_lr(a.sft_lr * min(1.0, update / a.warmup_updates) if a.warmup_updates else a.sft_lr)
            tasks = [self.train[self.rng.randrange(len(self.train))] for _ in range(BATCH)]
            demos = [e for t in tasks for e in demonstration_events(t, self.backend.tokenizer, "sync", "demos")]
            trainer.step(score_events(demos, self.scorer), current_version=version)
            seen += BATCH
            if update % a.sft_updates_per_checkpoint == 0 or update == a.sft_updates:
                version += 1
                self.sync_weights(version)
                self.evaluate(version, seen)
        rl = Trainer(self.policy, TrainConfig(algorithm="grpo", lr=a.lr))
        rl.load_optimizer_state(trainer.optimizer.state_dict())
        for update in range(1, a.rl_updates + 1):
            batch: list[Trajectory] = []
            while len(batch) < BATCH * a.rl_batches_per_update:
                self.events.clear()
                self.runner.run_step([self.train[self.rng.randrange(len(self.train))] for _ in range(PROMPTS)])
                batch += to_trajectories(self.events, self.scorer)
            rl.step(batch[:BATCH * a.rl_batches_per_update], current_version=version)
            seen += BATCH * a.rl_batches_per_update
            if update % a.updates_per_checkpoint == 0:
                version += 1
                self.sync_weights(version)
                if update % (a.updates_per_checkpoint * a.eval_every) == 0 or update == a.rl_updates:
                    self.evaluate(version, seen)
        return self.curve


def pipeline(args: argparse.Namespace) -> list[dict[str, float]]:
    ns = f"bench-learning-{time.strftime('%H%M%S')}"
    cmd = [sys.executable, "-m", "infra", "demo", "--ns", ns, "--sft-updates", str(args.sft_updates), "--rl-updates",
           str(args.rl_updates), "--sft-lr", str(args.sft_lr), "--lr", str(args.lr), "--warmup-updates",
           str(args.warmup_updates), "--rl-batches-per-update", str(args.rl_batches_per_update),
           "--updates-per-checkpoint", str(args.updates_per_checkpoint), "--sft-updates-per-checkpoint",
           str(args.sft_updates_per_checkpoint), "--eval-episodes",
           str(args.eval_episodes), "--runs-dir", "runs/bench"]
    subprocess.run(cmd, check=False)
    results = json.loads((Path("runs/bench") / ns / "eval.json").read_text())
    sft_v = sft_version(args)
    curve = []
    for r in results:
        if r["mode"] != "greedy":
            continue
        v = r["version"]
        sft = min(v * args.sft_updates_per_checkpoint, args.sft_updates)
        rl = min(max(0, v - sft_v) * args.updates_per_checkpoint, args.rl_updates)
        curve.append({**r, "trajectories": (sft + rl * args.rl_batches_per_update) * BATCH})
    return sorted(curve, key=lambda r: r["version"])


def plot(sync: list[dict[str, float]], pipe: list[dict[str, float]], path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, key, label in ((axes[0], "trajectories", "trajectories trained on"), (axes[1], "seconds", "wall time (s)")):
        for name, curve in (("synchronous loop", sync), ("streaming pipeline", pipe)):
            ax.errorbar([p[key] for p in curve], [p["success"] for p in curve],
                        yerr=[[p["success"] - p["ci_low"] for p in curve], [p["ci_high"] - p["success"] for p in curve]],
                        marker="o", capsize=3, label=name)
        ax.set(xlabel=label, title=f"held-out greedy success vs {label}", ylim=(-0.02, 1.02))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out success (95% Wilson CI)")
    axes[0].legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def figures(sync: list[dict[str, float]], pipe: list[dict[str, float]], args: argparse.Namespace) -> list[Figure]:
    sft_v = sft_version(args)
    post_sft = next(p for p in pipe if p["version"] == sft_v)
    last, base = pipe[-1], sync[-1]
    gain = last["success"] - post_sft["success"]
    return [
        Figure("synchronous loop: final held-out greedy success", base["success"], f"[{base['ci_low']:.3f}, "
               f"{base['ci_high']:.3f}] in {base['seconds']:.0f} s"),
        Figure("pipeline: final held-out greedy success", last["success"], f"[{last['ci_low']:.3f}, "
               f"{last['ci_high']:.3f}] in {last['seconds']:.0f} s", last["success"] / max(base["success"], 1e-9),
               "synchronous", f"≥ {GOAL_FINAL}", last["success"] >= GOAL_FINAL),
        Figure("pipeline: post-SFT held-out greedy success", post_sft["success"],
               f"[{post_sft['ci_low']:.3f}, {post_sft['ci_high']:.3f}]"),
        Figure("pipeline: success the RL phase adds", gain, "absolute", goal=f"≥ +{GOAL_RL_GAIN}",
               met=gain >= GOAL_RL_GAIN),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sft-updates", type=int, default=100, help="as the demo")
    p.add_argument("--rl-updates", type=int, default=80, help="as the demo")
    p.add_argument("--rl-batches-per-update", type=int, default=8, help=f"shards of {BATCH} per GRPO update, as the demo")
    p.add_argument("--sft-updates-per-checkpoint", type=int, default=20)
    p.add_argument("--updates-per-checkpoint", type=int, default=1)
    p.add_argument("--eval-every", type=int, default=20, help="RL versions between points of the synchronous curve")
    p.add_argument("--sft-lr", type=float, default=1e-3)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--eval-episodes", type=int, default=256)
    p.add_argument("--warmup-updates", type=int, default=None, help="default: a tenth of --sft-updates, as the demo")
    args = p.parse_args()
    started = time.monotonic()
    if args.warmup_updates is None:
        args.warmup_updates = args.sft_updates // 10
    sync = Synchronous(args).run()
    pipe = pipeline(args)
    plot(sync, pipe, Path("runs/bench/learning.png"))
    print(f"reverse, tiny Llama {LAYERS}x{WIDTH}, {args.sft_updates} SFT + {args.rl_updates} GRPO updates of {BATCH}")
    for name, curve in (("synchronous", sync), ("pipeline", pipe)):
        last = curve[-1]
        print(f"{name:>12}: final held-out success {last['success']:.3f} [{last['ci_low']:.3f}, {last['ci_high']:.3f}] "
              f"after {last['trajectories']:.0f} trajectories, {last['seconds']:.0f}s of training wall time")
    for s in sync:  # equal trajectories: the pipeline's point with the same count, where there is one
        match = [q for q in pipe if q["trajectories"] == s["trajectories"]]
        if match:
            print(f"at {s['trajectories']:>6.0f} trajectories: synchronous {s['success']:.3f}, pipeline "
                  f"{match[0]['success']:.3f}")
    print("curves: runs/bench/learning.png")
    record("bench_learning", f"reverse, tiny Llama {LAYERS}x{WIDTH}: {args.sft_updates} SFT updates of {BATCH} "
           f"demonstrations + {args.rl_updates} GRPO updates of {BATCH * args.rl_batches_per_update} trajectories; "
           "the pipeline side is `python -m infra demo`", figures(sync, pipe, args), started)


if __name__ == "__main__":
    main()
