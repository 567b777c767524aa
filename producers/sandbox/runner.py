"""Runs a HumanEval-style solution against its tests in a sandbox and classifies the result.

    result = run_tests(problem["prompt"] + completion, problem["test"], problem["entry_point"])
    result.outcome, result.tests_passed, result.tests_total, result.stderr  # stderr ends with the feedback

The host instruments check() (trusted test code), writes a job into a fresh work dir, lets the backend
run the harness there (see `harness.py` for the judge / player split), reads back the report signed
with the run's nonce and classifies it (see `classify.py`).
"""
from __future__ import annotations

import time
from typing import Any

from producers.sandbox.assertions import InstrumentedTests, instrument_tests
from producers.sandbox.base import Backend, RawRun
from producers.sandbox.classify import RunFacts, classify
from producers.sandbox.results import ExecResult, Limits
from producers.sandbox.selection import resolve_backend
from producers.sandbox.workdir import job_dir, read_report


def run_tests(solution_code: str, test_code: str, entry_point: str, limits: Limits | None = None,
              backend: str | Backend | None = None) -> ExecResult:
    """Execute `solution_code`, then `test_code`'s check(entry_point), counting each assertion."""
    limits = limits or Limits()
    chosen = resolve_backend(backend)
    started = time.monotonic()
    try:
        tests = instrument_tests(test_code)
    except (SyntaxError, ValueError) as exc:  # the task's tests are broken: not the answer's fault
        raw = RawRun(infra_error=f"the test code cannot be instrumented: {exc}")
        return classify(raw, None, RunFacts(limits, 0, chosen.name, _elapsed_ms(started)))
    job = _job(solution_code, tests, entry_point, limits, chosen)
    with job_dir(job, tests.source, compiled=chosen.compiled) as workdir:
        raw = _execute(chosen, workdir.path, limits)
        report = read_report(workdir, raw.report)
    return classify(raw, report, RunFacts(limits, tests.assert_count, chosen.name, _elapsed_ms(started)))


def _execute(backend: Backend, workdir: Any, limits: Limits) -> RawRun:
    try:
        return backend.execute(workdir, limits)
    except Exception as exc:  # a backend bug or a host failure is never the answer's fault
        return RawRun(infra_error=f"{backend.name} backend failed: {exc.__class__.__name__}: {exc}")


def _job(solution_code: str, tests: InstrumentedTests, entry_point: str, limits: Limits,
         backend: Backend) -> dict[str, Any]:
    return {
        "solution": solution_code, "entry_point": entry_point, "check": tests.function,
        "helpers": list(tests.helpers),
        "limits": {
            "cpu_s": limits.cpu_seconds, "memory_bytes": limits.memory_bytes, "file_bytes": limits.file_bytes,
            "processes": None if backend.nproc_mode == "none" else limits.processes,
            "processes_relative": backend.nproc_mode == "relative",
        },
    }


def _elapsed_ms(started: float) -> int:
    return int((time.monotonic() - started) * 1000)
