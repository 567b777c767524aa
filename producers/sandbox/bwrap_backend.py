"""Bubblewrap backend: the harness runs in fresh namespaces that see only what Python needs, read-only.

Inside the sandbox the program sees /usr (and the /bin, /lib, /lib64, /sbin links or binds of a
merged-/usr system), the interpreter's install prefix, /etc/ld.so.cache, a private /proc and /dev, a
size-capped tmpfs /tmp, and the run's work dir at /sandbox, the one writable host directory. Nothing else
of the host exists there: no /work, /home, /root (beyond the bound prefix), no /etc/passwd. The root is
remounted read-only. The network namespace is new: only its own loopback, so neither the internet nor
services listening on the host's loopback are reachable.

As an unprivileged user, `--unshare-all` adds a user namespace; RLIMIT_NPROC set inside it counts that
namespace's processes only. As root (no user namespace, since its uid 0 would still be the host's root,
for which RLIMIT_NPROC does not count), bwrap sets up the mounts and `setpriv` drops to a throwaway uid
with no capabilities and no_new_privs before the interpreter starts. `--die-with-parent` and the pid
namespace mean that killing bwrap's process group on a timeout kills every process of the run.
"""
from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

from producers.sandbox import identity
from producers.sandbox.base import (
    PYTHON_FLAGS,
    SANDBOX_DIR,
    RawRun,
    SandboxUnavailable,
    host_interpreter,
    interpreter_prefix,
)
from producers.sandbox.process import run_process
from producers.sandbox.results import Limits

ROOT_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64")
ETC_FILES = ("/etc/ld.so.cache",)
PRIVILEGED_NAMESPACES = ("--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
                         "--unshare-cgroup-try", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID")
SIGNAL_EXIT_BASE = 128  # bwrap reports a child killed by signal N as exit status 128 + N


class BwrapBackend:
    """Runs the harness under `bwrap` (see the module docstring for the sandbox's contents)."""

    name = "bwrap"
    isolates_files = True
    limits_processes = True
    nproc_mode = "absolute"

    def __init__(self, python: str | None = None, bwrap: str = "bwrap") -> None:
        found = shutil.which(bwrap)
        if found is None:
            raise SandboxUnavailable("bwrap is not installed (Debian/Ubuntu: apt-get install -y bubblewrap)")
        self.bwrap = found
        self.python = python or host_interpreter()
        self.prefix = interpreter_prefix(self.python)
        self._setpriv = shutil.which("setpriv") if identity.running_as_root() else None
        if identity.running_as_root() and not (self._setpriv or "").startswith("/usr/"):
            raise SandboxUnavailable("bwrap as root needs setpriv (util-linux) under /usr to drop to a sandbox uid")
        if not _visible_inside(self.python, self.prefix):
            raise SandboxUnavailable(f"{self.python} is neither under /usr nor under its prefix {self.prefix}")

    def execute(self, workdir: Path, limits: Limits) -> RawRun:
        uid = identity.fresh_uid() if self._setpriv else None
        if uid is not None:
            identity.hand_over(workdir, uid)
        raw = run_process(self.argv(workdir, limits, uid), cwd="/", env={"PATH": "/usr/bin:/bin"},
                          wall_time_s=limits.wall_time_s, output_bytes=limits.output_bytes)
        return _decode_status(raw)

    def argv(self, workdir: Path, limits: Limits, uid: int | None) -> list[str]:
        """The full bwrap command line for one run (also handy to read what the sandbox contains)."""
        return [self.bwrap, "--die-with-parent", "--new-session", *self._namespaces(),
                *_system_binds(), *_prefix_binds(self.prefix), *_etc_binds(),
                "--proc", "/proc", "--dev", "/dev",
                "--perms", "1777", "--size", str(limits.file_bytes), "--tmpfs", "/tmp",
                "--bind", str(workdir), SANDBOX_DIR, "--remount-ro", "/", "--chdir", SANDBOX_DIR,
                "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", SANDBOX_DIR,
                "--setenv", "TMPDIR", "/tmp", "--setenv", "LC_ALL", "C.UTF-8",
                *self._drop_privileges(uid),
                self.python, *PYTHON_FLAGS, f"{SANDBOX_DIR}/harness.py", SANDBOX_DIR]

    def _namespaces(self) -> tuple[str, ...]:
        return PRIVILEGED_NAMESPACES if self._setpriv else ("--unshare-all",)

    def _drop_privileges(self, uid: int | None) -> list[str]:
        if uid is None or self._setpriv is None:
            return []
        return [self._setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
                "--bounding-set=-all", "--no-new-privs", "--"]


def _visible_inside(python: str, prefix: str) -> bool:
    real = os.path.realpath(python)
    return real.startswith("/usr/") or real.startswith(prefix.rstrip("/") + "/")


def _system_binds() -> list[str]:
    """/usr read-only, plus the top-level links (or directories) a merged-/usr system points into it."""
    args = ["--ro-bind", "/usr", "/usr"]
    for path in ROOT_LINKS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


def _prefix_binds(prefix: str) -> list[str]:
    """The interpreter prefix at its own path, its parents created traversable (0755) but empty."""
    if prefix == "/usr" or prefix.startswith("/usr/"):
        return []
    args: list[str] = []
    for parent in reversed(Path(prefix).parents[:-1]):  # outermost first, "/" excluded
        args += ["--perms", "0755", "--dir", str(parent)]
    return args + ["--ro-bind", prefix, prefix]


def _etc_binds() -> list[str]:
    files = [path for path in ETC_FILES if os.path.isfile(path)]
    args = ["--perms", "0755", "--dir", "/etc"] if files else []
    for path in files:
        args += ["--ro-bind", path, path]
    return args


def _decode_status(raw: RawRun) -> RawRun:
    code = raw.returncode
    if raw.signal is None and code is not None and code > SIGNAL_EXIT_BASE:
        number = code - SIGNAL_EXIT_BASE
        if number in signal.valid_signals():
            raw.signal = number
    return raw
