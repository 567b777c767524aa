"""End-to-end benchmark: the streaming pipeline (every service a process) versus a synchronous in-process
loop (generate, score, train, repeat) for the same model, tasks and number of updates.

    python tests/benchmarks/bench_e2e.py [--updates 12] [--repeats 3] [--checker-s 1.0] [--tokens 12,24,48,96]

Both sides use the same code for each stage (rollout episodes, assembly, reward, group advantages,
GRPO update); the synchronous loop calls it in turn, the pipeline overlaps it across processes.

Two workloads. math-easy: nothing to wait for, every stage is CPU on the same two cores. vowels-remote (the
example environment package, installed for the run): an answer is checked by a remote service before the
second try, a wait of --checker-s that uses no CPU, as a compile farm, a game engine or a judge model costs
the rollout worker. The loop waits for it every step; the pipeline's rollout workers wait while the others
generate and the learner trains.

Then math-easy again with more generated tokens a turn (--tokens, 6 in the first run): an update's compute
grows with them, what each version costs (store, announce, fetch, load, the path through streams and a
shard) does not. Where that crosses the goal goes to runs/bench/e2e_tokens.png, with where each side's
seconds go.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import matplotlib  # noqa: E402
import torch  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

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
from tests.benchmarks.report import Figure, bench_dir, process_cpu_seconds, record, scratch  # noqa: E402
from tests.environment_package import install, on_path  # noqa: E402

GROUP, PROMPTS, NEW_TOKENS, LAYERS, WIDTH, BATCH = 8, 4, 6, 4, 256, 64
SERVICES = {"producers": "rollout workers", "streams": "streams", "writer": "shard writer", "learner": "learner"}


@dataclass(frozen=True)
class Workload:
    source: str
    producers: int  # rollout workers of the pipeline
    env: dict[str, str] = field(default_factory=dict)  # for every process (and this one, for the loop)
    new_tokens: int = NEW_TOKENS  # generated a turn: the compute an update costs, beside what a version costs


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
                              max_new_tokens=workload.new_tokens, tool_workers=GROUP * prompts)  # one wait a turn
    backend = make_backend("transformers", None, seed=0, config=tiny_llama_config(layers=LAYERS, width=WIDTH))
    code = SandboxCodeRunner(None, workers=2)
    events: list[RolloutEvent] = []
    runner = EpisodeRunner(backend, code, events.append, settings)
    mixer = TaskMixer([load_source(workload.source)], seed=0, curriculum=None)
    trainer = Trainer(build_policy(layers=LAYERS, width=WIDTH, seed=0), TrainConfig(algorithm="grpo", lr=1e-3))
    scorer = Scorer.load("default", "1")
    times: dict[str, float] = defaultdict(float)
    done_at: list[float] = []
    cpu_at_first = 0.0
    start = time.perf_counter()
    for version in range(updates):
        batch: list[Trajectory] = []
        while len(batch) < BATCH:
            events.clear()
            s = runner.run_step([mixer.next() for _ in range(prompts)])
            times["episodes"] += s.episodes
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
        cpu_at_first = cpu_at_first or cpu_seconds_so_far()
    times["wall"] = time.perf_counter() - start
    times["cpu_per_update_loop"] = (cpu_seconds_so_far() - cpu_at_first) / max(1, updates - 1)  # as steady()
    times["steady_per_update"] = steady(done_at)
    code.close()
    return dict(times)


def cpu_seconds_so_far() -> float:
    """This process's CPU time, every thread's (user + system)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def reap(proc: subprocess.Popen, timeout: float) -> float:  # type: ignore[type-arg]
    """Wait for a service to exit; the CPU seconds it used (user + system, all its threads)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return usage.ru_utime + usage.ru_stime
        time.sleep(0.1)
    proc.kill()
    raise TimeoutError(f"{proc.args!r} still running after {timeout:.0f} s")


def steady(done_at: list[float]) -> float:
    """Seconds per update after the first one: start-up (model load, group joins, first batch) excluded."""
    return (done_at[-1] - done_at[0]) / max(1, len(done_at) - 1)


def watch_updates(proc: subprocess.Popen, done_at: list[float], procs: dict[str, subprocess.Popen],  # type: ignore[type-arg]
                  cpu_at_first: dict[str, float]) -> threading.Thread:
    """Time each `update N` line the learner logs (its stderr), as it happens; at the first, every service's CPU
    seconds so far (its start-up), which the steady state leaves out."""
    def read() -> None:
        for line in proc.stderr or ():
            if line.startswith("update "):
                done_at.append(time.perf_counter())
                if not cpu_at_first:
                    cpu_at_first.update({name: process_cpu_seconds(p.pid, children=True) for name, p in procs.items()})
    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def pipeline(updates: int, settings: Settings, workload: Workload, *learner_args: str,
             producer_args: tuple[str, ...] = ()) -> dict[str, float]:
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
                             "--prompts-per-step", str(PROMPTS), "--max-new-tokens", str(workload.new_tokens),
                             "--max-policy-lag", "1", "--max-episodes-per-version", str(BATCH * 3 // 4),
                             "--tool-workers", str(GROUP * PROMPTS), "--producer-id", f"p{i}", "--seed", str(i),
                             *model, *producer_args] for i in range(workload.producers)},
    }
    start = time.perf_counter()
    procs = {n: subprocess.Popen([sys.executable, "-m", *c], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE if n == "learner" else subprocess.DEVNULL, text=True)
             for n, c in cmds.items()}
    done_at: list[float] = []
    cpu_at_first: dict[str, float] = {}
    reader = watch_updates(procs["learner"], done_at, procs, cpu_at_first)
    cpu = {"learner": reap(procs["learner"], 1800)}
    wall = time.perf_counter() - start
    reader.join(timeout=10)
    learner_out = procs["learner"].stdout.read() if procs["learner"].stdout else ""
    reports = {"learner": json.loads(learner_out.strip().splitlines()[-1])}
    for name, proc in procs.items():
        if name != "learner":
            proc.send_signal(signal.SIGTERM)
            out = proc.stdout.read() if proc.stdout else ""  # to its end: the service has closed it, exiting
            cpu[name] = reap(proc, 120)
            if name.startswith("producer") and out.strip():
                reports[name] = json.loads(out.strip().splitlines()[-1])
    workers = [r for n, r in reports.items() if n.startswith("producer")]
    events = sum(hi - lo for lo, hi in end_offsets(settings, Topics(ns).events).values())
    return {"wall": wall, "generate": sum(w["generate_s"] for w in workers) / len(workers),
            "sandbox": sum(w["sandbox_s"] for w in workers) / len(workers),
            "producer_paused": sum(w["paused_s"] for w in workers) / len(workers),
            "episodes": float(sum(w["episodes"] for w in workers)),
            "train": reports["learner"]["compute_s"], "learner_waiting": reports["learner"]["wait_s"],
            "checkpoint": reports["learner"]["checkpoint_s"], "publish": reports["learner"]["publish_s"],
            "published_mb": reports["learner"]["published_mb"],
            **cpu_per_update(cpu, cpu_at_first, len(done_at)),
            "events": float(events), "steady_per_update": steady(done_at)}


def cpu_per_update(cpu: dict[str, float], at_first: dict[str, float], updates: int) -> dict[str, float]:
    """CPU seconds per update after the first, in all ("cpu_per_update") and by kind of service."""
    out: dict[str, float] = defaultdict(float)
    for name, total in cpu.items():
        per_update = (total - at_first.get(name, 0.0)) / max(1, updates - 1)
        kind = name if name in SERVICES else "producers"
        out[f"cpu_per_update_{kind}"] += per_update
        out["cpu_per_update"] += per_update
    return dict(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--updates", type=int, default=12)
    p.add_argument("--repeats", type=int, default=3, help="math-easy measured this many times (median reported)")
    p.add_argument("--checker-s", type=float, default=1.0,
                   help="seconds the vowels-remote checker takes to answer (0: that workload is not run)")
    p.add_argument("--tokens", default="12,24,48,96",
                   help="math-easy again at these numbers of generated tokens a turn (comma-separated; empty: not run)")
    p.add_argument("--sweep-repeats", type=int, default=3, help="repeats of each point of the --tokens sweep")
    args = p.parse_args()
    started = time.monotonic()
    torch.set_num_threads(2)
    launcher = Launcher()
    launcher.up()
    settings = launcher.settings()
    easy = Workload("math-easy", 2)
    runs = []
    for repeat in range(args.repeats):  # the same run scatters by ±30% here: each ratio is within one repeat
        sync = synchronous(args.updates, easy)
        pipe = pipeline(args.updates, settings, easy)
        # Adam's moments in every 4th version only: the versions between are the weights rollout workers load.
        light = pipeline(args.updates, settings, easy, "--moments-every", "4")
        # A second quota in reserve: the workers make the next update's data while the learner trains.
        ahead = pipeline(args.updates, settings, easy, producer_args=("--versions-ahead", "1"))
        # Workers that ignore the learner's demand: past their quota they wait for a version even while the
        # learner is short of batches (the default before demand-following).
        fixed = pipeline(args.updates, settings, easy, producer_args=("--fixed-quota",))
        runs.append((sync, pipe, light, ahead, fixed))
        print(f"math-easy, repeat {repeat + 1}/{args.repeats}: seconds per update synchronous "
              f"{sync['steady_per_update']:.2f}, pipeline {pipe['steady_per_update']:.2f} "
              f"(x{pipe['steady_per_update'] / sync['steady_per_update']:.2f}), --moments-every 4 "
              f"{light['steady_per_update']:.2f} (x{light['steady_per_update'] / sync['steady_per_update']:.2f}), "
              f"--versions-ahead 1 {ahead['steady_per_update']:.2f} "
              f"(x{ahead['steady_per_update'] / sync['steady_per_update']:.2f}), --fixed-quota "
              f"{fixed['steady_per_update']:.2f} (x{fixed['steady_per_update'] / sync['steady_per_update']:.2f})",
              flush=True)
    ratios = sorted(r[1]["steady_per_update"] / r[0]["steady_per_update"] for r in runs)
    light_ratios = sorted(r[2]["steady_per_update"] / r[0]["steady_per_update"] for r in runs)
    ahead_ratios = sorted(r[3]["steady_per_update"] / r[0]["steady_per_update"] for r in runs)
    fixed_ratios = sorted(r[4]["steady_per_update"] / r[0]["steady_per_update"] for r in runs)
    sync, pipe, light, _, _ = next(r for r in runs if r[1]["steady_per_update"] / r[0]["steady_per_update"]
                                == ratios[len(ratios) // 2])  # the median repeat, described in full
    ahead_ratio = ahead_ratios[len(ahead_ratios) // 2]
    ahead = next(r[3] for r in runs if r[3]["steady_per_update"] / r[0]["steady_per_update"] == ahead_ratio)
    fixed_ratio = fixed_ratios[len(fixed_ratios) // 2]
    fixed = next(r[4] for r in runs if r[4]["steady_per_update"] / r[0]["steady_per_update"] == fixed_ratio)
    print(f"tiny Llama ({LAYERS} layers, width {WIDTH}), math-easy, G={GROUP}, {BATCH} trajectories per update, "
          f"{args.updates} GRPO updates")
    print(f"synchronous loop: {sync['wall']:.1f}s wall = generate {sync['generate']:.1f}s + sandbox "
          f"{sync['sandbox']:.1f}s + score {sync['score']:.1f}s + train {sync['train']:.1f}s")
    describe(pipe)
    cpu_ratio = pipe["cpu_per_update"] / sync["cpu_per_update_loop"]
    print(f"CPU seconds per update after the first: synchronous loop {sync['cpu_per_update_loop']:.2f}; pipeline "
          f"{pipe['cpu_per_update']:.2f} (x{cpu_ratio:.2f}) = " + " + ".join(
              f"{label} {pipe['cpu_per_update_' + kind]:.2f}" for kind, label in SERVICES.items()))
    print(f"episodes generated per update: synchronous loop {sync['episodes'] / args.updates:.0f}, pipeline "
          f"{pipe['episodes'] / args.updates:.0f}; the loop drops what a step makes beyond an update's batch")
    ratio, light_ratio = ratios[len(ratios) // 2], light_ratios[len(light_ratios) // 2]
    spread = ", ".join(f"x{r:.2f}" for r in ratios)
    light_spread = ", ".join(f"x{r:.2f}" for r in light_ratios)
    print(f"ratio pipeline/synchronous wall time: {pipe['wall'] / sync['wall']:.2f}; seconds per update after the "
          f"first (start-up excluded): synchronous {sync['steady_per_update']:.2f}, pipeline "
          f"{pipe['steady_per_update']:.2f} (x{ratio:.2f}, goal <= 1.2; the {len(runs)} repeats: {spread})")
    print(f"the same pipeline with --moments-every 4 (the optimizer state in every 4th version): x{light_ratio:.2f} "
          f"(the {len(runs)} repeats: {light_spread}); {light['published_mb']:.0f} MB of "
          f"checkpoints stored against {pipe['published_mb']:.0f} MB, in {light['publish']:.1f}s against "
          f"{pipe['publish']:.1f}s; rollout workers paused {light['producer_paused']:.1f}s")
    ahead_spread = ", ".join(f"x{r:.2f}" for r in ahead_ratios)
    print(f"the same pipeline with --versions-ahead 1 (a second quota in reserve): x{ahead_ratio:.2f} (the "
          f"{len(runs)} repeats: {ahead_spread}); episodes per update {ahead['episodes'] / args.updates:.0f}, "
          f"learner waiting for data {ahead['learner_waiting']:.1f}s, rollout workers paused "
          f"{ahead['producer_paused']:.1f}s")
    fixed_spread = ", ".join(f"x{r:.2f}" for r in fixed_ratios)
    print(f"the same pipeline with --fixed-quota (workers past their quota wait for a version even while the "
          f"learner is short): x{fixed_ratio:.2f} (the {len(runs)} repeats: {fixed_spread}); learner waiting for "
          f"data {fixed['learner_waiting']:.1f}s against {pipe['learner_waiting']:.1f}s, rollout workers paused "
          f"{fixed['producer_paused']:.1f}s against {pipe['producer_paused']:.1f}s, episodes per update "
          f"{fixed['episodes'] / args.updates:.0f} against {pipe['episodes'] / args.updates:.0f}")
    figures = [
        Figure("synchronous loop, wall", sync["wall"], "s"),
        Figure("streaming pipeline, wall (start-up included)", pipe["wall"], "s", pipe["wall"] / sync["wall"],
               "synchronous"),
        Figure(f"seconds per update, start-up excluded (median of {len(runs)} repeats: {spread})",
               pipe["steady_per_update"], "s", ratio, "synchronous", "≤ 1.2", ratio <= 1.2),
        Figure(f"seconds per update, optimizer state in every 4th version (--moments-every 4; {light_spread})",
               light_ratio * sync["steady_per_update"], "s", light_ratio, "synchronous", "≤ 1.2", light_ratio <= 1.2),
        Figure("checkpoint bytes stored, --moments-every 4", light["published_mb"], "MB",
               light["published_mb"] / max(pipe["published_mb"], 1e-9), "moments in every version"),
        Figure("learner's time storing and announcing checkpoints, --moments-every 4", light["publish"], "s",
               light["publish"] / max(pipe["publish"], 1e-9), "moments in every version"),
        Figure("episodes generated per update, pipeline", pipe["episodes"] / args.updates, "episodes",
               pipe["episodes"] / sync["episodes"], "synchronous"),
        Figure(f"seconds per update, workers a quota ahead (--versions-ahead 1; {ahead_spread})",
               ahead_ratio * sync["steady_per_update"], "s", ahead_ratio, "synchronous", "≤ 1.2", ahead_ratio <= 1.2),
        Figure("episodes generated per update, --versions-ahead 1", ahead["episodes"] / args.updates, "episodes",
               ahead["episodes"] / sync["episodes"], "synchronous"),
        Figure("learner waiting for data, --versions-ahead 1", 100 * ahead["learner_waiting"] / ahead["wall"],
               "% of the wall time"),
        Figure(f"seconds per update, workers ignoring the learner's demand (--fixed-quota; {fixed_spread})",
               fixed_ratio * sync["steady_per_update"], "s", fixed_ratio, "synchronous", "≤ 1.2", fixed_ratio <= 1.2),
        Figure("learner waiting for data, --fixed-quota", 100 * fixed["learner_waiting"] / fixed["wall"],
               "% of the wall time"),
        Figure("CPU seconds per update, synchronous loop", sync["cpu_per_update_loop"], "CPU-s"),
        Figure("CPU seconds per update, pipeline", pipe["cpu_per_update"], "CPU-s", cpu_ratio, "synchronous"),
        *(Figure(f"CPU seconds per update, pipeline: {label}", pipe["cpu_per_update_" + kind], "CPU-s",
                 pipe["cpu_per_update_" + kind] / sync["cpu_per_update_loop"], "synchronous")
          for kind, label in SERVICES.items()),
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
    tokens = [int(n) for n in args.tokens.split(",") if n.strip()]
    if tokens:
        points = token_sweep(args.updates, settings, easy, tokens, args.sweep_repeats)
        swept = [SweepPoint(NEW_TOKENS, ratios, sync, pipe), *points]
        plot_sweep(swept, args.updates, bench_dir() / "e2e_tokens.png")
        # Every figure of each point's median repeat, to look at or plot again.
        (bench_dir() / "e2e_tokens.json").write_text(json.dumps([asdict(point) for point in swept], indent=1) + "\n")
        print(f"plot: {bench_dir() / 'e2e_tokens.png'} (its figures: e2e_tokens.json)")
        for point in points:
            spread = ", ".join(f"x{r:.2f}" for r in point.ratios)
            figures += [
                Figure(f"math-easy, {point.tokens} tokens a turn: synchronous loop, seconds per update",
                       point.sync["steady_per_update"], "s"),
                Figure(f"math-easy, {point.tokens} tokens a turn: pipeline, seconds per update (median of "
                       f"{len(point.ratios)}: {spread})", point.pipe["steady_per_update"], "s", point.ratio,
                       "synchronous", "≤ 1.2", point.ratio <= 1.2),
            ]
        workload += "; math-easy again at " + ", ".join(map(str, tokens)) + " tokens a turn"
    record("bench_e2e", f"{workload}; synchronous in-process loop vs every stage a process", figures, started)


@dataclass
class SweepPoint:
    """One number of tokens a turn: each repeat's ratio, and the median repeat's runs."""

    tokens: int
    ratios: list[float]  # the pipeline's seconds per update over the loop's, each repeat, sorted
    sync: dict[str, float]
    pipe: dict[str, float]

    @property
    def ratio(self) -> float:
        return self.ratios[len(self.ratios) // 2]


def token_sweep(updates: int, settings: Settings, base: Workload, tokens: list[int], repeats: int
                ) -> list[SweepPoint]:
    """`base` at each number of generated tokens a turn, the loop and the pipeline taking turns `repeats`
    times: the compute an update costs grows with the tokens, what a version costs (store, announce, fetch,
    load, the path through streams and a shard) does not."""
    def ratio(pair: tuple[dict[str, float], dict[str, float]]) -> float:
        return pair[1]["steady_per_update"] / pair[0]["steady_per_update"]

    points = []
    for n in tokens:
        workload = replace(base, new_tokens=n)
        pairs = sorted(((synchronous(updates, workload), pipeline(updates, settings, workload))
                        for _ in range(repeats)), key=ratio)
        sync, pipe = pairs[len(pairs) // 2]
        point = SweepPoint(n, [ratio(pair) for pair in pairs], sync, pipe)
        points.append(point)
        print(f"{base.source}, {n} tokens a turn: seconds per update synchronous {sync['steady_per_update']:.2f}, "
              f"pipeline {pipe['steady_per_update']:.2f} (x{point.ratio:.2f}; the {repeats} repeats: "
              + ", ".join(f"x{r:.2f}" for r in point.ratios) + ")", flush=True)
        describe(pipe)
    return points


def where_the_seconds_go(sync: dict[str, float], pipe: dict[str, float], updates: int
                         ) -> dict[str, dict[str, float]]:
    """Seconds per update, a run's totals over its updates (start-up included, in "start-up and other"), of
    the loop, the pipeline's learner and an average rollout worker of it."""
    loop = {k: sync[k] / updates for k in ("generate", "sandbox", "score", "train")}
    learner = {"train": pipe["train"] / updates, "checkpoints": pipe["checkpoint"] / updates,
               "waiting for data": pipe["learner_waiting"] / updates}
    worker = {"generate": pipe["generate"] / updates, "sandbox": pipe["sandbox"] / updates,
              "paused": pipe["producer_paused"] / updates}
    for parts, wall in ((loop, sync["wall"]), (learner, pipe["wall"]), (worker, pipe["wall"])):
        parts["start-up and other"] = max(0.0, wall / updates - sum(parts.values()))
    return {"loop": loop, "learner": learner, "rollout worker": worker}


def plot_sweep(points: list[SweepPoint], updates: int, path: Path) -> None:
    """Left: the pipeline's seconds per update over the loop's, against how long the loop's update takes.
    Right: where each side's seconds go, per update, at each number of tokens."""
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
    xs = [p.sync["steady_per_update"] for p in points]
    for p, x in zip(points, xs):
        axes[0].scatter([x] * len(p.ratios), p.ratios, color="tab:blue", alpha=0.4, s=18)
        axes[0].annotate(f"{p.tokens} tokens", (x, p.ratio), textcoords="offset points", xytext=(6, 6), fontsize=8)
    axes[0].plot(xs, [p.ratio for p in points], "o-", color="tab:blue", label="median of the repeats")
    axes[0].axhline(1.2, color="tab:red", linestyle="--", label="goal: ≤ 1.2")
    axes[0].axhline(1.0, color="k", linestyle=":", linewidth=1, label="as fast as the loop")
    axes[0].set(xscale="log", xlabel="the synchronous loop's seconds per update (log)",
                ylabel="pipeline / loop, seconds per update", title="math-easy: more tokens a turn, same batches")
    axes[0].xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    axes[0].xaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    axes[0].legend(fontsize=8)
    colors = {"generate": "tab:green", "sandbox": "tab:olive", "score": "tab:purple", "train": "tab:blue",
              "checkpoints": "tab:orange", "waiting for data": "tab:red", "paused": "tab:gray",
              "start-up and other": "lightgray"}
    labels, seen = [], set()
    for i, p in enumerate(points):
        split = where_the_seconds_go(p.sync, p.pipe, updates)
        for j, ((side, parts), run) in enumerate(zip(split.items(), (p.sync, p.pipe, p.pipe))):
            x, bottom = i * 4 + j, 0.0
            labels.append((x, f"{p.tokens}: {side}"))
            for part, seconds in parts.items():
                axes[1].bar(x, seconds, bottom=bottom, color=colors[part], label=None if part in seen else part)
                seen.add(part)
                bottom += seconds
            axes[1].hlines(run["steady_per_update"], x - 0.4, x + 0.4, color="k", linewidth=2,
                           label=None if "steady" in seen else "seconds per update, start-up excluded")
            seen.add("steady")
    axes[1].set_xticks([x for x, _ in labels], [label for _, label in labels], rotation=60, fontsize=7, ha="right")
    axes[1].set(ylabel="seconds per update (the run's totals / updates)",
                title="where the seconds go (tokens a turn: side)")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def describe(pipe: dict[str, float]) -> None:
    print(f"streaming pipeline: {pipe['wall']:.1f}s wall (rollout workers, streams, shard writer, learner as "
          f"processes); per worker: generate {pipe['generate']:.1f}s, sandbox and tools {pipe['sandbox']:.1f}s, "
          f"paused {pipe['producer_paused']:.1f}s; learner: train {pipe['train']:.1f}s, checkpoints "
          f"{pipe['checkpoint']:.1f}s in its update loop + {pipe['publish']:.1f}s storing and announcing in the "
          f"background, waiting for data {pipe['learner_waiting']:.1f}s; {pipe['events']:.0f} events")


if __name__ == "__main__":
    main()
