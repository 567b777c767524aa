"""Runs one sandbox command as a host process: wall-clock deadline, capped output, whole-group kill."""
from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from producers.sandbox.base import RawRun
from producers.sandbox.spawner import Spawner

CHUNK = 65536
POLL_S = 0.25        # how often a quiet run is checked for having exited
EXIT_GRACE_S = 0.5   # after the program exited, how long a leftover holding its pipes may keep them


@dataclass
class _Capture:
    """One output stream, kept up to `cap` bytes; the rest is read and dropped so the program never blocks."""

    cap: int
    data: bytearray = field(default_factory=bytearray)
    truncated: bool = False

    def add(self, chunk: bytes) -> None:
        room = self.cap - len(self.data)
        if len(chunk) > room:
            self.truncated = True
            chunk = chunk[: max(room, 0)]
        self.data += chunk


def run_process(argv: Sequence[str], *, cwd: str, env: dict[str, str], wall_time_s: float,
                output_bytes: int, user: int | None = None,
                cleanup: Callable[[], None] | None = None, pass_fds: Sequence[int] = (),
                spawner: Spawner | None = None) -> RawRun:
    """Run argv in a new session; on exit or deadline kill its process group and call `cleanup`.
    `pass_fds`: descriptors the child inherits (every other one is closed), at the same numbers.
    `spawner`: start it from there (inside the spawner's cgroup) instead of as a child of this process."""
    try:
        child, streams = _spawn(argv, cwd, env, user, pass_fds) if spawner is None \
            else _spawn_in(spawner, argv, cwd, env, pass_fds)
    except OSError as exc:
        return RawRun(infra_error=f"cannot start {argv[0]}: {exc}")
    out, err = _Capture(output_bytes), _Capture(output_bytes)
    stop = _Stopper(child.pid, cleanup)
    try:
        timed_out = _pump(child, dict(zip(streams, (out, err))), time.monotonic() + wall_time_s, stop)
    finally:
        try:
            stop()
            returncode = child.reap()
        finally:
            for stream in streams:
                os.close(stream)
    return RawRun(returncode=returncode, signal=-returncode if returncode < 0 else None,
                  stdout=bytes(out.data), stderr=bytes(err.data), stdout_truncated=out.truncated,
                  stderr_truncated=err.truncated, timed_out=timed_out)


class _Child(Protocol):
    pid: int

    def exited(self, timeout_s: float = 0.0) -> bool:
        ...

    def reap(self) -> int:
        ...


class _OwnChild:
    """A child of this process, left unreaped until `reap` (WNOWAIT), so its group id stays ours to kill."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.pid = proc.pid

    def exited(self, timeout_s: float = 0.0) -> bool:
        if _exited(self.pid):
            return True
        if timeout_s > 0:
            time.sleep(timeout_s)
        return _exited(self.pid)

    def reap(self) -> int:
        return self.proc.wait()


def _spawn(argv: Sequence[str], cwd: str, env: dict[str, str], user: int | None,
           pass_fds: Sequence[int]) -> tuple[_Child, tuple[int, int]]:
    proc = subprocess.Popen(list(argv), cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            user=user, group=user, extra_groups=None if user is None else [],
                            pass_fds=tuple(pass_fds))
    assert proc.stdout is not None and proc.stderr is not None  # both were asked for as pipes
    streams = (os.dup(proc.stdout.fileno()), os.dup(proc.stderr.fileno()))
    proc.stdout.close()
    proc.stderr.close()
    return _OwnChild(proc), streams


def _spawn_in(spawner: Spawner, argv: Sequence[str], cwd: str, env: dict[str, str],
              pass_fds: Sequence[int]) -> tuple[_Child, tuple[int, int]]:
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    devnull = os.open(os.devnull, os.O_RDONLY)
    try:
        child = spawner.spawn(argv, env=env, cwd=cwd, fds=[devnull, out_w, err_w, *pass_fds],
                              targets=[0, 1, 2, *pass_fds])
    except BaseException:
        os.close(out_r)
        os.close(err_r)
        raise
    finally:
        for fd in (out_w, err_w, devnull):
            os.close(fd)
    return child, (out_r, err_r)


class _Stopper:
    """Kills the run's process group (and whatever `cleanup` reaches) before the leader is reaped.

    Killing before reaping matters: once reaped, the leader's pid (the group id) may belong to a stranger.
    """

    def __init__(self, pid: int, cleanup: Callable[[], None] | None) -> None:
        self._pid = pid
        self._cleanup = cleanup
        self.done = False

    def __call__(self) -> None:
        if self.done:
            return
        self.done = True
        try:
            os.killpg(self._pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self._cleanup is not None:
            self._cleanup()


def _exited(pid: int) -> bool:
    """Has the process exited? Leaves it unreaped (WNOWAIT), so its group id stays ours to kill."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _pump(child: _Child, captures: dict[int, _Capture], deadline: float, stop: _Stopper) -> bool:
    """Read both pipes until they close; True when the deadline passed first (the run is then killed)."""
    grace_end: float | None = None
    with selectors.DefaultSelector() as selector:
        for stream, capture in captures.items():
            selector.register(stream, selectors.EVENT_READ, capture)
        while selector.get_map():
            now = time.monotonic()
            if now >= deadline:
                stop()
                return True
            if grace_end is None and child.exited():
                stop()  # the program is done: what it left running goes with it
                grace_end = now + EXIT_GRACE_S
            if grace_end is not None and now >= grace_end:
                break
            until = deadline if grace_end is None else min(deadline, grace_end)
            for key, _ in selector.select(min(until - now, POLL_S)):
                chunk = os.read(key.fd, CHUNK)
                if chunk:
                    key.data.add(chunk)
                else:
                    selector.unregister(key.fileobj)
    return _wait_until(child, deadline, stop)


def _wait_until(child: _Child, deadline: float, stop: _Stopper) -> bool:
    """Pipes are closed but the program may still run (it closed fds 1 and 2): wait out the deadline."""
    pause = 0.0005
    while not child.exited(pause):
        if time.monotonic() >= deadline:
            stop()
            return True
        pause = min(pause * 2, 0.02)  # usually it exits within a millisecond of closing its pipes
    return False
