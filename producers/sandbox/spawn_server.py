"""A spawner that lives in a run cgroup and starts each run there: see `spawner.py` for why.

Started by the host as `python -I -S -B spawn_server.py SOCKET_FD GROUP_DIR...`, already a member of the
groups. Standard library only (it cannot import the package: `leave_and_remove` is its own small twin of
`RunCgroup.remove`). One run at a time, in lockstep with the host over a SOCK_SEQPACKET socket:

    host -> spawn {argv, env, cwd, targets} + the run's descriptors (SCM_RIGHTS), fd i to targets[i]
    here -> "pid N"           (or "error WHY" when the fork or the exec failed)
    here -> "exited"          (the run's leader exited; it is left unreaped, so its pid stays the group's)
    host -> "reap"            (after killing what is left of the process group)
    here -> "status S"        (the exit code, or -N for signal N, as subprocess reports it)

When the host goes away (the socket reads empty) during a run, the run's process group is killed; when idle,
the spawner exits. Either way it leaves its groups and removes them. The spawner itself is never the OOM
killer's choice (oom_score_adj -1000); each run starts with the default score again.
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import time

MAX_MESSAGE = 1 << 20
MAX_FDS = 64
EXEC_FAILED = 127


def set_oom_score(value: int) -> None:
    try:
        with open("/proc/self/oom_score_adj", "w") as handle:
            handle.write(str(value))
    except OSError:  # not root: the run's memory limit still holds, only this protection is lost
        pass


def close_all_but(keep: set[int]) -> None:
    start = 0
    for fd in [*sorted(keep), os.sysconf("SC_OPEN_MAX")]:
        if start < fd:  # never an empty range: closerange(0, 0) is close_range(0, UINT_MAX) on 3.11
            os.closerange(start, fd)
        start = fd + 1


def child(request: dict, fds: list[int]) -> None:
    """In the forked child: a new session, the descriptors at their numbers, the default OOM score, exec."""
    try:
        os.setsid()
        targets = [int(t) for t in request["targets"]]
        floor = max(targets + fds) + 1
        staged = [os.dup2(fd, floor + i, inheritable=False) for i, fd in enumerate(fds)]
        for fd, target in zip(staged, targets):
            os.dup2(fd, target, inheritable=True)
        set_oom_score(0)
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        close_all_but(set(targets))
        os.chdir(request["cwd"])
        os.execve(request["argv"][0], request["argv"], request["env"])
    finally:
        os._exit(EXEC_FAILED)


def serve_one(sock: socket.socket, request: dict, fds: list[int]) -> bool:
    """Run one request to its end; False when the host went away."""
    try:
        pid = os.fork()
    except OSError as exc:
        for fd in fds:
            os.close(fd)
        sock.send(f"error cannot fork: {exc}".encode())
        return True
    if pid == 0:
        child(request, fds)
    for fd in fds:
        os.close(fd)
    try:
        sock.send(b"pid %d" % pid)
        host_alive = wait_exited(sock, pid)
        if host_alive:
            sock.send(b"exited")
            host_alive = sock.recv(64) == b"reap"
    except OSError:
        host_alive = False
    if not host_alive:
        kill_group(pid)
    _, status = os.waitpid(pid, 0)
    if host_alive:
        try:
            sock.send(b"status %d" % exit_code(status))
        except OSError:
            return False
    return host_alive


def wait_exited(sock: socket.socket, pid: int) -> bool:
    """Block until the run's leader exits (True) or the host goes away (False)."""
    pidfd = os.pidfd_open(pid)
    try:
        while True:
            ready, _, _ = select.select([pidfd, sock.fileno()], [], [])
            if pidfd in ready:
                return True
            if not sock.recv(64, socket.MSG_PEEK):
                return False
            sock.recv(64)  # nothing else is expected before "exited": drop it
    finally:
        os.close(pidfd)


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def exit_code(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def serve(sock: socket.socket) -> None:
    while True:
        message, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, MAX_FDS)
        if not message:
            for fd in fds:
                os.close(fd)
            return
        if not serve_one(sock, json.loads(message), fds):
            return


def leave_and_remove(groups: list[str]) -> None:
    """Move out of the run groups and remove them, so a host killed -9 leaves none behind (best effort: the
    host removes them too when it closes the slot; under cgroup v2 the parent may refuse members)."""
    for group in groups:
        try:
            with open(os.path.join(os.path.dirname(group), "cgroup.procs"), "w") as handle:
                handle.write(str(os.getpid()))
        except OSError:
            return
    for group in groups:
        for _ in range(50):  # the last run's processes die with its leader, a moment after it
            try:
                os.rmdir(group)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.02)


def main(argv: list[str]) -> None:
    """`spawn_server.py SOCKET_FD [GROUP_DIR ...]`: the groups it was started in."""
    sock = socket.socket(fileno=int(argv[1]))
    set_oom_score(-1000)
    try:
        serve(sock)
    finally:
        leave_and_remove(argv[2:])


if __name__ == "__main__":
    main(sys.argv)
