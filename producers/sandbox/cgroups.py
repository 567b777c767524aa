"""A memory and process bound for a whole run (every process of it, and the tmpfs pages it writes).

    group = GROUPS.acquire(memory_bytes=1 << 30, processes=64)     # None where no cgroup can be made
    argv = group.wrap(argv)                                        # joins the group, then execs argv
    ...run it...
    group.oom_killed()                                             # did the limit kill something?
    GROUPS.release(group)                                          # emptied and reset off the run's path

A group is used again by later runs with the same limits once it is empty (what is left of its run killed)
and its counters are reset; one whose run hit its memory limit is removed instead. Removing a group a run
has charged takes about 7 ms here, often waiting for the run's last processes to exit; making and removing
one per run cost a fifth of the sandbox's throughput.

cgroup v2 when the unified hierarchy at /sys/fs/cgroup (or /sys/fs/cgroup/unified) has the memory and
pids controllers enabled for a child, else v1's memory and pids hierarchies. Creating groups needs write
access to them (root, or a delegated subtree); `unavailable_reason()` says why not.
"""
from __future__ import annotations

import atexit
import functools
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path("/sys/fs/cgroup")
PREFIX = "trajpipe-run-"


@dataclass(frozen=True)
class Layout:
    version: int
    memory: Path  # where run groups are made for the memory controller
    pids: Optional[Path]  # and for pids (v1: its own hierarchy; v2: the same directory)


def _v2_base() -> Optional[Path]:
    for base in (ROOT, ROOT / "unified"):
        try:
            controllers = (base / "cgroup.subtree_control").read_text().split()
        except OSError:
            continue
        if "memory" in controllers and os.access(base, os.W_OK):
            return base
    return None


@functools.cache
def layout() -> Optional[Layout]:
    base = _v2_base()
    if base is not None:
        return Layout(2, base, base)
    memory, pids = ROOT / "memory", ROOT / "pids"
    if (memory / "memory.limit_in_bytes").exists() and os.access(memory, os.W_OK):
        return Layout(1, memory, pids if os.access(pids, os.W_OK) else None)
    return None


@functools.cache
def unavailable_reason() -> Optional[str]:
    """None when run groups can be made here (tried once), else why not."""
    if layout() is None:
        return (f"no writable memory cgroup under {ROOT} (cgroup v2 with the memory controller delegated, "
                "or v1's memory hierarchy, as root)")
    try:
        group = RunCgroup.create(64 << 20, 8)
    except OSError as exc:
        return f"cannot make a cgroup: {exc}"
    if group is None:
        return "cannot make a cgroup"
    group.remove()
    return None


@dataclass
class RunCgroup:
    layout: Layout
    dirs: tuple[Path, ...]
    limits: tuple[int, int] = (0, 0)  # (memory bytes, processes)

    @classmethod
    def create(cls, memory_bytes: int, processes: int) -> Optional["RunCgroup"]:
        where = layout()
        if where is None:
            return None
        name = PREFIX + uuid.uuid4().hex[:16]
        memory = where.memory / name
        memory.mkdir()
        dirs = [memory]
        try:
            if where.version == 2:
                (memory / "memory.max").write_text(str(memory_bytes))
                if (memory / "memory.swap.max").exists():
                    (memory / "memory.swap.max").write_text("0")
                if (memory / "pids.max").exists():
                    (memory / "pids.max").write_text(str(processes))
            else:
                (memory / "memory.limit_in_bytes").write_text(str(memory_bytes))
                swap = memory / "memory.memsw.limit_in_bytes"
                if swap.exists():
                    try:
                        swap.write_text(str(memory_bytes))
                    except OSError:
                        pass  # no swap accounting: the limit still holds for RAM
                if where.pids is not None:
                    pids = where.pids / name
                    pids.mkdir()
                    dirs.append(pids)
                    (pids / "pids.max").write_text(str(processes))
        except OSError:
            RunCgroup(where, tuple(dirs)).remove()
            raise
        return cls(where, tuple(dirs), (memory_bytes, processes))

    def wrap(self, argv: list[str]) -> list[str]:
        """argv run by a shell that first moves itself into every group of the run (children follow)."""
        procs = [str(d / "cgroup.procs") for d in self.dirs]
        script = 'for p in "$@"; do [ "$p" = -- ] && break; echo $$ > "$p" || exit 125; shift; done; shift; exec "$@"'
        return ["/bin/sh", "-c", script, "sh", *procs, "--", *argv]

    def oom_killed(self) -> bool:
        memory = self.dirs[0]
        try:
            if self.layout.version == 2:
                events = (memory / "memory.events").read_text()
            else:
                events = (memory / "memory.oom_control").read_text()
                if int((memory / "memory.failcnt").read_text() or 0) > 0 and "oom_kill" not in events:
                    return True
        except OSError:
            return False
        counts = dict(line.split() for line in events.splitlines() if len(line.split()) == 2)
        return int(counts.get("oom_kill", "0")) > 0

    def remove(self) -> None:
        """Remove the groups once their processes are gone (they die with the run: a short wait at most)."""
        for d in self.dirs:
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    self._kill_all(d)
                    time.sleep(0.02)

    def reset(self) -> bool:
        """Empty the group (kill what is left of its run) and zero its counters: True when it can be used
        again, False when it cannot (its run hit the memory limit, or a process would not leave)."""
        if self.oom_killed():
            return False
        for _ in range(50):
            if not any(self._processes(d) for d in self.dirs):
                break
            for d in self.dirs:
                self._kill_all(d)
            time.sleep(0.02)
        else:
            return False
        if self.layout.version == 1:  # v2 has no failure counter to clear (its oom_kill count is checked above)
            try:
                for name in ("memory.failcnt", "memory.max_usage_in_bytes"):
                    (self.dirs[0] / name).write_text("0")
            except OSError:
                return False
        return True

    @staticmethod
    def _processes(d: Path) -> list[str]:
        try:
            return (d / "cgroup.procs").read_text().split()
        except OSError:
            return []

    @staticmethod
    def _kill_all(d: Path) -> None:
        try:
            pids = (d / "cgroup.procs").read_text().split()
        except OSError:
            return
        for pid in pids:
            try:
                os.kill(int(pid), 9)
            except (ProcessLookupError, PermissionError, ValueError):
                pass


@dataclass
class GroupPool:
    """Run groups kept for the next run with the same limits; a released group is reset by a reaper thread."""

    keep: int = 4  # idle groups kept per limits
    _idle: dict[tuple[int, int], list[RunCgroup]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _returned: "queue.SimpleQueue[RunCgroup | threading.Event]" = field(default_factory=queue.SimpleQueue)
    _reaper: Optional[threading.Thread] = None
    _pid: int = field(default_factory=os.getpid)

    def acquire(self, memory_bytes: int, processes: int) -> Optional[RunCgroup]:
        with self._lock:
            self._forget_if_forked()
            idle = self._idle.get((memory_bytes, processes))
            if idle:
                return idle.pop()
        return RunCgroup.create(memory_bytes, processes)

    def release(self, group: RunCgroup) -> None:
        with self._lock:
            self._forget_if_forked()
            if self._reaper is None:
                self._reaper = threading.Thread(target=self._reap, name="cgroup-reaper", daemon=True)
                self._reaper.start()
        self._returned.put(group)

    def idle(self) -> list[RunCgroup]:
        with self._lock:
            return [g for groups in self._idle.values() for g in groups]

    def drain(self, timeout: float = 5.0) -> None:
        """Wait until every released group is reset or removed (tests; close)."""
        if self._reaper is None:
            return
        done = threading.Event()
        self._returned.put(done)
        done.wait(timeout)

    def close(self) -> None:
        """Remove the idle groups (at exit): a group is never left behind by a process that ends normally."""
        if os.getpid() == self._pid:
            self.drain()
        with self._lock:
            groups, self._idle = [g for gs in self._idle.values() for g in gs], {}
        for group in groups:
            group.remove()

    def _reap(self) -> None:
        while True:
            group = self._returned.get()
            if isinstance(group, threading.Event):
                group.set()
            else:
                self._settle(group)

    def _settle(self, group: RunCgroup) -> None:
        if group.reset():
            with self._lock:
                idle = self._idle.setdefault(group.limits, [])
                if len(idle) < self.keep:
                    idle.append(group)
                    return
        group.remove()

    def _forget_if_forked(self) -> None:
        """A forked child must not share its parent's idle groups (two runs in one group) nor its reaper."""
        if os.getpid() != self._pid:
            self._idle, self._reaper, self._pid = {}, None, os.getpid()
            self._returned = queue.SimpleQueue()


GROUPS = GroupPool()
atexit.register(GROUPS.close)
