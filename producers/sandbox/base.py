"""What every sandbox backend provides: the Backend protocol, the raw observation of a run, its errors."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from producers.sandbox.results import Limits
from schemas.errors import PipelineError

# Where the work dir appears inside an isolating sandbox; the subprocess backend uses the host path.
SANDBOX_DIR = "/sandbox"
# Isolated mode (no PYTHON* variables, no user site, no script dir on sys.path), no `site` (the standard
# library only, and about a third of the start-up time; exit() and quit() are then undefined, sys.exit
# works), no .pyc writes.
PYTHON_FLAGS = ("-I", "-S", "-B")


class SandboxUnavailable(PipelineError):
    """A backend was asked for by name but cannot run on this machine; the message says why."""


@dataclass
class RawRun:
    """What a backend observed: exit status, captured output (capped), and why the run stopped."""

    returncode: int | None = None
    signal: int | None = None          # set when the program was killed by a signal
    stdout: bytes = b""
    stderr: bytes = b""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    timed_out: bool = False            # the host's wall clock ran out and killed the run
    oom_killed: bool = False           # a memory cgroup killed it (docker)
    infra_error: str | None = None     # the backend could not run it at all
    report: bytes | None = None        # what the harness wrote to its report pipe (backends that give one)


class Backend(Protocol):
    """Runs `python harness.py WORKDIR` for a prepared work dir under the given limits.

    `isolates_files`: the program cannot see the host's files nor the network.
    `limits_processes`: the process limit is enforced (RLIMIT_NPROC is ignored for root, for instance).
    `nproc_mode`: how the harness sets RLIMIT_NPROC: "absolute" (the limit counts this run only),
    "relative" (the uid's other processes count too, so the harness adds them), or "none" (a cgroup does it).
    `compiled`: the backend's interpreter is this process's own, so the harness goes in as bytecode
    (harness.pyc) and no run compiles it; the backend then runs whichever of the two the work dir holds.
    """

    name: str
    isolates_files: bool
    limits_processes: bool
    nproc_mode: str
    compiled: bool

    def execute(self, workdir: Path, limits: Limits) -> RawRun:
        ...


def host_interpreter() -> str:
    """The base interpreter behind this process (a venv's python is a symlink to it)."""
    return os.path.realpath(sys.executable)


def interpreter_prefix(python: str) -> str:
    """The install prefix of `python`: what an isolating backend must bind for it to start."""
    if python == host_interpreter():
        return os.path.realpath(sys.base_prefix)
    return str(Path(python).resolve().parent.parent)
