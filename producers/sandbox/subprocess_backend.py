"""Last-resort backend: a plain child process under rlimits, in a throwaway work dir. It does NOT isolate.

What it guarantees: the limits (wall clock by the host; CPU time, address space, file size and core
dumps by rlimits the harness sets before the program runs), a new session whose whole process group is
killed on timeout and on exit, a temporary cwd, an empty environment and no stdin.

What it cannot do: hide the host. The program sees the host's files with the permissions of its uid and
the host's network. Running as root with an interpreter that an unprivileged uid can reach, each run gets
a throwaway uid (see `identity.py`), which enforces the process limit and keeps it out of 0700 places
such as /root; otherwise it runs as the current user, and as root the process limit is not enforced at
all (`limits_processes` is False). Use bwrap or docker for untrusted code.
"""
from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path

from producers.sandbox import identity
from producers.sandbox.base import PYTHON_FLAGS, RawRun, host_interpreter
from producers.sandbox.process import run_process
from producers.sandbox.results import Limits
from producers.sandbox.workdir import harness_file



@functools.cache
def usable_by_other_uid(python: str) -> bool:
    """Can a fresh unprivileged uid start this interpreter? (No when it lives under /root, for instance.)"""
    uid = identity.fresh_uid()
    try:
        done = subprocess.run([python, *PYTHON_FLAGS, "-c", "pass"], user=uid, group=uid, extra_groups=[],
                              cwd="/", stdin=subprocess.DEVNULL, capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


class SubprocessBackend:
    """Runs the harness as a child process of this one (see the module docstring for what that means)."""

    name = "subprocess"
    isolates_files = False

    def __init__(self, python: str | None = None) -> None:
        self.python = python or host_interpreter()
        self.compiled = self.python == host_interpreter()
        self.drops_privileges = identity.running_as_root() and usable_by_other_uid(self.python)
        self.limits_processes = self.drops_privileges or not identity.running_as_root()
        # Without a fresh uid the uid's other processes count against RLIMIT_NPROC: the harness adds them.
        self.nproc_mode = "relative" if not identity.running_as_root() else "absolute"

    def execute(self, workdir: Path, limits: Limits) -> RawRun:
        uid = identity.fresh_uid() if self.drops_privileges else None
        if uid is not None:
            identity.hand_over(workdir, uid)
        argv = [self.python, *PYTHON_FLAGS, str(workdir / harness_file(os.listdir(workdir))), str(workdir)]
        env = {"PATH": "/usr/bin:/bin", "HOME": str(workdir), "TMPDIR": str(workdir), "LC_ALL": "C.UTF-8"}
        return run_process(argv, cwd=str(workdir), env=env, wall_time_s=limits.wall_time_s,
                           output_bytes=limits.output_bytes, user=uid,
                           cleanup=None if uid is None else functools.partial(identity.kill_all_of, uid))
