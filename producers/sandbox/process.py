"""Runs one sandbox command as a host process: wall-clock deadline, capped output, whole-group kill."""
from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import IO, Callable, Sequence

from producers.sandbox.base import RawRun

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
                cleanup: Callable[[], None] | None = None, pass_fds: Sequence[int] = ()) -> RawRun:
    """Run argv in a new session; on exit or deadline kill its process group and call `cleanup`.
    `pass_fds`: descriptors the child inherits (every other one is closed)."""
    try:
        proc = subprocess.Popen(list(argv), cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                user=user, group=user, extra_groups=None if user is None else [],
                                pass_fds=tuple(pass_fds))
    except OSError as exc:
        return RawRun(infra_error=f"cannot start {argv[0]}: {exc}")
    assert proc.stdout is not None and proc.stderr is not None  # both were asked for as pipes
    out, err = _Capture(output_bytes), _Capture(output_bytes)
    stop = _Stopper(proc, cleanup)
    try:
        timed_out = _pump(proc, {proc.stdout: out, proc.stderr: err}, time.monotonic() + wall_time_s, stop)
    finally:
        stop()
        proc.wait()
    return RawRun(returncode=proc.returncode, signal=-proc.returncode if proc.returncode < 0 else None,
                  stdout=bytes(out.data), stderr=bytes(err.data), stdout_truncated=out.truncated,
                  stderr_truncated=err.truncated, timed_out=timed_out)


class _Stopper:
    """Kills the run's process group (and whatever `cleanup` reaches) before the leader is reaped.

    Killing before reaping matters: once reaped, the leader's pid (the group id) may belong to a stranger.
    """

    def __init__(self, proc: subprocess.Popen[bytes], cleanup: Callable[[], None] | None) -> None:
        self._proc = proc
        self._cleanup = cleanup
        self.done = False

    def __call__(self) -> None:
        if self.done:
            return
        self.done = True
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
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


def _pump(proc: subprocess.Popen[bytes], captures: dict[IO[bytes], _Capture], deadline: float,
          stop: _Stopper) -> bool:
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
            if grace_end is None and _exited(proc.pid):
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
    return _wait_until(proc, deadline, stop)


def _wait_until(proc: subprocess.Popen[bytes], deadline: float, stop: _Stopper) -> bool:
    """Pipes are closed but the program may still run (it closed fds 1 and 2): wait out the deadline."""
    pause = 0.0005
    while not _exited(proc.pid):
        if time.monotonic() >= deadline:
            stop()
            return True
        time.sleep(pause)
        pause = min(pause * 2, 0.02)  # usually it exits within a millisecond of closing its pipes
    return False
