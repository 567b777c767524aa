"""Bubblewrap backend: the harness runs in fresh namespaces that see only what Python needs, read-only.

Inside the sandbox the program sees /usr (and the /bin, /lib, /lib64, /sbin links or binds of a
merged-/usr system), the interpreter's install prefix, /etc/ld.so.cache, a private /proc and /dev, a
size-capped tmpfs /tmp, and its work dir /sandbox: another size-capped tmpfs (`Limits.disk_mb`) into which
bwrap copies the job's files. No host directory is writable from inside, so a run cannot fill the host's
disk; the harness hands its report back through a pipe (fd REPORT_FD) that only the judge holds. Nothing
else of the host exists there: no /work, /home, /root (beyond the bound prefix), no /etc/passwd. The root
is remounted read-only. The network namespace is new: only its own loopback, so neither the internet nor
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

from producers.sandbox import cgroups, identity
from producers.sandbox.base import (
    PYTHON_FLAGS,
    SANDBOX_DIR,
    RawRun,
    SandboxUnavailable,
    host_interpreter,
    interpreter_prefix,
)
from producers.sandbox.process import run_process
from producers.sandbox.spawner import SlotPool, SpawnerGone
from producers.sandbox.results import Limits
from producers.sandbox.workdir import JOB_FILES, REPORT_MAX_BYTES, harness_file

ROOT_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64")
ETC_FILES = ("/etc/ld.so.cache",)
PRIVILEGED_NAMESPACES = ("--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
                         "--unshare-cgroup-try", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID")
PROCESS_HEADROOM = 8  # the cgroup's process limit counts bwrap, setpriv and the judge beside the program's
SIGNAL_EXIT_BASE = 128  # bwrap reports a child killed by signal N as exit status 128 + N


class BwrapBackend:
    """Runs the harness under `bwrap` (see the module docstring for the sandbox's contents)."""

    name = "bwrap"
    isolates_files = True
    limits_processes = True
    nproc_mode = "absolute"

    def __init__(self, python: str | None = None, bwrap: str = "bwrap") -> None:
        # A run's memory (all its processes and tmpfs pages) is bounded by a cgroup where one can be made;
        # elsewhere by processes x RLIMIT_AS (Limits.processes x Limits.memory_mb) plus the two tmpfs sizes.
        self.bounds_run_memory = cgroups.unavailable_reason() is None
        found = shutil.which(bwrap)
        if found is None:
            raise SandboxUnavailable("bwrap is not installed (Debian/Ubuntu: apt-get install -y bubblewrap)")
        self.bwrap = found
        self.python = python or host_interpreter()
        self.prefix = interpreter_prefix(self.python)
        self.compiled = self.python == host_interpreter()
        self._slots = SlotPool(self.python)
        self._setpriv = shutil.which("setpriv") if identity.running_as_root() else None
        if identity.running_as_root() and not (self._setpriv or "").startswith("/usr/"):
            raise SandboxUnavailable("bwrap as root needs setpriv (util-linux) under /usr to drop to a sandbox uid")
        if not _visible_inside(self.python, self.prefix):
            raise SandboxUnavailable(f"{self.python} is neither under /usr nor under its prefix {self.prefix}")

    def execute(self, workdir: Path, limits: Limits) -> RawRun:
        uid = identity.fresh_uid() if self._setpriv else None
        inputs = {name: os.open(workdir / name, os.O_RDONLY) for name in JOB_FILES if (workdir / name).exists()}
        report_r, report_w = os.pipe()
        slot = self._slots.acquire(limits.run_memory_bytes, limits.processes + PROCESS_HEADROOM) \
            if self.bounds_run_memory else None
        try:
            raw = run_process(self.argv(inputs, report_w, limits, uid), cwd="/", env={"PATH": "/usr/bin:/bin"},
                              wall_time_s=limits.wall_time_s, output_bytes=limits.output_bytes,
                              pass_fds=(*inputs.values(), report_w),
                              spawner=None if slot is None else slot.spawner)
            os.close(report_w)
            report_w = -1
            raw.report = _read_available(report_r, REPORT_MAX_BYTES)
            raw.oom_killed = slot is not None and slot.group.oom_killed()
        except SpawnerGone as exc:
            if slot is not None:
                slot.close()  # its spawner is gone: the next run gets a fresh slot
                slot = None
            raw = RawRun(infra_error=str(exc))
        finally:
            for fd in (*inputs.values(), report_r, report_w):
                if fd >= 0:
                    os.close(fd)
            if slot is not None:
                self._slots.release(slot)
        return _decode_status(raw)

    def close(self) -> None:
        """Stop the spawners and remove the cgroups kept for later runs (also done at exit)."""
        self._slots.close()

    def argv(self, inputs: dict[str, int], report_fd: int, limits: Limits, uid: int | None) -> list[str]:
        """The full bwrap command line for one run (also handy to read what the sandbox contains).

        `inputs`: the job's files (name -> an fd open on them), copied into the run's tmpfs; `report_fd`:
        where the harness writes its report.
        """
        copies = [arg for name, fd in inputs.items() for arg in ("--perms", "0644", "--file", str(fd),
                                                                 f"{SANDBOX_DIR}/{name}")]
        return [self.bwrap, "--die-with-parent", "--new-session", *self._namespaces(),
                *_system_binds(), *_prefix_binds(self.prefix), *_etc_binds(),
                "--proc", "/proc", "--dev", "/dev",
                "--perms", "1777", "--size", str(limits.file_bytes), "--tmpfs", "/tmp",
                # 0777, not sticky: the judge (the sandbox uid) deletes the nonce and tests bwrap wrote
                "--perms", "0777", "--size", str(limits.disk_bytes), "--tmpfs", SANDBOX_DIR, *copies,
                "--remount-ro", "/", "--chdir", SANDBOX_DIR,
                "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", SANDBOX_DIR,
                "--setenv", "TMPDIR", "/tmp", "--setenv", "LC_ALL", "C.UTF-8",
                *self._drop_privileges(uid),
                self.python, *PYTHON_FLAGS, f"{SANDBOX_DIR}/{harness_file(inputs)}", SANDBOX_DIR, str(report_fd)]

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


def _read_available(fd: int, limit: int) -> bytes | None:
    """What the pipe holds now (its writers are gone), up to limit + 1 bytes; None when empty."""
    os.set_blocking(fd, False)
    chunks, size = [], 0
    while size <= limit:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks) or None


def _decode_status(raw: RawRun) -> RawRun:
    code = raw.returncode
    if raw.signal is None and code is not None and code > SIGNAL_EXIT_BASE:
        number = code - SIGNAL_EXIT_BASE
        if number in signal.valid_signals():
            raw.signal = number
    return raw
