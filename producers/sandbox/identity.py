"""Throwaway unprivileged uids for sandboxed runs started by root, and how to kill all they left behind.

Root ignores RLIMIT_NPROC, so a fork bomb started as root is not contained by rlimits. When this process
is root, each run gets a fresh random uid from a high range that no account uses: the kernel then counts
that run's processes alone against its limit, the run cannot touch files of other runs (its work dir is
0700 and owned by its uid), and `kill -s KILL -- -1` sent as that uid reaches exactly the run's processes,
including those that left the process group with setsid().
"""
from __future__ import annotations

import os
import random
import subprocess
from pathlib import Path

UID_BASE = 1_600_000_000
UID_SPAN = 1 << 24
SHELL = "/bin/sh"
_random = random.SystemRandom()


def running_as_root() -> bool:
    return os.geteuid() == 0


def fresh_uid() -> int:
    return _random.randrange(UID_BASE, UID_BASE + UID_SPAN)


def hand_over(workdir: Path, uid: int) -> None:
    """Give the work dir and its files to the run's uid: the harness reads and deletes some, writes one."""
    for path in [workdir, *workdir.iterdir()]:
        os.chown(path, uid, uid)


def kill_all_of(uid: int) -> None:
    """SIGKILL every process of a throwaway uid, sent as that uid so no other process can be hit."""
    if not UID_BASE <= uid < UID_BASE + UID_SPAN:
        raise ValueError(f"refusing to kill all processes of uid {uid}: not a throwaway sandbox uid")
    # The shell's builtin kill takes pid -1 after "--"; procps' kill binary refuses it.
    subprocess.run([SHELL, "-c", "kill -s KILL -- -1"], user=uid, group=uid, extra_groups=[], cwd="/",
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   check=False, timeout=10)
