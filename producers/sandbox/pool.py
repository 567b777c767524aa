"""Runs sandbox executions concurrently on a bounded thread pool, from sync or async code.

    with SandboxPool("bwrap", workers=2) as pool:
        results = pool.map([SandboxJob(code, problem["test"], problem["entry_point"]), ...])
        result = await pool.run_tests_async(code, problem["test"], problem["entry_point"])

Threads are enough: each execution spends its time waiting on a child process, not holding the GIL.
"""
from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import Iterable

from producers.sandbox.base import Backend
from producers.sandbox.results import ExecResult, Limits
from producers.sandbox.runner import run_tests
from producers.sandbox.selection import resolve_backend
from schemas.errors import ConfigError


@dataclass(frozen=True)
class SandboxJob:
    """One solution to run against its tests."""

    solution_code: str
    test_code: str
    entry_point: str
    limits: Limits | None = None


class SandboxPool:
    """At most `workers` sandboxed executions at a time on one backend."""

    def __init__(self, backend: str | Backend | None = None, workers: int = 2,
                 limits: Limits | None = None) -> None:
        if workers < 1:
            raise ConfigError(f"SandboxPool needs workers >= 1, got {workers}")
        self.backend = resolve_backend(backend)
        self.workers = workers
        self.limits = limits or Limits()
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox")

    def run_tests(self, solution_code: str, test_code: str, entry_point: str,
                  limits: Limits | None = None) -> ExecResult:
        """Run one job on the pool and wait for it."""
        return self._executor.submit(self._call(SandboxJob(solution_code, test_code, entry_point, limits))).result()

    async def run_tests_async(self, solution_code: str, test_code: str, entry_point: str,
                              limits: Limits | None = None) -> ExecResult:
        """Run one job on the pool without blocking the event loop."""
        job = SandboxJob(solution_code, test_code, entry_point, limits)
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._call(job))

    def map(self, jobs: Iterable[SandboxJob]) -> list[ExecResult]:
        """Run every job, `workers` at a time; results in the order of the jobs."""
        futures = [self._executor.submit(self._call(job)) for job in jobs]
        return [future.result() for future in futures]

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _call(self, job: SandboxJob) -> functools.partial[ExecResult]:
        return functools.partial(run_tests, job.solution_code, job.test_code, job.entry_point,
                                 job.limits or self.limits, self.backend)
