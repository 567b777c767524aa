"""End-to-end benchmark: the streaming pipeline (every service a process) versus a synchronous in-process
loop (generate, score, train, repeat) for the same model, tasks and number of updates.

    python tests/benchmarks/bench_e2e.py [--updates 12] [--checker-s 1.0]

Both sides use the same code for each stage (rollout episodes, assembly, reward, group advantages,
GRPO update); the synchronous loop calls it in turn, the pipeline overlaps it across processes.

Two workloads. math-easy: nothing to wait for, every stage is CPU on the same two cores. vowels-remote (the
example environment package, installed for the run): an answer is checked by a remote service before the
second try, a wait of --checker-s that uses no CPU, as a compile farm, a game engine or a judge model costs
the rollout worker. The loop waits for it every step; the pipeline's rollout workers wait while the others
generate and the learner trains.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from infra.bootstrap import bootstrap  # noqa: E402
from infra.kafka import end_offsets  # noqa: E402
from infra.launcher import Launcher  # noqa: E402
from infra.settings import Settings  # noqa: E402
from infra.supervisor import Service  # noqa: E402
from learner.model import build_policy  # noqa: E402
from learner.update import TrainConfig, Trainer  # noqa: E402
from producers.episodes import EpisodeRunner  # noqa: E402
from producers.policy import make_backend  # noqa: E402
from producers.sandbox_runner import SandboxCodeRunner  # noqa: E402
from producers.settings import WorkerSettings  # noqa: E402
from producers.tasks import TaskMixer, load_source  # noqa: E402
from schemas.models import tiny_llama_config  # noqa: E402
from schemas.records import RolloutEvent, SourcePosition, Trajectory  # noqa: E402
from schemas.topics import Topics  # noqa: E402
from streams import assembly, grouping  # noqa: E402
from streams.scoring import Scorer  # noqa: E402
from tests.benchmarks.report import Figure, record, scratch  # noqa: E402
from tests.environment_package import install, on_path  # noqa: E402

GROUP, PROMPTS, NEW_TOKENS, LAYERS, WIDTH, BATCH = 8, 4, 6, 4, 256, 64


@dataclass(frozen=True)
class Workload:
    source: str
    producers: int  # rollout workers of the pipeline
    env: dict[str, str] = field(default_factory=dict)  # for every process (and this one, for the loop)


def remote_checker(checker_s: float) -> Workload:
    """vowels-remote, its package installed into a private directory that every process gets on its path."""
    site = install(Path(tempfile.mkdtemp(prefix="bench-e2e-site-")))
    on_path(site)
    from trajpipe_example_env import CHECKER_S
    # Four rollout workers: they spend most of a step waiting on the checker, which costs no CPU.
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    return Workload("env:vowels-remote", 4, {CHECKER_S: str(checker_s), "PYTHONPATH": path})


def score_events(events: list[RolloutEvent], scorer: Scorer) -> list[Trajectory]:
    """Events -> scored trajectories, in memory: the streams' assembly and reward functions."""
    states: dict[str, assembly.EpisodeState] = {}
    for i, ev in enumerate(events):
        states[ev.episode_id] = assembly.fold(states.get(ev.episode_id), ev, SourcePosition(0, i))
    return [scorer.score(assembly.to_trajectory(s, "memory")) for s in states.values()]


def to_trajectories(events: list[RolloutEvent], scorer: Scorer) -> list[Trajectory]:
    """Scored trajectories with group advantages; zero-variance groups dropped, as the streams do."""
    scored = score_events(events, scorer)
    by_group: dict[str, list[Trajectory]] = defaultdict(list)
    for t in scored:
        by_group[t.group_id].append(t)
    out = []
    for members in by_group.values():
        mean, std, advs = grouping.advantages([t.reward for t in members], 1e-6)
        if std > 0:
            out += [replace(t, advantage=a, group_reward_mean=mean, group_reward_std=std) for t, a in zip(members, advs)]
    return out


def synchronous(updates: int, workload: Workload, prompts: int = PROMPTS) -> dict[str, float]:
    """The loop, `prompts` prompts (of GROUP episodes each) a step."""
    os.environ.update({k: v for k, v in workload.env.items() if k != "PYTHONPATH"})  # this process: sys.path
    settings = WorkerSettings(ns="sync", producer_id="sync", group_size=GROUP, prompts_per_step=prompts,
                              max_new_tokens=NEW_TOKENS, tool_workers=GROUP * prompts)  # one wait a turn
    backend = make_backend("transformers", None, seed=0, config=tiny_llama_config(layers=LAYERS, width=WIDTH))
    code = SandboxCodeRunner(None, workers=2)
    events: list[RolloutEvent] = []
    runner = EpisodeRunner(backend, code, events.append, settings)
    mixer = TaskMixer([load_source(workload.source)], seed=0, curriculum=None)
    trainer = Trainer(build_policy(layers=LAYERS, width=WIDTH, seed=0), TrainConfig(algorithm="grpo", lr=1e-3))
    scorer = Scorer.load("default", "1")
    times: dict[str, float] = defaultdict(float)
    done_at: list[float] = []
    start = time.perf_counter()
    for version in range(updates):
        batch: list[Trajectory] = []
        while len(batch) < BATCH:
            events.clear()
            s = runner.run_step([mixer.next() for _ in range(prompts)])
            times["generate"] += s.generate_s
            times["sandbox"] += s.sandbox_s
            t0 = time.perf_counter()
            batch += to_trajectories(events, scorer)
            times["score"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        trainer.step(batch[:BATCH], current_version=version)
        state = {k: v for k, v in trainer.model.state_dict().items()}
        backend.load_weights(state, version + 1)  # the synchronous loop hands weights over in memory
        times["train"] += time.perf_counter() - t0
        done_at.append(time.perf_counter())
    times["wall"] = time.perf_counter() - start
    times["steady_per_update"] = steady(done_at)
    code.close()
    return dict(times)


def steady(done_at: list[float]) -> float:
    """Seconds per update after the first one: start-up (model load, group joins, first batch) excluded."""
    return (done_at[-1] - done_at[0]) / max(1, len(done_at) - 1)


def watch_updates(proc: subprocess.Popen, done_at: list[float]) -> threading.Thread:  # type: ignore[type-arg]
    """Time each `update N` line the learner logs (its stderr), as it happens."""
    def read() -> None:
        for line in proc.stderr or ():
            if line.startswith("update "):
                done_at.append(time.perf_counter())
    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def pipeline(updates: int, settings: Settings, workload: Workload, *learner_args: str) -> dict[str, float]:
    ns = scratch("bench-e2e-", 6)
    bootstrap(settings, ns, partitions=2)
    # One OpenMP thread per service, as the supervisor starts them (Service.threads): five processes of two
    # threads each on two cores spun against each other, and every stage ran 4-5x slower (x7.4 -> x3.4).
    env = {**os.environ, **settings.as_env(), "OMP_NUM_THREADS": str(Service("bench", []).threads), **workload.env}
    model = ["--layers", str(LAYERS), "--width", str(WIDTH)]
    tmp = tempfile.mkdtemp()
    cmds = {
        "streams": ["streams", "--ns", ns],
        "writer": ["consumers.shard_writer", "--ns", ns, "--max-trajectories", str(BATCH), "--max-age-s", "3"],
        "learner": ["learner", "--ns", ns, "--max-updates", str(updates), "--updates-per-checkpoint", "1",
                    "--lr", "1e-3", "--cache-dir", tmp, *model, *learner_args],
        **{f"producer-{i}": ["producers", "--ns", ns, "--sources", workload.source, "--group-size", str(GROUP),
                             "--prompts-per-step", str(PROMPTS), "--max-new-tokens", str(NEW_TOKENS),
                             "--max-policy-lag", "1", "--max-episodes-per-version", str(BATCH * 3 // 4),
                             "--tool-workers", str(GROUP * PROMPTS), "--producer-id", f"p{i}", "--seed", str(i),
                             *model] for i in range(workload.producers)},
    }
    start = time.perf_counter()
    procs = {n: subprocess.Popen([sys.executable, "-m", *c], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE if n == "learner" else subprocess.DEVNULL, text=True)
             for n, c in cmds.items()}
    done_at: list[float] = []
    reader = watch_updates(procs["learner"], done_at)
    procs["learner"].wait(timeout=1800)
    wall = time.perf_counter() - start
    reader.join(timeout=10)
    learner_out = procs["learner"].stdout.read() if procs["learner"].stdout else ""
    reports = {"learner": json.loads(learner_out.strip().splitlines()[-1])}
    for name, proc in procs.items():
        if name != "learner":
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=120)
            if name.startswith("producer") and out.strip():
                reports[name] = json.loads(out.strip().splitlines()[-1])
    workers = [r for n, r in reports.items() if n.startswith("producer")]
    events = sum(hi - lo for lo, hi in end_offsets(settings, Topics(ns).events).values())
    return {"wall": wall, "generate": sum(w["generate_s"] for w in workers) / len(workers),
            "sandbox": sum(w["sandbox_s"] for w in workers) / len(workers),
            "producer_paused": sum(w["paused_s"] for w in workers) / len(workers),
            "train": reports["learner"]["compute_s"], "learner_waiting": reports["learner"]["wait_s"],
            "checkpoint": reports["learner"]["checkpoint_s"], "publish": reports["learner"]["publish_s"],
            "published_mb": reports["learner"]["published_mb"],
            "events": float(events), "steady_per_update": steady(done_at)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--updates", type=int, default=12)
    p.add_argument("--checker-s", type=float, default=1.0,
                   help="seconds the vowels-remote checker takes to answer (0: that workload is not run)")
    args = p.parse_args()
    started = time.monotonic()
    torch.set_num_threads(2)
    launcher = Launcher()
    launcher.up()
    settings = launcher.settings()
    easy = Workload("math-easy", 2)
    sync = synchronous(args.updates, easy)
    pipe = pipeline(args.updates, settings, easy)
    # Adam's moments in every 4th version only: the versions between are the weights rollout workers load.
    light = pipeline(args.updates, settings, easy, "--moments-every", "4")
    print(f"tiny Llama ({LAYERS} layers, width {WIDTH}), math-easy, G={GROUP}, {BATCH} trajectories per update, "
          f"{args.updates} GRPO updates")
    print(f"synchronous loop: {sync['wall']:.1f}s wall = generate {sync['generate']:.1f}s + sandbox "
          f"{sync['sandbox']:.1f}s + score {sync['score']:.1f}s + train {sync['train']:.1f}s")
    describe(pipe)
    ratio = pipe["steady_per_update"] / sync["steady_per_update"]
    print(f"ratio pipeline/synchronous wall time: {pipe['wall'] / sync['wall']:.2f}; seconds per update after the "
          f"first (start-up excluded): synchronous {sync['steady_per_update']:.2f}, pipeline "
          f"{pipe['steady_per_update']:.2f} (x{ratio:.2f}, goal <= 1.2)")
    light_ratio = light["steady_per_update"] / sync["steady_per_update"]
    print(f"the same pipeline with --moments-every 4 (the optimizer state in every 4th version): "
          f"{light['steady_per_update']:.2f} s per update (x{light_ratio:.2f}); {light['published_mb']:.0f} MB of "
          f"checkpoints stored against {pipe['published_mb']:.0f} MB, in {light['publish']:.1f}s against "
          f"{pipe['publish']:.1f}s; rollout workers paused {light['producer_paused']:.1f}s")
    figures = [
        Figure("synchronous loop, wall", sync["wall"], "s"),
        Figure("streaming pipeline, wall (start-up included)", pipe["wall"], "s", pipe["wall"] / sync["wall"],
               "synchronous"),
        Figure("seconds per update, start-up excluded", pipe["steady_per_update"], "s", ratio,
               "synchronous", "≤ 1.2", ratio <= 1.2),
        Figure("seconds per update, optimizer state in every 4th version (--moments-every 4)",
               light["steady_per_update"], "s", light_ratio, "synchronous", "≤ 1.2", light_ratio <= 1.2),
        Figure("checkpoint bytes stored, --moments-every 4", light["published_mb"], "MB",
               light["published_mb"] / max(pipe["published_mb"], 1e-9), "moments in every version"),
        Figure("learner's time storing and announcing checkpoints, --moments-every 4", light["publish"], "s",
               light["publish"] / max(pipe["publish"], 1e-9), "moments in every version"),
        Figure("learner waiting for data", 100 * pipe["learner_waiting"] / pipe["wall"], "% of the wall time"),
        Figure("rollout worker generating", 100 * pipe["generate"] / pipe["wall"], "% of the wall time"),
    ]
    workload = f"{args.updates} GRPO updates of {BATCH} trajectories, tiny Llama {LAYERS}x{WIDTH}; math-easy"
    if args.checker_s > 0:
        remote = remote_checker(args.checker_s)
        sync_r = synchronous(args.updates, remote)
        # The loop's own way to wait less: as many episodes a step as the pipeline's rollout workers have in flight.
        wide = synchronous(args.updates, remote, PROMPTS * remote.producers)
        pipe_r = pipeline(args.updates, settings, remote)
        ratio_r = pipe_r["steady_per_update"] / sync_r["steady_per_update"]
        ratio_w = pipe_r["steady_per_update"] / wide["steady_per_update"]
        print(f"vowels-remote, its checker answering in {args.checker_s:g} s: synchronous loop {sync_r['wall']:.1f}s "
              f"wall = generate {sync_r['generate']:.1f}s + waiting on the checker {sync_r['sandbox']:.1f}s + score "
              f"{sync_r['score']:.1f}s + train {sync_r['train']:.1f}s; {sync_r['steady_per_update']:.2f} s per update")
        describe(pipe_r)
        print(f"the loop with {PROMPTS * remote.producers} prompts a step: {wide['wall']:.1f}s wall, waiting on the "
              f"checker {wide['sandbox']:.1f}s; {wide['steady_per_update']:.2f} s per update")
        print(f"seconds per update after the first: synchronous {sync_r['steady_per_update']:.2f} "
              f"({PROMPTS * remote.producers} prompts a step: {wide['steady_per_update']:.2f}), pipeline with "
              f"{remote.producers} rollout workers {pipe_r['steady_per_update']:.2f} (x{ratio_r:.2f}; x{ratio_w:.2f})")
        figures += [
            Figure(f"vowels-remote (checker {args.checker_s:g} s): synchronous loop, seconds per update",
                   sync_r["steady_per_update"], "s"),
            Figure(f"vowels-remote: pipeline ({remote.producers} rollout workers), seconds per update",
                   pipe_r["steady_per_update"], "s", ratio_r, "synchronous", "< 1 (overlap pays)", ratio_r < 1),
            Figure(f"vowels-remote: pipeline vs the loop with {PROMPTS * remote.producers} prompts a step",
                   pipe_r["steady_per_update"], "s", ratio_w, f"synchronous, {PROMPTS * remote.producers} prompts a step",
                   "< 1 (overlap pays)", ratio_w < 1),
            Figure("vowels-remote: synchronous loop waiting on the checker", 100 * sync_r["sandbox"] / sync_r["wall"],
                   "% of the wall time"),
            Figure("vowels-remote: pipeline learner waiting for data",
                   100 * pipe_r["learner_waiting"] / pipe_r["wall"], "% of the wall time"),
        ]
        workload += f" and vowels-remote (checker {args.checker_s:g} s)"
    record("bench_e2e", f"{workload}; synchronous in-process loop vs every stage a process", figures, started)


def describe(pipe: dict[str, float]) -> None:
    print(f"streaming pipeline: {pipe['wall']:.1f}s wall (rollout workers, streams, shard writer, learner as "
          f"processes); per worker: generate {pipe['generate']:.1f}s, sandbox and tools {pipe['sandbox']:.1f}s, "
          f"paused {pipe['producer_paused']:.1f}s; learner: train {pipe['train']:.1f}s, checkpoints "
          f"{pipe['checkpoint']:.1f}s in its update loop + {pipe['publish']:.1f}s storing and announcing in the "
          f"background, waiting for data {pipe['learner_waiting']:.1f}s; {pipe['events']:.0f} events")


if __name__ == "__main__":
    main()
