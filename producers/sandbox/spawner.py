"""Runs start inside their cgroup without being moved there: a spawner process per group forks them.

Moving a process into a cgroup (writing its pid to cgroup.procs) takes the kernel's cgroup threadgroup lock
for writing, which waits for an RCU grace period when no move happened in the last moments: about 6 ms per
hierarchy on this host (cgroup v1, memory and pids), 12 ms of a 42 ms HumanEval run, spent waiting, not
computing. A spawner (`spawn_server.py`, a small interpreter started in the group once) forks every run
of the group instead, and a child is born in its parent's cgroups. The spawner runs this package's own
code as the host's user, outside every namespace of the runs; no run's process can reach its socket.

    spawner = Spawner(group, python)
    child = spawner.spawn(argv, env={...}, cwd="/", fds=[devnull, out_w, err_w, 7], targets=[0, 1, 2, 7])
    child.pid; child.exited(timeout_s=0.1); ...; os.killpg(child.pid, SIGKILL); child.reap()  # exit code
"""
from __future__ import annotations

import json
import select
import socket
import subprocess
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from producers.sandbox.base import PYTHON_FLAGS
from producers.sandbox.cgroups import RunCgroup

SERVER = Path(__file__).with_name("spawn_server.py")
REPLY_TIMEOUT_S = 30.0  # a fork and an exec, or a reap: far less unless the host is swapping
SPAWNER_MEMORY_BYTES = 32 << 20  # the spawner's interpreter (about 10 MB) counts in its group: added to the bound


class SpawnerGone(Exception):
    """The spawner broke the protocol or died; the message says what was expected."""


class Spawner:
    """A spawn server started inside `group` (see the module docstring)."""

    def __init__(self, group: RunCgroup, python: str) -> None:
        host, server = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.process = subprocess.Popen(
                group.wrap([python, *PYTHON_FLAGS, str(SERVER), str(server.fileno()), *map(str, group.dirs)]),
                cwd="/", env={"PATH": "/usr/bin:/bin"}, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                start_new_session=True, pass_fds=(server.fileno(),))
        except BaseException:
            host.close()
            raise
        finally:
            server.close()
        self.sock = host
        self.pid = self.process.pid

    def spawn(self, argv: Sequence[str], *, env: dict[str, str], cwd: str, fds: Sequence[int],
              targets: Sequence[int]) -> SpawnedChild:
        """Start argv in a new session with fds[i] at descriptor targets[i] (and no other descriptor)."""
        request = json.dumps({"argv": list(argv), "env": env, "cwd": cwd, "targets": list(targets)})
        try:
            socket.send_fds(self.sock, [request.encode()], list(fds))
            reply = self.receive()
        except OSError as exc:
            raise SpawnerGone(f"the spawner did not take the run: {exc}") from exc
        if reply.startswith(b"error "):
            raise OSError(reply[6:].decode(errors="replace"))
        if not reply.startswith(b"pid "):
            raise SpawnerGone(f"the spawner answered {reply[:80]!r} to a run")
        return SpawnedChild(self, int(reply[4:]))

    def receive(self, timeout_s: float = REPLY_TIMEOUT_S) -> bytes:
        ready, _, _ = select.select([self.sock], [], [], timeout_s)
        if not ready:
            raise SpawnerGone(f"the spawner did not answer within {timeout_s:.0f} s")
        message = self.sock.recv(256)
        if not message:
            raise SpawnerGone("the spawner exited")
        return message

    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        """Hang up (an idle spawner exits on it), then make sure."""
        self.sock.close()
        try:
            self.process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class SpawnedChild:
    """A run started by a spawner: its pid stays reserved (unreaped) until `reap`."""

    def __init__(self, spawner: Spawner, pid: int) -> None:
        self.spawner = spawner
        self.pid = pid
        self._exited = False

    def exited(self, timeout_s: float = 0.0) -> bool:
        """Has the run's leader exited? Waits up to `timeout_s` for it."""
        if not self._exited:
            ready, _, _ = select.select([self.spawner.sock], [], [], timeout_s)
            if ready:
                reply = self.spawner.receive()
                if reply != b"exited":
                    raise SpawnerGone(f"the spawner sent {reply[:80]!r} where 'exited' was due")
                self._exited = True
        return self._exited

    def reap(self) -> int:
        """Wait for the exit, let the spawner reap it; the exit code (-N: killed by signal N)."""
        if not self.exited(REPLY_TIMEOUT_S):
            raise SpawnerGone(f"the run had not exited {REPLY_TIMEOUT_S:.0f} s after it was killed")
        self.spawner.sock.send(b"reap")
        reply = self.spawner.receive()
        if not reply.startswith(b"status "):
            raise SpawnerGone(f"the spawner sent {reply[:80]!r} where a status was due")
        return int(reply[7:])


@dataclass
class Slot:
    """A run cgroup and the spawner that lives in it."""

    group: RunCgroup
    spawner: Spawner

    def close(self) -> None:
        self.spawner.close()
        self.group.remove()


class SlotPool:
    """Slots kept for the next run of one backend: at most as many as ran at once.

    A slot goes back to the pool only once every process of its run is gone (but the spawner); one whose
    spawner died, or whose run left processes that cannot be killed, is removed instead.
    """

    def __init__(self, python: str) -> None:
        self.python = python
        self._idle: list[Slot] = []
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _close_all, self._idle)

    def acquire(self, memory_bytes: int, processes: int) -> Optional[Slot]:
        """A slot bounded as asked (plus the spawner's own memory), with no run in it; None where no
        cgroup can be made."""
        while True:
            with self._lock:
                slot = self._idle.pop() if self._idle else None
            if slot is None:
                return self._make(memory_bytes, processes)
            if slot.spawner.alive():
                try:
                    slot.group.start_run(memory_bytes + SPAWNER_MEMORY_BYTES, processes)
                    return slot
                except OSError:  # the group was removed under us, or refused the bounds
                    pass
            slot.close()  # and a fresh one next

    def _make(self, memory_bytes: int, processes: int) -> Optional[Slot]:
        group = RunCgroup.create(memory_bytes + SPAWNER_MEMORY_BYTES, processes)
        if group is None:
            return None
        try:
            return Slot(group, Spawner(group, self.python))
        except BaseException:
            group.remove()
            raise

    def release(self, slot: Slot) -> None:
        if slot.spawner.alive() and slot.group.vacate(keep=slot.spawner.pid):
            with self._lock:
                self._idle.append(slot)
        else:
            slot.close()

    def close(self) -> None:
        self._finalizer()


def _close_all(slots: list[Slot]) -> None:
    while slots:
        slots.pop().close()
