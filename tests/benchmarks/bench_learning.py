"""Learning benchmark: the streaming pipeline versus a synchronous in-process loop on the same task, schedule and
number of trajectories: held-out greedy success at equal trajectories and at equal wall time.

    python tests/benchmarks/bench_learning.py [--sft-updates 115 --rl-updates 80]   # ~25 minutes on 2 cores
    python tests/benchmarks/bench_learning.py --init RUN:v5 --repeats 3             # the RL phase only, ~35 minutes
    python tests/benchmarks/bench_learning.py --sft-lengths 100,115 --seeds 6       # the loop alone, ~55 minutes
    python tests/benchmarks/bench_learning.py --sft-weights ';reverse-6=2' --seeds 6  # the demo's SFT phase, ~20 min

The pipeline side is the demo (`python -m infra demo`, every service a process, evaluation through the
pipeline). The synchronous side calls the same code in turn in one process: demonstrations -> assembly ->
reward -> SFT updates, then generate -> assembly -> reward -> group advantages -> GRPO update, with the same
model, learning rates, batch size and checkpoint schedule, evaluating the same versions on the same
held-out tasks. Both curves go to runs/bench/learning.png. Figures only; nothing is asserted.

With --init RUN:vK both sides run only the RL phase, from that checkpoint's weights and Adam moments (a post-SFT
version: the demo's `--init RUN:vK --init-moments --sft-updates 0`), --repeats times each, taking turns (the
loop with data order and sampling seed r, then the pipeline). Asynchrony is the pipeline's one difference in
that phase; the runs' spread says how much of a gap is noise. Each run's greedy and sampled finals, each side's
mean with its 95% t interval over runs, and the difference of the means with its Welch interval; the curves go to
runs/bench/learning_rl.png.

With --sft-lengths the synchronous loop runs alone, once per SFT length and data order: how often each length
meets the demo's two learning goals (final greedy success >= 0.8, RL gain >= +0.2 over post-SFT), which pull
the SFT phase's length in opposite directions.

With --sft-weights the demo's SFT phase runs alone in process, once per demonstration mix and data order: the
demo's four word lengths drawn by those weights (';'-separated mixes, each the teacher's --weights, unnamed default
sources weighing 1; an empty mix draws every length alike), ended by the demo's rule (--sft-until-match), then
held-out greedy success per word length. What it shows: where each mix ends the phase, and how often it leaves the
RL phase room for its +0.2 (post-SFT at most 1 - 0.2).
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

from infra.demo import GOAL_FINAL, GOAL_RL_GAIN, SFT_MOST, SFT_UNTIL_MATCH, SFT_UPDATES, SOURCES, sft_version  # noqa: E402
from infra.settings import Settings  # noqa: E402
from infra.objectstore import ObjectStore  # noqa: E402
from learner import checkpoint_store  # noqa: E402
from learner.checkpoint_files import CheckpointState, load_model_tensors, read_checkpoint, unflatten_optimizer_state  # noqa: E402
from learner.eval import EVAL_SEED, wilson  # noqa: E402
from learner.model import build_policy  # noqa: E402
from learner.service import pooled_matches, sft_end_reason, source_matches, weakest_source  # noqa: E402
from learner.settings import SFT_MATCH_WINDOW, LearnerSettings, parse_init  # noqa: E402
from learner.update import TrainConfig, Trainer  # noqa: E402
from producers.demonstrations import demonstration_events  # noqa: E402
from producers.episodes import EpisodeRunner  # noqa: E402
from producers.policy import make_backend  # noqa: E402
from producers.policy.interface import Sampling  # noqa: E402
from infra.settings import parse_weights  # noqa: E402
from producers.settings import WorkerSettings  # noqa: E402
from producers.tasks.task import Task  # noqa: E402
from producers.worker import task_mixer  # noqa: E402
from producers.tasks import load_source  # noqa: E402
from producers.tasks.split import SplitSource  # noqa: E402
from schemas.models import tiny_llama_config  # noqa: E402
from schemas.records import RolloutEvent, Trajectory  # noqa: E402
from streams.scoring import Scorer  # noqa: E402
from tests.benchmarks.bench_e2e import score_events, to_trajectories  # noqa: E402
from tests.benchmarks.report import Figure, record  # noqa: E402

BATCH, GROUP, PROMPTS, NEW_TOKENS, LAYERS, WIDTH = 64, 8, 8, 8, 4, 256


def eval_tasks(episodes: int) -> list[Task]:
    """The held-out tasks `python -m learner.eval` draws (its worker's order and seed), so both sides are measured
    on the same tasks; each mode takes each once."""
    drawn = task_mixer(WorkerSettings(ns="eval", producer_id="eval", sources=("reverse",), split="heldout",
                                      seed=EVAL_SEED))
    return [drawn.next() for _ in range(episodes)]


class Synchronous:
    """The loop; `seed` sets its data order and sampling; `init`: start from these weights and Adam moments."""

    def __init__(self, args: argparse.Namespace, seed: int = 0, init: CheckpointState | None = None) -> None:
        torch.set_num_threads(2)
        self.args = args
        self.policy = build_policy(layers=LAYERS, width=WIDTH, seed=0)
        self.moments = None
        if init is not None:
            load_model_tensors(self.policy, init.model)
            self.moments = unflatten_optimizer_state(init.moments())
        self.backend = make_backend("transformers", None, seed=seed, config=tiny_llama_config(layers=LAYERS, width=WIDTH))
        self.sync_weights(0)
        source = load_source("reverse", seed=0)
        self.train = SplitSource(source, "train")
        self.heldout = eval_tasks(args.eval_episodes)
        self.scorer = Scorer.load("default", "1")
        self.events: list[RolloutEvent] = []
        settings = WorkerSettings(ns="sync", producer_id="sync", group_size=GROUP, prompts_per_step=PROMPTS,
                                  max_new_tokens=NEW_TOKENS, temperature=1.0)
        self.runner = EpisodeRunner(self.backend, None, self.events.append, settings)  # type: ignore[arg-type]
        self.rng = random.Random(seed)
        self.curve: list[dict[str, float]] = []
        self.started = time.perf_counter()
        self.eval_s = 0.0
        self.post_sft = 0  # the curve's point that ended the SFT phase

    def sync_weights(self, version: int) -> None:
        self.backend.load_weights(dict(self.policy.state_dict()), version)

    def evaluate(self, version: int, trajectories: int) -> None:
        started = time.perf_counter()
        point: dict[str, float] = {"version": version, "trajectories": trajectories}
        for mode, temperature in (("", 0.0), ("sampled_", 1.0)) if self.args.init else (("", 0.0),):
            gens = self.backend.generate([t.prompt for t in self.heldout], 1,
                                         Sampling(temperature=temperature, max_new_tokens=NEW_TOKENS))
            wins = sum(g[0].text.strip().split("\n")[0].strip() == t.spec["answer"] for g, t in zip(gens, self.heldout))
            low, high = wilson(wins, len(self.heldout))
            point.update({f"{mode}success": wins / len(self.heldout), f"{mode}ci_low": low, f"{mode}ci_high": high})
        self.eval_s += time.perf_counter() - started
        self.curve.append({**point, "seconds": time.perf_counter() - self.started - self.eval_s})

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
        self.post_sft = len(self.curve) - 1
        rl = Trainer(self.policy, TrainConfig(algorithm="grpo", lr=a.lr))
        rl.load_optimizer_state(self.moments if self.moments is not None else trainer.optimizer.state_dict())
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
    ns = f"bench-learning-{'rl-' if args.init else ''}{time.strftime('%H%M%S')}"
    init = ["--init", args.init, "--init-moments"] if args.init else []
    # the synchronous loop's task source, fixed SFT length (the demo's default ends it by its greedy match) and
    # draws (the demo's default retires solved word lengths)
    cmd = [sys.executable, "-m", "infra", "demo", "--ns", ns, *init, "--sources", "reverse", "--sft-updates",
           str(args.sft_updates), "--sft-until-match", "0", "--sft-enough-match", "0", "--curriculum", "0", "--rl-updates",
           str(args.rl_updates), "--sft-lr", str(args.sft_lr), "--lr", str(args.lr), "--warmup-updates",
           str(args.warmup_updates), "--rl-batches-per-update", str(args.rl_batches_per_update),
           "--updates-per-checkpoint", str(args.updates_per_checkpoint), "--sft-updates-per-checkpoint",
           str(args.sft_updates_per_checkpoint), "--eval-episodes",
           str(args.eval_episodes), "--runs-dir", "runs/bench"]
    subprocess.run(cmd, check=False)
    results = json.loads((Path("runs/bench") / ns / "eval.json").read_text())
    sft_v = sft_version(args)
    sampled = {r["version"]: r for r in results if r["mode"] == "sampled"}
    curve = []
    for r in results:
        if r["mode"] != "greedy":
            continue
        v = r["version"]
        sft = min(v * args.sft_updates_per_checkpoint, args.sft_updates)
        rl = min(max(0, v - sft_v) * args.updates_per_checkpoint, args.rl_updates)
        point = {**r, "trajectories": (sft + rl * args.rl_batches_per_update) * BATCH}
        if v in sampled:
            point.update({f"sampled_{k}": sampled[v][k] for k in ("success", "ci_low", "ci_high")})
        curve.append(point)
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


# Student's t at 97.5% (a two-sided 95% interval) by degrees of freedom; past 30, the normal's.
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


def t975(df: float) -> float:
    """The 97.5% quantile of Student's t at `df` degrees of freedom (rounded down to the nearest tabled row)."""
    rows = [d for d in T975 if d <= max(1.0, df)]
    return T975[max(rows)] if df <= 30 else 1.96


def var_of_mean(xs: list[float]) -> float:
    """The variance of the mean of runs' figures, from their sample variance (0 for one run)."""
    m = sum(xs) / len(xs)
    return sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs) if len(xs) > 1 else 0.0


def mean_ci(values: list[float]) -> tuple[float, float, float]:
    """The mean of runs' figures and its 95% t interval (nothing but the mean for one run)."""
    n, mean = len(values), sum(values) / len(values)
    if n < 2:
        return mean, mean, mean
    half = t975(n - 1) * var_of_mean(values) ** 0.5
    return mean, mean - half, mean + half


def welch(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """mean(a) - mean(b) with its 95% Welch interval: the runs of each side vary by their own amount."""
    diff = sum(a) / len(a) - sum(b) / len(b)
    va, vb = var_of_mean(a), var_of_mean(b)
    if va + vb == 0:
        return diff, diff, diff
    df = (va + vb) ** 2 / sum(v * v / (len(xs) - 1) for v, xs in ((va, a), (vb, b)) if len(xs) > 1)
    half = t975(df) * (va + vb) ** 0.5
    return diff, diff - half, diff + half


def init_state(args: argparse.Namespace) -> CheckpointState:
    run, version = parse_init(args.init, "bench-learning")
    state = read_checkpoint(checkpoint_store.load_version(ObjectStore(Settings.from_env()), run, version).files)
    state.moments()  # a weights-only version: CheckpointError now, not after the first loop
    return state


def plot_rl(loops: list[list[dict[str, float]]], pipes: list[list[dict[str, float]]], path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, mode in ((axes[0], ""), (axes[1], "sampled_")):
        for name, runs, colour in (("synchronous loop", loops, "tab:blue"), ("streaming pipeline", pipes, "tab:orange")):
            # The demo evaluates sampled only its first and last versions; the loop every point.
            measured = [[p for p in curve if f"{mode}success" in p] for curve in runs]
            for i, curve in enumerate(measured):
                ax.plot([p["trajectories"] for p in curve], [p[f"{mode}success"] for p in curve], marker="o",
                        color=colour, alpha=0.35, lw=1, label=f"{name} (each run)" if i == 0 else None)
            points = sorted({p["trajectories"] for c in measured for p in c})
            means = [sum(p[f"{mode}success"] for c in measured for p in c if p["trajectories"] == x) /
                     sum(1 for c in measured for p in c if p["trajectories"] == x) for x in points]
            ax.plot(points, means, color=colour, lw=2.5, label=f"{name} (mean of {len(runs)})")
        ax.set(xlabel="RL trajectories trained on", title=f"held-out {'sampled' if mode else 'greedy'} success",
               ylim=(-0.02, 1.02))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out success (256 tasks)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def rl_phase(args: argparse.Namespace, started: float) -> None:
    """Both sides' RL phase from one checkpoint, --repeats runs each, taking turns."""
    state = init_state(args)
    loops: list[list[dict[str, float]]] = []
    pipes: list[list[dict[str, float]]] = []
    for r in range(args.repeats):
        loops.append(Synchronous(args, seed=r, init=state).run())
        print(f"run {r + 1}/{args.repeats}: synchronous final greedy {loops[-1][-1]['success']:.3f}, sampled "
              f"{loops[-1][-1]['sampled_success']:.3f}", flush=True)
        pipes.append(pipeline(args))
        print(f"run {r + 1}/{args.repeats}: pipeline final greedy {pipes[-1][-1]['success']:.3f}, sampled "
              f"{pipes[-1][-1].get('sampled_success', float('nan')):.3f}", flush=True)
    plot_rl(loops, pipes, Path("runs/bench/learning_rl.png"))
    figures: list[Figure] = []
    for mode, label in (("", "greedy"), ("sampled_", "sampled")):
        finals = {name: [c[-1][f"{mode}success"] for c in runs] for name, runs in (("loop", loops), ("pipe", pipes))}
        start = {name: sum(c[0][f"{mode}success"] for c in runs) / len(runs) for name, runs in (("loop", loops),
                                                                                                ("pipe", pipes))}
        for name, side in (("loop", "synchronous loop"), ("pipe", "pipeline")):
            m, lo, hi = mean_ci(finals[name])
            runs = ", ".join(f"{v:.3f}" for v in finals[name])
            print(f"{side:>16} {label:>7}: {start[name]:.3f} -> {m:.3f} [{lo:.3f}, {hi:.3f}] ({runs})")
            figures.append(Figure(f"{side}: final held-out {label} success, mean of {len(finals[name])} runs", m,
                                  f"[{lo:.3f}, {hi:.3f}] (runs {runs}; from {start[name]:.3f})",
                                  m / max(mean_ci(finals['loop'])[0], 1e-9) if name == "pipe" else None,
                                  "synchronous" if name == "pipe" else ""))
        d, lo, hi = welch(finals["pipe"], finals["loop"])
        print(f"{'pipeline - loop':>16} {label:>7}: {d:+.3f} [{lo:+.3f}, {hi:+.3f}]")
        figures.append(Figure(f"pipeline minus loop, final {label} success", d, f"[{lo:+.3f}, {hi:+.3f}] (Welch 95%)",
                              goal="≥ 0 within the interval (no loss to asynchrony)", met=hi >= 0))
    seconds = {name: mean_ci([c[-1]["seconds"] for c in runs])[0] for name, runs in (("loop", loops), ("pipe", pipes))}
    figures.append(Figure("pipeline: training wall time of the RL phase", seconds["pipe"], "s",
                          seconds["pipe"] / max(seconds["loop"], 1e-9), "synchronous"))
    print(f"wall time of the RL phase: loop {seconds['loop']:.0f} s, pipeline {seconds['pipe']:.0f} s")
    print("curves: runs/bench/learning_rl.png")
    record("bench_learning_rl", f"reverse, tiny Llama {LAYERS}x{WIDTH}: {args.rl_updates} GRPO updates of "
           f"{BATCH * args.rl_batches_per_update} trajectories from {args.init} (weights and Adam moments), "
           f"{args.repeats} runs a side taking turns; the pipeline side is `python -m infra demo --init "
           f"{args.init} --init-moments --sft-updates 0`", figures, started, command="bench_learning.py --init RUN:vK")


def length_args(args: argparse.Namespace, n: int) -> argparse.Namespace:
    """The run's arguments with an SFT phase of `n` updates, warmed up over --warmup-updates if given, else over
    a tenth of `n` (as the demo)."""
    warmup = n // 10 if args.warmup_updates is None else args.warmup_updates
    return argparse.Namespace(**{**vars(args), "sft_updates": n, "warmup_updates": warmup})


def sft_lengths(args: argparse.Namespace, started: float) -> None:
    """The SFT phase's length, in process: for each data order (seed 1..--seeds) and each length, the whole
    synchronous run (SFT with the demo's warmup, a tenth of it, then the RL phase); the same seed draws the same
    demonstrations, so the lengths are compared on one data order at a time. Per length: how many runs met each
    learning goal of the demo, the finals and RL gains with their 95% t intervals."""
    runs: dict[int, list[tuple[float, float]]] = {n: [] for n in args.sft_lengths}
    for seed in range(1, args.seeds + 1):
        for n in args.sft_lengths:
            loop = Synchronous(length_args(args, n), seed=seed)
            curve = loop.run()
            post, final = curve[loop.post_sft]["success"], curve[-1]["success"]
            runs[n].append((post, final))
            print(f"seed {seed}, {n} SFT updates: greedy post-SFT {post:.3f} -> final {final:.3f} (RL "
                  f"{final - post:+.3f}); curve " + " ".join(f"{p['success']:.3f}" for p in curve), flush=True)
    figures: list[Figure] = []
    for n, pairs in runs.items():
        finals, gains = [f for _, f in pairs], [f - p for p, f in pairs]
        met_final = sum(f >= GOAL_FINAL for f in finals)
        met_gain = sum(g >= GOAL_RL_GAIN for g in gains)
        both = sum(f >= GOAL_FINAL and g >= GOAL_RL_GAIN for f, g in zip(finals, gains))
        m, lo, hi = mean_ci(finals)
        gm, glo, ghi = mean_ci(gains)
        pm = mean_ci([p for p, _ in pairs])[0]
        print(f"{n} SFT updates: post-SFT {pm:.3f}, final {m:.3f} [{lo:.3f}, {hi:.3f}], RL gain {gm:+.3f} "
              f"[{glo:+.3f}, {ghi:+.3f}]; final >= {GOAL_FINAL} in {met_final}/{len(pairs)}, RL gain >= "
              f"+{GOAL_RL_GAIN} in {met_gain}/{len(pairs)}, both in {both}/{len(pairs)}")
        figures += [
            Figure(f"{n} SFT updates: final greedy success, mean of {len(pairs)} data orders", m,
                   f"[{lo:.3f}, {hi:.3f}] (runs {', '.join(f'{f:.3f}' for f in finals)}; post-SFT mean {pm:.3f})"),
            Figure(f"{n} SFT updates: RL gain over post-SFT, mean", gm,
                   f"[{glo:+.3f}, {ghi:+.3f}] (runs {', '.join(f'{g:+.3f}' for g in gains)})"),
            Figure(f"{n} SFT updates: runs meeting both learning goals", both / len(pairs),
                   f"of {len(pairs)} (final >= {GOAL_FINAL}: {met_final}, RL gain >= +{GOAL_RL_GAIN}: {met_gain})")]
    record("bench_learning_sft", f"reverse, tiny Llama {LAYERS}x{WIDTH}, synchronous loop: "
           f"{'/'.join(map(str, args.sft_lengths))} SFT updates of {BATCH} demonstrations (a tenth warmed up) + "
           f"{args.rl_updates} GRPO updates of {BATCH * args.rl_batches_per_update} trajectories, data orders "
           f"1..{args.seeds}", figures, started, command="bench_learning.py --sft-lengths A,B")


def mix_weights(text: str) -> dict[str, float]:
    """A --sft-weights mix as the teacher's --weights: the named sources' weights, every other default source 1."""
    named = parse_weights(text)
    unknown = sorted(set(named) - set(SOURCES.split(",")))
    if unknown:
        raise SystemExit(f"--sft-weights {text!r}: {', '.join(unknown)} is not one of the demo's sources {SOURCES}")
    return {name: named.get(name, 1.0) for name in SOURCES.split(",")}


def sft_phase(weights: str, seed: int, args: argparse.Namespace) -> dict[str, object]:
    """The demo's SFT phase in process, with data order `seed` and the demonstrations drawn by `weights`: ended once
    every word length's greedy match over the latest updates reaches --sft-until-match, or after SFT_MOST; then
    held-out greedy success, in all and per word length."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(seed)
    sources = tuple(SOURCES.split(","))
    policy = build_policy(layers=LAYERS, width=WIDTH, seed=0)
    backend = make_backend("transformers", None, seed=seed, config=tiny_llama_config(layers=LAYERS, width=WIDTH))
    teacher = task_mixer(WorkerSettings(ns="sync", producer_id="demonstrations", sources=sources,
                                        weights=mix_weights(weights), seed=seed))
    drawn = task_mixer(WorkerSettings(ns="eval", producer_id="eval", sources=sources, split="heldout", seed=EVAL_SEED))
    heldout = [drawn.next() for _ in range(args.eval_episodes)]
    scorer = Scorer.load("default", "1")
    trainer = Trainer(policy, TrainConfig(algorithm="sft", lr=args.sft_lr))
    warmup = SFT_UPDATES // 10 if args.warmup_updates is None else args.warmup_updates  # as the demo's
    window: list[dict[str, list[float]]] = []
    started = time.perf_counter()

    def heldout_success() -> tuple[float, dict[int, float]]:
        backend.load_weights(dict(policy.state_dict()), 1)
        gens = backend.generate([t.prompt for t in heldout], 1, Sampling(temperature=0.0, max_new_tokens=NEW_TOKENS))
        by_length: dict[int, list[int]] = {}
        for g, task in zip(gens, heldout):
            tally = by_length.setdefault(len(task.spec["answer"]), [0, 0])
            tally[0] += g[0].text.strip().split("\n")[0].strip() == task.spec["answer"]
            tally[1] += 1
        wins = sum(w for w, _ in by_length.values())
        return wins / len(heldout), {n: w / k for n, (w, k) in sorted(by_length.items())}

    # The learner's own rules: the demo's (the weakest source), and each --overall-bars bar (--sft-enough-match),
    # where the phase would have ended had it also ended there
    demo_rule = LearnerSettings(ns="sync", sft_updates=SFT_MOST, sft_until_match=args.sft_until_match)
    bar_rules = {bar: LearnerSettings(ns="sync", sft_updates=SFT_MOST, sft_enough_match=bar) for bar in args.overall_bars}
    bars: dict[float, dict[str, object]] = {}
    measuring = 0.0  # seconds in those measurements, not the phase's
    for update in range(1, SFT_MOST + 1):
        trainer.set_lr(args.sft_lr * min(1.0, update / warmup) if warmup else args.sft_lr)
        demos = [e for _ in range(BATCH)
                 for e in demonstration_events(teacher.next(), backend.tokenizer, "sync", "demonstrations")]
        metrics = trainer.step(score_events(demos, scorer), current_version=0)
        window = [*window, source_matches(metrics)][-SFT_MATCH_WINDOW:]
        if sft_end_reason(demo_rule, [], window):
            break
        for bar, rule in bar_rules.items():
            if bar not in bars and sft_end_reason(rule, [], window):
                weakest = weakest_source(pooled_matches(window))
                before = time.perf_counter()
                post, by_length = heldout_success()
                measuring += time.perf_counter() - before
                bars[bar] = {"updates": update, "post_sft": post, "by_length": by_length,
                             "weakest": weakest[1] if weakest else 0.0}
    seconds = time.perf_counter() - started - measuring
    post, by_length = heldout_success()
    return {"updates": update, "post_sft": post, "seconds": seconds, "by_length": by_length, "bars": bars}


def sft_weights(args: argparse.Namespace, started: float) -> None:
    """Each demonstration mix of --sft-weights over --seeds data orders from --first-seed, taking turns: where the
    demo's SFT phase ends and how much room it leaves the RL phase."""
    mixes = args.sft_weights.split(";")
    runs: dict[str, list[dict[str, object]]] = {m: [] for m in mixes}
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for mix in mixes:
            r = sft_phase(mix, seed, args)
            runs[mix].append(r)
            lengths = " / ".join(f"{v:.2f}" for v in r["by_length"].values())  # type: ignore[attr-defined]
            print(f"seed {seed}, demonstrations {mix or 'alike'}: SFT ends after {r['updates']} updates, held-out "
                  f"greedy {r['post_sft']:.3f} (by length {lengths}), {r['seconds']:.0f} s", flush=True)
            for bar, b in r["bars"].items():  # type: ignore[attr-defined]
                at = " / ".join(f"{v:.2f}" for v in b["by_length"].values())
                print(f"  overall greedy match >= {bar} after {b['updates']} updates (weakest source "
                      f"{b['weakest']:.2f}): held-out greedy {b['post_sft']:.3f} (by length {at})", flush=True)
    room = 1 - GOAL_RL_GAIN
    figures: list[Figure] = []
    for mix, rs in runs.items():
        posts = [float(r["post_sft"]) for r in rs]  # type: ignore[arg-type]
        ends = [float(r["updates"]) for r in rs]  # type: ignore[arg-type]
        m, lo, hi = mean_ci(posts)
        roomy = sum(p <= room for p in posts)
        name = mix or "every length alike"
        print(f"{name}: post-SFT {m:.3f} [{lo:.3f}, {hi:.3f}], max {max(posts):.3f}; {roomy}/{len(rs)} at or under "
              f"{room:.1f}; SFT updates {mean_ci(ends)[0]:.0f} ({', '.join(f'{e:.0f}' for e in ends)})")
        figures += [
            Figure(f"demonstrations {name}: post-SFT held-out greedy success, mean of {len(rs)} data orders", m,
                   f"[{lo:.3f}, {hi:.3f}] (runs {', '.join(f'{p:.3f}' for p in posts)})"),
            Figure(f"demonstrations {name}: runs leaving the RL phase room for +{GOAL_RL_GAIN}", roomy / len(rs),
                   f"of {len(rs)} (post-SFT at most {room:.1f})"),
            Figure(f"demonstrations {name}: SFT updates, mean", mean_ci(ends)[0],
                   f"updates (runs {', '.join(f'{e:.0f}' for e in ends)})")]
    record("bench_learning_sft_weights", f"the demo's SFT phase in process: {'/'.join(SOURCES.split(','))} "
           f"demonstrations by each mix ({' vs '.join(m or 'alike' for m in mixes)}), {BATCH} an update, ended at "
           f"{args.sft_until_match} of every length (at most {SFT_MOST} updates), data orders "
           f"{args.first_seed}..{args.first_seed + args.seeds - 1}",
           figures + overall_bar_figures(runs, args.overall_bars), started, command="bench_learning.py --sft-weights A;B")


def overall_bar_figures(runs: dict[str, list[dict[str, object]]], bars: list[float]) -> list[Figure]:
    """For each --overall-bars bar: the post-SFT success had the phase also ended once the overall greedy match of its
    latest updates reached the bar (where it came first), against the phase as it ran."""
    room = 1 - GOAL_RL_GAIN
    figures: list[Figure] = []
    for mix, rs in runs.items():
        for bar in bars:
            reached = [r["bars"][bar] for r in rs if bar in r["bars"]]  # type: ignore[index,operator]
            posts = [float(r["bars"][bar]["post_sft"]) if bar in r["bars"] else float(r["post_sft"])  # type: ignore
                     for r in rs]
            m, lo, hi = mean_ci(posts)
            weakest = min((float(b["weakest"]) for b in reached), default=float("nan"))  # type: ignore[arg-type]
            name = f"demonstrations {mix or 'alike'}, also ended at overall {bar}"
            print(f"{name}: came first in {len(reached)}/{len(rs)}; post-SFT {m:.3f} [{lo:.3f}, {hi:.3f}], max "
                  f"{max(posts):.3f}; {sum(p <= room for p in posts)}/{len(rs)} at or under {room:.1f}; weakest source "
                  f"where it came first {weakest:.2f}")
            figures += [Figure(f"{name}: post-SFT held-out greedy success, mean", m,
                               f"[{lo:.3f}, {hi:.3f}] (runs {', '.join(f'{p:.3f}' for p in posts)}; the bar came first "
                               f"in {len(reached)} of {len(rs)}, the weakest source then at {weakest:.2f} or more)")]
    return figures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sft-updates", type=int, default=SFT_UPDATES, help="as the demo")
    p.add_argument("--rl-updates", type=int, default=80, help="as the published comparison (the demo runs 50)")
    p.add_argument("--rl-batches-per-update", type=int, default=8, help=f"shards of {BATCH} per GRPO update, as the demo")
    p.add_argument("--sft-updates-per-checkpoint", type=int, default=20)
    p.add_argument("--updates-per-checkpoint", type=int, default=1)
    p.add_argument("--eval-every", type=int, default=20, help="RL versions between points of the synchronous curve")
    p.add_argument("--sft-lr", type=float, default=1e-3)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--eval-episodes", type=int, default=256)
    p.add_argument("--warmup-updates", type=int, default=None,
                   help="default: a tenth of --sft-updates (with --sft-lengths, of each length), as the demo")
    p.add_argument("--init", default=None, metavar="RUN:vK",
                   help="the RL phase only, both sides from that checkpoint's weights and Adam moments (a post-SFT "
                        "version, e.g. a demo's v5)")
    p.add_argument("--repeats", type=int, default=3, help="with --init: runs a side")
    p.add_argument("--sft-lengths", type=lambda t: [int(x) for x in t.split(",")], default=None, metavar="A,B",
                   help="the synchronous loop alone, once per SFT length and data order: which length meets the "
                        "demo's learning goals more often")
    p.add_argument("--seeds", type=int, default=6, help="with --sft-lengths or --sft-weights: data orders")
    p.add_argument("--first-seed", type=int, default=0,
                   help="with --sft-weights: the first data order (to add orders to an earlier calibration)")
    p.add_argument("--sft-weights", default=None, metavar="A;B",
                   help="the demo's SFT phase alone, once per demonstration mix (';'-separated teacher --weights, "
                        "e.g. ';reverse-6=2': alike vs twice the 6-letter words) and data order")
    p.add_argument("--sft-until-match", type=float, default=SFT_UNTIL_MATCH, help="with --sft-weights: as the demo")
    p.add_argument("--threads", type=int, default=2, help="with --sft-weights: torch threads")
    p.add_argument("--overall-bars", type=lambda v: [float(b) for b in v.split(",") if b], default=[], metavar="P,Q",
                   help="with --sft-weights: also measure where the phase would end once greedy decoding wrote a share P "
                        "of all the demonstrations of its latest updates (learner --sft-enough-match)")
    args = p.parse_args()
    started = time.monotonic()
    if args.init:
        args.sft_updates = 0
    if args.sft_lengths and not args.init:
        return sft_lengths(args, started)
    if args.sft_weights is not None:
        return sft_weights(args, started)
    if args.warmup_updates is None:
        args.warmup_updates = args.sft_updates // 10
    if args.init:
        return rl_phase(args, started)
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
