"""Environments: terminal episodes through the episode runner and the bwrap sandbox, and reasoning-gym scoring.

    python tests/benchmarks/bench_environments.py [--episodes 32] [--workers 2] [--rg-trajectories 2000]

Terminal: a scripted policy (run `ls`, read the module, run the tests, the task's fixing call — a write_file,
or one run that rewrites two files —, submit) plays `--episodes` tasks of every family in groups of 4 with `--workers` sandbox workers; prints
episodes/s, tool calls/s, each tool's latency (p50/p99 of the recorded duration_ms), and how the episodes'
wall time splits between generating and waiting on tools (a scripted policy generates in no time: the
split of a real model is its generation time against the tool time measured here). Reasoning-gym: the
default reward (what the streams worker calls per trajectory) on `--rg-trajectories` answers spread over
every dataset, first and second pass (the first re-generates each dataset, the second hits its cache).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from producers.episodes import EpisodeRunner  # noqa: E402
from producers.sandbox import unavailable_reason  # noqa: E402
from producers.sandbox_runner import SandboxCodeRunner  # noqa: E402
from producers.settings import WorkerSettings  # noqa: E402
from producers.tasks.reasoning_gym import ReasoningGymDomain, generators  # noqa: E402
from producers.tasks.terminal import TerminalSource  # noqa: E402
from schemas.records import EpisodeEnded, PolicyTurn, RolloutEvent, SandboxResult  # noqa: E402
from schemas.toolcalls import parse_call  # noqa: E402
from streams.rewards import get_reward_fn  # noqa: E402
from tests.unit.test_rewards import traj, turn  # noqa: E402
from tests.unit.test_terminal import ScriptedPolicy, call  # noqa: E402
from tests.benchmarks.report import Figure, percentile, record  # noqa: E402


def terminal(episodes: int, workers: int) -> list[Figure]:
    source = TerminalSource(seed=11)
    events: list[RolloutEvent] = []
    settings = WorkerSettings(ns="bench", producer_id="bench", group_size=4, prompts_per_step=1,
                              max_new_tokens=4096)
    runner = SandboxCodeRunner("bwrap", workers=workers)
    generate_s = sandbox_s = 0.0
    started = time.perf_counter()
    try:
        for i in range(episodes // 4):
            task = source[i * 7]
            module = next(p for p in task.spec["files"] if p.endswith(".py") and not p.startswith("test_"))
            fix = task.demonstration or ""  # one write_file, or one run that rewrites two files (humaneval-split)
            script = [call("run", command="ls"), call("read_file", path=module), call("run_tests"), fix,
                      call("submit")]
            summary = EpisodeRunner(ScriptedPolicy(script), runner, events.append, settings,
                                    max_context=1 << 16).run_step([task])
            generate_s, sandbox_s = generate_s + summary.generate_s, sandbox_s + summary.sandbox_s
    finally:
        runner.close()
    wall = time.perf_counter() - started
    said = {(e.episode_id, e.body.turn): e.body.text for e in events if isinstance(e.body, PolicyTurn)}
    results = [(parse_call(said[(e.episode_id, e.body.turn)]).name, e.body) for e in events
               if isinstance(e.body, SandboxResult)]
    by_tool: dict[str, list[float]] = defaultdict(list)
    for name, result in results:
        by_tool[name].append(result.duration_ms)
    done = {e.episode_id for e in events if isinstance(e.body, EpisodeEnded)}
    print(f"terminal: {len(done)} episodes, {len(results)} tool calls in {wall:.1f} s with {workers} bwrap workers: "
          f"{len(done) / wall:.2f} episodes/s, {len(results) / wall:.1f} tool calls/s; of the episodes' time "
          f"{sandbox_s / max(wall, 1e-9):.0%} waiting on tools, {generate_s / max(wall, 1e-9):.0%} generating "
          "(scripted)")
    for name, values in sorted(by_tool.items()):
        print(f"  {name:<10} {len(values):>4} calls  p50 {percentile(values, 0.5):6.0f} ms  "
              f"p99 {percentile(values, 0.99):6.0f} ms")
    passed = sum(r.outcome == "passed" for name, r in results if name == "submit")
    print(f"  submits passed: {passed}/{len(done)}")
    return [Figure("terminal episodes/s (scripted policy, 5 tool calls each)", len(done) / wall, "episodes/s"),
            Figure("terminal tool calls/s", len(results) / wall, "calls/s"),
            Figure("run_tests p50", percentile(by_tool["run_tests"], 0.5), "ms"),
            Figure("terminal submits passed", 100 * passed / max(1, len(done)), "% of the episodes")]


def reasoning_gym(n: int) -> list[Figure]:
    score = get_reward_fn("default", "1")
    names = generators()
    items = []
    for i in range(n):
        source = ReasoningGymDomain(names[i % len(names)], seed=0, size=max(8, n // len(names) + 1))
        task = source[i // len(names)]
        answer = task.demonstration if i % 2 == 0 else " 12345"
        items.append(traj(task.domain, task.task_spec, [turn(0, answer or "")]))
    rates = []
    for label in ("first pass (datasets re-generated)", "second pass (cached)"):
        started = time.perf_counter()
        outcomes = [score(t).components["outcome/correct"] for t in items]
        wall = time.perf_counter() - started
        print(f"reasoning-gym scoring, {label}: {len(items)} trajectories over {len(names)} datasets in "
              f"{wall:.2f} s: {len(items) / wall:.0f} trajectories/s (correct: {sum(outcomes):.0f})")
        rates.append(len(items) / wall)
    return [Figure(f"reasoning-gym scoring over {len(names)} datasets, first pass", rates[0], "trajectories/s"),
            Figure("reasoning-gym scoring, datasets cached", rates[1], "trajectories/s", rates[1] / rates[0],
                   "first pass")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rg-trajectories", type=int, default=2000)
    args = p.parse_args()
    started = time.monotonic()
    figures: list[Figure] = []
    reason = unavailable_reason("bwrap")
    if reason:
        print(f"the terminal benchmark needs bwrap: {reason}")
    else:
        figures += terminal(args.episodes, args.workers)
    figures += reasoning_gym(args.rg_trajectories)
    record("bench_environments", f"terminal: {args.episodes} episodes, {args.workers} bwrap workers; reasoning-gym: "
           f"{args.rg_trajectories:,} answers scored", figures, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
