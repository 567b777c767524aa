"""Adapts the sandbox pool to the episode runner: solutions in, SandboxResult bodies out; tool calls of the
terminal domain in, ToolResults out."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping, Optional, Sequence

from producers.sandbox import Limits, SandboxJob, SandboxPool
from producers.sandbox.tools import Toolbox, ToolResult
from schemas.errors import PipelineError
from schemas.records import SandboxResult
from schemas.toolcalls import ToolCall

ToolJob = tuple[Mapping[str, str], ToolCall, Mapping[str, Any]]  # the repository, the call, the task spec

MAX_TEXT = 4000  # stdout/stderr kept in the event; the full text is not a training signal


class SandboxCodeRunner:
    def __init__(self, backend: Optional[str], workers: int, limits: Optional[Limits] = None) -> None:
        self.pool = SandboxPool(backend, workers=workers, limits=limits or Limits(wall_time_s=10.0))
        self.toolbox = Toolbox(self.pool.backend, self.pool.limits)
        self._tools = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tools")

    @property
    def backend_name(self) -> str:
        return str(getattr(self.pool.backend, "name", type(self.pool.backend).__name__))

    def run_many(self, jobs: Sequence[tuple[str, str, str]]) -> list[SandboxResult]:
        results = self.pool.map(SandboxJob(code, tests, entry) for code, tests, entry in jobs)
        return [SandboxResult(turn=0, outcome=r.outcome, tests_passed=r.tests_passed, tests_total=r.tests_total,
                              stdout=r.stdout[-MAX_TEXT:], stderr=r.stderr[-MAX_TEXT:], duration_ms=r.duration_ms,
                              backend=r.backend) for r in results]

    def run_tools(self, jobs: Sequence[ToolJob]) -> list[ToolResult]:
        """Each episode's call on its own repository, `workers` at a time; results in the order of the jobs."""
        return list(self._tools.map(lambda job: self.toolbox.call(*job), jobs))

    def close(self) -> None:
        self._tools.shutdown(wait=True)
        self.pool.close()


class NoCodeRunner:
    """The code runner of a worker whose task mix has no code tasks: it never starts a sandbox."""

    backend_name = "none"

    def run_many(self, jobs: Sequence[tuple[str, str, str]]) -> list[SandboxResult]:
        raise PipelineError("this worker was started without code tasks, so without a sandbox")

    def run_tools(self, jobs: Sequence[ToolJob]) -> list[ToolResult]:
        raise PipelineError("this worker was started without terminal tasks, so without a sandbox")

    def close(self) -> None:
        pass
