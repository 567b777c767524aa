"""Adapts the sandbox pool to the episode runner: solutions in, SandboxResult bodies out."""
from __future__ import annotations

from typing import Optional, Sequence

from producers.sandbox import Limits, SandboxJob, SandboxPool
from schemas.records import SandboxResult

MAX_TEXT = 4000  # stdout/stderr kept in the event; the full text is not a training signal


class SandboxCodeRunner:
    def __init__(self, backend: Optional[str], workers: int, limits: Optional[Limits] = None) -> None:
        self.pool = SandboxPool(backend, workers=workers, limits=limits or Limits(wall_time_s=10.0))

    @property
    def backend_name(self) -> str:
        return str(getattr(self.pool.backend, "name", type(self.pool.backend).__name__))

    def run_many(self, jobs: Sequence[tuple[str, str, str]]) -> list[SandboxResult]:
        results = self.pool.map(SandboxJob(code, tests, entry) for code, tests, entry in jobs)
        return [SandboxResult(turn=0, outcome=r.outcome, tests_passed=r.tests_passed, tests_total=r.tests_total,
                              stdout=r.stdout[-MAX_TEXT:], stderr=r.stderr[-MAX_TEXT:], duration_ms=r.duration_ms,
                              backend=r.backend) for r in results]

    def close(self) -> None:
        self.pool.close()
