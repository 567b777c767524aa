"""The terminal domain's tools, on a repository an episode holds between calls.

    box = Toolbox("bwrap", Limits(wall_time_s=10))
    result = box.call(files, parse_call(turn_text), spec)   # ToolResult: outcome, observation, files, tests
    files = result.files                                      # the repository the next call starts from

The repository lives in the episode (a dict of path -> text, bounded), not on the host's disk: each `run`
starts a fresh sandbox (no network, nothing of the host, a size-capped tmpfs, limits per call) that gets
the files, runs `/bin/sh -c COMMAND` (producers/sandbox/toolbox.py) and hands the files back through its
report pipe; the sandbox and its work dir are gone when the call returns, also when the command crashed
it. `read_file` and `write_file` are data operations on the dict (a written .py file is compiled, never
run, for the syntax check). `run_tests` and `submit` run the task's own tests, never the repository's
copy of them, in the judged test harness (producers/sandbox/harness.py): the repository is bundled into
one program that materialises it in the sandbox and imports the task's module, so the verdict cannot be
forged by the code under test. `submit` ends the episode.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Optional

from producers.sandbox.base import Backend, RawRun
from producers.sandbox.results import Limits
from producers.sandbox.runner import run_tests
from producers.sandbox.selection import resolve_backend
from producers.sandbox.workdir import JobDir, job_dir, read_signed
from schemas.toolcalls import ToolCall

TOOLBOX_SOURCE = Path(__file__).with_name("toolbox.py")
TOOL_HEADER = "trajpipe-tool 1"  # must equal toolbox.REPORT_HEADER
MAX_OBSERVATION = 1500  # characters of a tool's output the policy reads (the rest is cut, and says so)
MAX_OUTPUT = 16 << 10   # bytes of a command's output kept by the sandbox
MAX_REPO_BYTES = 256 << 10
REPORT_MAX_BYTES = 2 << 20


@dataclass(frozen=True)
class ToolResult:
    outcome: str  # a sandbox outcome: passed, failed, syntax_error, runtime_error, timeout, infra_error
    observation: str
    files: dict[str, str]
    tests_passed: int = 0
    tests_total: int = 0
    duration_ms: int = 0
    backend: str = ""
    done: bool = False  # submit: the episode ends here


def bundle(files: Mapping[str, str], module: str) -> str:
    """One program that writes the repository into a fresh directory of the sandbox and imports `module`
    from it (star import: the task's entry point is then a name of the program)."""
    return ("import os, sys, tempfile\n"
            f"_REPO = {dict(files)!r}\n"
            "_ROOT = tempfile.mkdtemp(prefix='repo-')\n"
            "for _path, _text in _REPO.items():\n"
            "    _file = os.path.join(_ROOT, _path)\n"
            "    os.makedirs(os.path.dirname(_file), exist_ok=True)\n"
            "    with open(_file, 'w', encoding='utf-8') as _handle:\n"
            "        _handle.write(_text)\n"
            "os.chdir(_ROOT)\n"
            "sys.path.insert(0, _ROOT)\n"
            f"from {module} import *\n")


def cut(text: str, limit: int = MAX_OBSERVATION) -> str:
    return text if len(text) <= limit else text[:limit] + f"\n[... {len(text) - limit} more characters]"


class Toolbox:
    def __init__(self, backend: str | Backend | None = None, limits: Optional[Limits] = None) -> None:
        self.backend = resolve_backend(backend)
        self.limits = limits or Limits(wall_time_s=10.0)

    def call(self, files: Mapping[str, str], call: ToolCall, spec: Mapping[str, Any]) -> ToolResult:
        started = time.monotonic()
        result = getattr(self, f"_{call.name}")(dict(files), call.arguments, spec)
        return replace(result, duration_ms=int((time.monotonic() - started) * 1000), backend=self.backend.name)

    # ---- the tools ---------------------------------------------------------------------------------
    def _read_file(self, files: dict[str, str], args: dict[str, str], spec: Mapping[str, Any]) -> ToolResult:
        path = args["path"]
        if path not in files:
            return ToolResult("failed", f"read_file: no file {path}; files: {', '.join(sorted(files))}", files)
        return ToolResult("passed", cut(files[path]), files)

    def _write_file(self, files: dict[str, str], args: dict[str, str], spec: Mapping[str, Any]) -> ToolResult:
        path, content = args["path"], args["content"]
        size = sum(len(t.encode()) for p, t in files.items() if p != path) + len(content.encode())
        if size > MAX_REPO_BYTES:
            return ToolResult("failed", f"write_file: the repository would exceed {MAX_REPO_BYTES} bytes", files)
        files[path] = content
        note = f"ok: wrote {path} ({len(content.encode())} bytes)"
        if path.endswith(".py"):
            try:
                compile(content, path, "exec", dont_inherit=True)  # parsed, never run
            except (SyntaxError, ValueError) as exc:
                return ToolResult("syntax_error", f"{note}; syntax error: {exc}", files)
        return ToolResult("passed", note, files)

    def _run(self, files: dict[str, str], args: dict[str, str], spec: Mapping[str, Any]) -> ToolResult:
        command = args["command"]
        limits = self.limits
        job = {"files": files, "command": command, "wall_s": max(1.0, limits.wall_time_s - 1.0),
               "output_cap": MAX_OUTPUT,
               "limits": {"cpu_s": limits.cpu_seconds, "memory_bytes": limits.memory_bytes,
                          "file_bytes": limits.file_bytes,
                          "processes": None if self.backend.nproc_mode == "none" else limits.processes,
                          "processes_base": 1}}
        with job_dir(job, None, TOOLBOX_SOURCE, self.backend.compiled) as workdir:
            raw = self._execute(workdir, limits)
            report = read_tool_report(workdir, raw.report)
        if raw.infra_error:
            return ToolResult("infra_error", f"$ {command}\nthe sandbox failed: {raw.infra_error}", files)
        if report is None:  # the command took the runner down with it (its own fault): the call is lost
            outcome = "timeout" if raw.timed_out else "runtime_error"
            why = "ran out of time" if raw.timed_out else "broke the sandbox (no report)"
            return ToolResult(outcome, f"$ {command}\nthe command {why}; the repository is as before", files)
        status = "timed out" if report["timed_out"] else f"exit {report['exit']}"
        outcome = "timeout" if report["timed_out"] else "passed" if report["exit"] == 0 else "failed"
        dropped = f"\n[{report['files_dropped']} files not kept: too large or not text]" \
            if report["files_dropped"] else ""
        return ToolResult(outcome, cut(f"$ {command}\n{report['output']}") + f"\n[{status}]{dropped}",
                          report["files"])

    def _run_tests(self, files: dict[str, str], args: dict[str, str], spec: Mapping[str, Any]) -> ToolResult:
        result = run_tests(bundle(files, str(spec["module"])), str(spec["tests"]), str(spec["entry_point"]),
                           self.limits, self.backend)
        feedback = result.stderr.strip()
        text = f"tests: {result.tests_passed}/{result.tests_total} passed ({result.outcome})" + \
            (f"\n{cut(feedback)}" if feedback and result.outcome != "passed" else "")
        return ToolResult(result.outcome, text, files, tests_passed=result.tests_passed,
                          tests_total=result.tests_total)

    def _submit(self, files: dict[str, str], args: dict[str, str], spec: Mapping[str, Any]) -> ToolResult:
        tested = self._run_tests(files, args, spec)
        return replace(tested, observation="submitted; " + tested.observation, done=True)

    def _execute(self, workdir: JobDir, limits: Limits) -> RawRun:
        try:
            return self.backend.execute(workdir.path, limits)
        except Exception as exc:  # a backend bug or a host failure is never the command's fault
            return RawRun(infra_error=f"{self.backend.name} backend failed: {exc.__class__.__name__}: {exc}")


def read_tool_report(job: JobDir, piped: Optional[bytes]) -> Optional[dict[str, Any]]:
    """The toolbox's report once its digest matches and its fields have their types, else None."""
    body = read_signed(job, piped, TOOL_HEADER, REPORT_MAX_BYTES)
    if body is None:
        return None
    try:
        report = json.loads(body)
    except ValueError:
        return None
    files = report.get("files") if isinstance(report, dict) else None
    ok = isinstance(files, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()) \
        and isinstance(report.get("output"), str) and isinstance(report.get("timed_out"), bool) \
        and isinstance(report.get("files_dropped"), int) and (report.get("exit") is None or isinstance(report["exit"], int))
    return report if ok else None
