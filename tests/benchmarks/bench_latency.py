"""Latency benchmark: how long a trajectory takes to reach the learner, and a checkpoint the rollout workers.

    python tests/benchmarks/bench_latency.py [--rate 2000] [--seconds 30] [--models tiny,smollm2-135m]

1. Episode -> batch: events of the realistic mix (code, math, table; 512 episodes open at once) are produced
   live at --rate into a fresh namespace, where a streams worker and a shard writer (64 trajectories or 3 s a
   batch, as the demo runs it) turn them into batches. For each trajectory: from its EpisodeEnded (the event's
   wall-clock time) to the broker time of the batch manifest that lists it, which is when the learner can
   read it; also from the group's last EpisodeEnded (a group is scored when its last member ends). Episodes
   that end in the last few seconds of the run are not counted: events stop flowing there, and the last
   batch of each partition fills no more and waits out its 3 s (the count left out is printed).
2. Checkpoint -> generating: for each model, the real learner trains SFT updates on demonstrations and
   announces a checkpoint after each; a rollout worker (no lag limit: it never pauses) loads every one it
   sees and reports, per version, the time from the announcement to its first generation step with it
   (`rollout/checkpoint_latency_s` on the metrics topic, what the monitor's histogram shows). A version
   announced while the worker was still loading an earlier one is superseded, never generated with.
   `smollm2-135m` runs where its converted folder exists (`python -m learner.pretrained smollm2-135m`).
   Each model runs twice (--precisions): the float32 weights, and the learner's `--broadcast-bf16` (the
   worker downloads the bfloat16 copy, half the bytes); the bytes the worker moved per version are reported.

Histograms of both go to runs/bench/latency.png. Figures only; nothing is asserted.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from infra.bootstrap import bootstrap  # noqa: E402
from infra.kafka import Publisher, read_topic  # noqa: E402
from infra.settings import Settings  # noqa: E402
from infra.supervisor import Service  # noqa: E402
from infra.models import pretrained_dir  # noqa: E402
from schemas.codec import codec  # noqa: E402
from schemas.models import PRETRAINED  # noqa: E402
from schemas.records import BatchManifest, CheckpointPublished, PipelineMetric, Trajectory  # noqa: E402
from schemas.topics import Topics  # noqa: E402
from tests.benchmarks.bench_streams import interleaved  # noqa: E402
from tests.benchmarks.report import Figure, bench_dir, percentile, record, scratch  # noqa: E402

BATCH, MAX_AGE_S = 64, 3.0  # the demo's shard writer
GOAL_BATCH_P50_S, GOAL_BATCH_P99_S = 1.0, 3.0
GOAL_CHECKPOINT_P50_S = {"tiny": 1.0, "smollm2-135m": 5.0}


class Services:
    """Service processes of one namespace, started as the supervisor starts them (one OpenMP thread each)."""

    def __init__(self, settings: Settings, ns: str, log_dir: Path) -> None:
        self.env = {**os.environ, **settings.as_env(), "OMP_NUM_THREADS": str(Service("bench", []).threads)}
        self.log_dir = log_dir
        self.ns = ns
        self.procs: dict[str, subprocess.Popen] = {}  # type: ignore[type-arg]

    def start(self, name: str, *args: str) -> subprocess.Popen:  # type: ignore[type-arg]
        log = (self.log_dir / f"{self.ns}-{name}.log").open("w")
        proc = subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, env=self.env, stdout=log, stderr=log)
        self.procs[name] = proc
        return proc

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for name, proc in self.procs.items():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                print(f"  {name} did not stop in 60 s: killed", flush=True)


# ---- 1. episode -> batch ------------------------------------------------------------------------------------
def batch_latency(settings: Settings, args: argparse.Namespace) -> dict[str, Any]:
    ns = scratch("benchbatch", 6)
    bootstrap(settings, ns, partitions=2)
    topics = Topics(ns, 2)
    services = Services(settings, ns, Path(args.log_dir))
    try:
        services.start("streams", "streams", "--ns", ns, "--log-level", "warn")
        services.start("writer", "consumers.shard_writer", "--ns", ns, "--max-trajectories", str(BATCH),
                       "--max-age-s", str(MAX_AGE_S))
        time.sleep(args.warmup)
        publisher = Publisher(settings, None, **{"linger.ms": 1})
        n = int(args.rate * args.seconds)
        started = time.monotonic()
        for i, event in enumerate(interleaved(n, args.tokens, 512, seed=3, now=time.time())):
            publisher.send(topics.events, event.episode_id.encode(), codec.encode(event))
            ahead = i / args.rate - (time.monotonic() - started)
            if ahead > 0.005:
                time.sleep(ahead)
        publisher.close()
        sent_s = time.monotonic() - started
        tail_ms = int((time.time() - MAX_AGE_S - 1) * 1000)  # episodes ending after it meet a slowing flow
        time.sleep(MAX_AGE_S + 5)
    finally:
        services.stop()
    ended = {}
    for msg in read_topic(settings, topics.scored):
        t = codec.decode(msg.value() or b"", expect=Trajectory)
        ended[t.trajectory_id] = (t.ended_ts, t.group_id)
    group_end: dict[str, int] = {}
    for ts, group in ended.values():
        group_end[group] = max(group_end.get(group, 0), ts)
    own, group, tail = [], [], 0
    for msg in read_topic(settings, topics.batches):
        at = msg.timestamp()[1]
        for tid in codec.decode(msg.value() or b"", expect=BatchManifest).trajectory_ids:
            if tid in ended:
                ts, g = ended[tid]
                if ts > tail_ms:
                    tail += 1
                    continue
                own.append((at - ts) / 1000)
                group.append((at - group_end[g]) / 1000)
    if not own:
        raise RuntimeError(f"no batches in {topics.batches}; see {args.log_dir}/{ns}-*.log")
    return {"events": n, "rate": n / sent_s, "own": own, "group": group, "tail": tail}


# ---- 2. checkpoint -> generating ----------------------------------------------------------------------------
def model_args(model: str) -> list[str]:
    return ["--layers", "4", "--width", "256"] if model == "tiny" else ["--model", model]


def checkpoint_latency(settings: Settings, model: str, args: argparse.Namespace,
                       precision: str = "fp32") -> dict[str, Any]:
    ns = scratch("benchckpt", 6)
    bootstrap(settings, ns, partitions=2)
    topics = Topics(ns, 2)
    pretrained = model != "tiny"
    updates = args.pretrained_updates if pretrained else args.updates
    batch = 8 if pretrained else BATCH
    spec = model_args(model)
    services = Services(settings, ns, Path(args.log_dir))
    try:
        services.start("streams", "streams", "--ns", ns, "--log-level", "warn")
        services.start("writer", "consumers.shard_writer", "--ns", ns, "--max-trajectories", str(batch),
                       "--max-age-s", "1")
        learner = services.start(
            "learner", "learner", "--ns", ns, "--algorithm", "sft", "--lr", "1e-4", "--max-updates", str(updates),
            "--updates-per-checkpoint", "1", "--keep-last", "2", "--cache-dir", tempfile.mkdtemp(),
            *(["--micro-batch-tokens", "2048"] if pretrained else []),
            *(["--broadcast-bf16"] if precision == "bf16" else []), *spec)
        services.start("demonstrations", "producers", "--ns", ns, "--sources", "reverse", "--demonstrations",
                       str(batch * updates * 2), "--producer-id", "demonstrations", *spec)
        services.start("worker", "producers", "--ns", ns, "--sources", "reverse", "--group-size", "4",
                       "--prompts-per-step", "1" if pretrained else "8", "--max-new-tokens", "8",
                       "--max-policy-lag", "1000000", "--producer-id", "worker", *spec)
        try:
            learner.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"  {model}: the learner did not finish {updates} updates in {args.timeout:.0f} s", flush=True)
        time.sleep(args.settle)  # the worker reaches a step boundary with the last version and publishes it
    finally:
        services.stop()
    announced = [codec.decode(m.value() or b"", expect=CheckpointPublished) for m in read_topic(settings,
                                                                                              topics.checkpoints)]
    loaded: dict[int, float] = {}
    moved = {"rollout/checkpoint_bytes": 0.0, "rollout/checkpoints_loaded": 0.0}  # the worker's newest totals
    for msg in read_topic(settings, topics.metrics):
        m = codec.decode(msg.value() or b"", expect=PipelineMetric)
        if m.name == "rollout/checkpoint_latency_s":
            loaded.setdefault(int(m.labels["version"]), m.value)
        elif m.name in moved and m.labels.get("producer") == "worker":
            moved[m.name] = max(moved[m.name], m.value)
    hot = {v: s for v, s in loaded.items() if v > 0}  # v0 is the worker's start-up (it waits for it)
    versions = sorted({a.version for a in announced if a.version > 0})
    if not hot:
        raise RuntimeError(f"{model}: the worker generated with no announced checkpoint after v0; see "
                           f"{args.log_dir}/{ns}-worker.log")
    per_version = moved["rollout/checkpoint_bytes"] / max(1.0, moved["rollout/checkpoints_loaded"])
    return {"model": model, "precision": precision, "announced": len(versions), "loaded": hot,
            "superseded": len([v for v in versions if v not in loaded]), "bytes_per_version": per_version}


# ---- report ---------------------------------------------------------------------------------------------
def plot(batches: Optional[dict[str, Any]], checkpoints: list[dict[str, Any]], path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    if batches is not None:
        top = max(max(batches["own"]), 0.1)
        bins = [top * i / 40 for i in range(41)]
        axes[0].hist(batches["own"], bins=bins, alpha=0.6, label="from the episode's own EpisodeEnded")
        axes[0].hist(batches["group"], bins=bins, alpha=0.6, label="from its group's last EpisodeEnded")
        for q, style in ((0.5, "--"), (0.99, ":")):
            axes[0].axvline(percentile(batches["own"], q), color="k", linestyle=style, label=f"p{int(q * 100)} (own)")
        axes[0].set(title=f"episode ended -> in a batch at {batches['rate']:,.0f} events/s", xlabel="seconds",
                    ylabel="trajectories")
        axes[0].legend(fontsize=8)
    for run in checkpoints:
        axes[1].hist(list(run["loaded"].values()), bins=20, alpha=0.6,
                     label=f"{run['model']}, {run['precision']} ({len(run['loaded'])} versions)")
    axes[1].set(title="checkpoint announced -> generating with it", xlabel="seconds", ylabel="versions")
    if checkpoints:
        axes[1].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rate", type=float, default=2000, help="events/s for the episode -> batch run")
    p.add_argument("--seconds", type=float, default=30, help="how long events are produced")
    p.add_argument("--tokens", type=int, default=64, help="generated tokens per turn")
    p.add_argument("--warmup", type=float, default=10, help="seconds for the services to join before events flow")
    p.add_argument("--models", default="tiny,smollm2-135m", help="models of the checkpoint run (tiny: 4x256)")
    p.add_argument("--updates", type=int, default=40, help="checkpoints of the tiny model")
    p.add_argument("--precisions", default="fp32,bf16",
                   help="weights the worker downloads: fp32, and bf16 (the learner's --broadcast-bf16)")
    p.add_argument("--pretrained-updates", type=int, default=5, help="checkpoints of a pretrained model")
    p.add_argument("--settle", type=float, default=10, help="seconds the worker runs after the last checkpoint")
    p.add_argument("--timeout", type=float, default=900, help="seconds a learner may take for its updates")
    p.add_argument("--log-dir", default="/tmp")
    p.add_argument("--skip-batches", action="store_true")
    args = p.parse_args()
    started = time.monotonic()
    settings = Settings.from_env()
    figures: list[Figure] = []
    batches = None
    if not args.skip_batches:
        batches = batch_latency(settings, args)
        own, group = batches["own"], batches["group"]
        p50, p99 = percentile(own, 0.5), percentile(own, 0.99)
        print(f"episode ended -> in a batch, {len(own)} trajectories of {batches['events']:,} events at "
              f"{batches['rate']:,.0f} events/s ({batches['tail']} that ended in the run's last {MAX_AGE_S + 1:g} s "
              f"left out): p50 {p50:.2f} s, p99 {p99:.2f} s (from the group's last "
              f"EpisodeEnded: p50 {percentile(group, 0.5):.2f} s, p99 {percentile(group, 0.99):.2f} s)", flush=True)
        figures += [Figure(f"episode ended -> in a batch at {batches['rate']:,.0f} events/s, p50", p50, "s",
                           goal=f"≤ {GOAL_BATCH_P50_S:g} s", met=p50 <= GOAL_BATCH_P50_S),
                    Figure("episode ended -> in a batch, p99", p99, "s", goal=f"≤ {GOAL_BATCH_P99_S:g} s",
                           met=p99 <= GOAL_BATCH_P99_S),
                    Figure("group's last episode ended -> in a batch, p99", percentile(group, 0.99), "s")]
    checkpoints = []
    for model in [m for m in args.models.split(",") if m]:
        if model != "tiny" and not (model in PRETRAINED and (pretrained_dir(model) / "config.json").exists()):
            print(f"{model}: skipped, not converted here (python -m learner.pretrained {model})", flush=True)
            continue
        full: Optional[dict[str, Any]] = None
        for precision in [p for p in args.precisions.split(",") if p]:
            run = checkpoint_latency(settings, model, args, precision)
            checkpoints.append(run)
            lat = list(run["loaded"].values())
            p50, p99 = percentile(lat, 0.5), percentile(lat, 0.99)
            goal = GOAL_CHECKPOINT_P50_S.get(model)
            label = model if precision == "fp32" else f"{model}, bf16 broadcast"
            print(f"{label}: checkpoint announced -> generating, {len(lat)} versions (of {run['announced']} "
                  f"announced; {run['superseded']} superseded while an earlier one loaded): p50 {p50:.2f} s, "
                  f"p99 {p99:.2f} s, max {max(lat):.2f} s; {run['bytes_per_version'] / 1e6:.1f} MB downloaded "
                  "per version", flush=True)
            versus = full if precision != "fp32" else None  # the float32 run of the same model, just before
            figures += [Figure(f"{label}: checkpoint announced -> generating, p50", p50, "s",
                               ratio=p50 / versus["p50"] if versus else None,
                               baseline="float32 weights" if versus else "",
                               goal=f"≤ {goal:g} s" if goal else "", met=p50 <= goal if goal else None),
                        Figure(f"{label}: checkpoint announced -> generating, p99", p99, "s"),
                        Figure(f"{label}: weights downloaded per version", run["bytes_per_version"] / 1e6, "MB",
                               ratio=run["bytes_per_version"] / versus["bytes"] if versus else None,
                               baseline="float32 weights" if versus else "")]
            if precision == "fp32":
                full = {"p50": p50, "bytes": run["bytes_per_version"]}
    plot(batches, checkpoints, bench_dir() / "latency.png")
    record("bench_latency", f"episode -> batch: the realistic mix at {args.rate:,.0f} events/s for {args.seconds:g} s, "
           f"streams + shard writer ({BATCH} trajectories or {MAX_AGE_S:g} s a batch); checkpoint -> generating: "
           "the learner's SFT updates, one checkpoint each, and a rollout worker", figures, started)


if __name__ == "__main__":
    main()
