"""Rollout benchmark: episodes/s and generated tokens/s of the CPU policy, and where the worker's time goes.

    python tests/benchmarks/bench_rollout.py [--steps 3]

Runs the real episode runner (policy + sandbox) with events collected in memory, so the figures are
the worker's own cost without the broker.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from producers.episodes import EpisodeRunner  # noqa: E402
from producers.policy import make_backend  # noqa: E402
from producers.sandbox_runner import SandboxCodeRunner  # noqa: E402
from producers.settings import WorkerSettings  # noqa: E402
from producers.tasks import TaskMixer, load_source  # noqa: E402
from schemas.models import tiny_llama_config  # noqa: E402
from schemas.records import RolloutEvent  # noqa: E402
from tests.benchmarks.report import Figure, record  # noqa: E402


def bench(source: str, steps: int, group: int, prompts: int, new_tokens: int, max_turns: int) -> list[Figure]:
    settings = WorkerSettings(ns="bench", producer_id="bench", group_size=group, prompts_per_step=prompts,
                              max_new_tokens=new_tokens, max_turns=max_turns)
    backend = make_backend("transformers", None, seed=0, config=tiny_llama_config())
    code = SandboxCodeRunner(None, workers=2)
    events: list[RolloutEvent] = []
    runner = EpisodeRunner(backend, code, events.append, settings)
    mixer = TaskMixer([load_source(source)], seed=0, curriculum=None)
    episodes = tokens = 0
    gen_s = sandbox_s = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        s = runner.run_step([mixer.next() for _ in range(prompts)])
        episodes, tokens = episodes + s.episodes, tokens + s.tokens
        gen_s, sandbox_s = gen_s + s.generate_s, sandbox_s + s.sandbox_s
    wall = time.perf_counter() - start
    code.close()
    other = wall - gen_s - sandbox_s
    print(f"{source:<10} {episodes:>8} {episodes / wall:>10.2f} {tokens / wall:>10.0f} {tokens / max(gen_s, 1e-9):>12.0f}"
          f" {gen_s / wall:>9.0%} {sandbox_s / wall:>8.0%} {other / wall:>7.0%}  ({len(events)} events, "
          f"backend {code.backend_name})")
    return [Figure(f"{source}: episodes/s", episodes / wall, "episodes/s"),
            Figure(f"{source}: generated tokens/s", tokens / wall, "tokens/s"),
            Figure(f"{source}: waiting on the sandbox", 100 * sandbox_s / wall, f"% of the wall time ({code.backend_name})")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(2)
    print("tiny Llama (4 layers, width 256) on CPU, G=8 samples x 4 prompts per step")
    print(f"{'source':<10} {'episodes':>8} {'ep/s':>10} {'tok/s':>10} {'gen tok/s':>12} {'generate':>9} "
          f"{'sandbox':>8} {'other':>7}")
    started = time.monotonic()
    figures = bench("math-easy", args.steps, 8, 4, 16, 1) + bench("humaneval", args.steps, 8, 4, 64, 2)
    record("bench_rollout", f"episode runner, tiny Llama 4x256 on CPU, G=8 x 4 prompts, {args.steps} steps per source",
           figures, started)


if __name__ == "__main__":
    main()
