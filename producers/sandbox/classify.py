"""Turns what a backend observed and what the harness reported into one ExecResult outcome.

Precedence, first match wins:
1. infra_error: the backend could not run the program, or the harness never reached the start marker
   (nothing untrusted ran, so the answer is not to blame).
2. A valid harness report (its digest, keyed by the run's nonce, checks out) is trusted as is:
   syntax_error, runtime_error, memory_exceeded, timeout (the player hit the CPU limit), failed or
   passed. Two changes: passed becomes output_truncated when stdout or stderr went over the output
   limit; a player the judge saw killed (it cannot tell the CPU limit's SIGKILL from the memory cgroup's)
   is memory_exceeded when the run's cgroup recorded an OOM kill. A failing or crashing run keeps its
   more specific outcome (that is what the model must fix); its truncated stream still ends with a
   "[truncated ...]" note.
3. No report although the program started: timeout (wall clock, or SIGXCPU / SIGKILL from the CPU
   rlimit), memory_exceeded (the memory cgroup killed it), else runtime_error (it exited, crashed or
   damaged the report before the checks finished).

tests_total is the number of assertions check() executed (a loop of 100 asserts counts 100), but never
fewer than the assert statements in check(): a run cut short does not look like a smaller test.
"""
from __future__ import annotations

import signal
from dataclasses import dataclass

from producers.sandbox.base import RawRun
from producers.sandbox.harness import START_MARKER
from producers.sandbox.results import ExecResult, Limits
from producers.sandbox.workdir import Report

CPU_LIMIT_SIGNALS = (signal.SIGXCPU, signal.SIGKILL)
INFRA_DETAIL_CHARS = 600


@dataclass(frozen=True)
class RunFacts:
    """Everything classification needs besides the raw run and the report."""

    limits: Limits
    assert_count: int
    backend: str
    duration_ms: int


def classify(raw: RawRun, report: Report | None, facts: RunFacts) -> ExecResult:
    started = raw.stdout.startswith(START_MARKER)
    stdout = raw.stdout[len(START_MARKER):] if started else raw.stdout
    outcome, passed, total, note = _decide(raw, report, started, facts)
    limit = facts.limits.output_bytes
    return ExecResult(
        outcome=outcome, tests_passed=passed, tests_total=total,
        stdout=_text(stdout, raw.stdout_truncated, "stdout", limit),
        stderr=_join(_text(raw.stderr, raw.stderr_truncated, "stderr", limit), note),
        duration_ms=facts.duration_ms, backend=facts.backend,
    )


def _decide(raw: RawRun, report: Report | None, started: bool, facts: RunFacts) -> tuple[str, int, int, str]:
    static = facts.assert_count
    if raw.infra_error:
        return "infra_error", 0, static, raw.infra_error
    if report is not None:
        return _from_report(report, raw, static, facts.limits)
    if not started:
        detail = raw.stderr.decode("utf-8", "replace").strip()[-INFRA_DETAIL_CHARS:]
        why = f"the sandbox failed before the program started (status {raw.returncode}): {detail}"
        return "infra_error", 0, static, why
    return _from_status(raw, facts.limits, static)


def _from_report(report: Report, raw: RawRun, static: int, limits: Limits) -> tuple[str, int, int, str]:
    if raw.oom_killed and report.outcome == "timeout":
        return ("memory_exceeded", report.passed, max(report.total, static),
                f"killed: the run's memory limit of {limits.run_memory_mb} MiB exceeded")
    if report.outcome == "passed":
        if raw.stdout_truncated or raw.stderr_truncated:
            return "output_truncated", report.passed, report.total, "the tests passed but the output exceeded the limit"
        return "passed", report.passed, report.total, ""
    return report.outcome, report.passed, max(report.total, static), report.message


def _from_status(raw: RawRun, limits: Limits, static: int) -> tuple[str, int, int, str]:
    if raw.timed_out:
        return "timeout", 0, static, f"timed out: wall-clock limit of {limits.wall_time_s:g} s exceeded"
    if raw.oom_killed:
        return "memory_exceeded", 0, static, f"killed: memory limit of {limits.memory_mb} MiB exceeded"
    if raw.signal in CPU_LIMIT_SIGNALS:
        return "timeout", 0, static, f"killed: CPU-time limit of {limits.cpu_seconds} s exceeded"
    if raw.signal is not None:
        return "runtime_error", 0, static, f"the program was killed by {_signal_name(raw.signal)}"
    return ("runtime_error", 0, static,
            f"the program exited (status {raw.returncode}) before the tests reported a result")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _text(data: bytes, truncated: bool, stream: str, limit: int) -> str:
    text = data.decode("utf-8", "replace")
    return text + f"\n[truncated: {stream} exceeded {limit} bytes]" if truncated else text


def _join(stderr: str, note: str) -> str:
    if not note:
        return stderr
    if stderr and not stderr.endswith("\n"):
        stderr += "\n"
    return stderr + note
