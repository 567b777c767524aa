"""A memory and process bound for a whole run (every process of it, and the tmpfs pages it writes).

    group = RunCgroup.create(memory_bytes=1 << 30, processes=64)   # None where no cgroup can be made
    argv = group.wrap(argv)                                        # joins the group, then execs argv
    ...run it...
    group.oom_killed()                                             # did the limit kill something?
    group.remove()

A backend keeps a group for many runs, one after another (see `spawner.py`): `start_run` sets the bounds
of the next one and notes the OOM count, so one run's OOM kill is never blamed on the next, and `vacate`
waits until every process of the last run is gone.

cgroup v2 when the unified hierarchy at /sys/fs/cgroup (or /sys/fs/cgroup/unified) has the memory and
pids controllers enabled for a child, else v1's memory and pids hierarchies. Creating groups needs write
access to them (root, or a delegated subtree); `unavailable_reason()` says why not.
"""
from __future__ import annotations

import functools
import os
import time
import uuid
from dataclasses import dataclass
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
    memory_bytes: int = 0  # the memory bound last written
    oom_base: int = 0  # the OOM-kill count when the current run started

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
            if where.version == 1 and where.pids is not None:
                pids = where.pids / name
                pids.mkdir()
                dirs.append(pids)
            group = cls(where, tuple(dirs))
            if where.version == 2 and (memory / "memory.swap.max").exists():
                (memory / "memory.swap.max").write_text("0")
            group.start_run(memory_bytes, processes)
        except OSError:
            RunCgroup(where, tuple(dirs)).remove()
            raise
        return group

    def start_run(self, memory_bytes: int, processes: int) -> None:
        """Set the bounds of the next run and note the OOM count.

        The process bound is `processes` above what the empty group still counts: a run's pid namespace
        is torn down after its last process is gone, and the pids controller keeps counting it for a
        second or two. The exact per-run bound is RLIMIT_NPROC of the run's own uid (see the backends);
        this one stops a fork bomb all the same.
        """
        memory = self.dirs[0]
        if memory_bytes != self.memory_bytes:
            if self.layout.version == 2:
                (memory / "memory.max").write_text(str(memory_bytes))
            else:
                self._set_v1_memory(memory, memory_bytes)
        pids = self.dirs[-1] if self.layout.version == 1 else memory
        if (pids / "pids.max").exists():
            (pids / "pids.max").write_text(str(processes + self._pids_counted(pids)))
        self.memory_bytes = memory_bytes
        if self.layout.version == 1:
            (memory / "memory.failcnt").write_text("0")
        self.oom_base = self._oom_count()

    @staticmethod
    def _pids_counted(pids: Path) -> int:
        try:
            return int((pids / "pids.current").read_text())
        except (OSError, ValueError):
            return 0

    @staticmethod
    def _set_v1_memory(memory: Path, memory_bytes: int) -> None:
        """v1 wants memory <= memory+swap at every step: the order of the two writes depends on the way."""
        limit, swap = memory / "memory.limit_in_bytes", memory / "memory.memsw.limit_in_bytes"
        writes = [(limit, memory_bytes), (swap, memory_bytes)]
        try:
            lowering = int(limit.read_text()) > memory_bytes
        except (OSError, ValueError):
            lowering = True
        for path, value in (writes if lowering else writes[::-1]):
            if path is swap and not swap.exists():
                continue
            try:
                path.write_text(str(value))
            except OSError:
                if path is limit:
                    raise
                # no swap accounting: the limit still holds for RAM

    def wrap(self, argv: list[str]) -> list[str]:
        """argv run by a shell that first moves itself into every group of the run (children follow)."""
        procs = [str(d / "cgroup.procs") for d in self.dirs]
        script = 'for p in "$@"; do [ "$p" = -- ] && break; echo $$ > "$p" || exit 125; shift; done; shift; exec "$@"'
        return ["/bin/sh", "-c", script, "sh", *procs, "--", *argv]

    def oom_killed(self) -> bool:
        """Did the limit kill a process of the run started by the last `start_run`?"""
        if self._oom_count() > self.oom_base:
            return True
        if self.layout.version == 1:  # a kernel without the oom_kill line: a failed charge is the sign
            try:
                events = (self.dirs[0] / "memory.oom_control").read_text()
                return "oom_kill" not in events and int((self.dirs[0] / "memory.failcnt").read_text() or 0) > 0
            except (OSError, ValueError):
                return False
        return False

    def _oom_count(self) -> int:
        memory = self.dirs[0]
        try:
            events = (memory / ("memory.events" if self.layout.version == 2 else "memory.oom_control")).read_text()
        except OSError:
            return 0
        counts = dict(line.split() for line in events.splitlines() if len(line.split()) == 2)
        return int(counts.get("oom_kill", "0"))

    def vacate(self, keep: int | None = None, attempts: int = 50) -> bool:
        """Kill what is left of the run and wait (up to a second) until no process but `keep` is in the group."""
        for _ in range(attempts):
            if not any(set(self._members(d)) - {str(keep)} for d in self.dirs):
                return True
            for d in self.dirs:
                self._kill_all(d, keep)
            time.sleep(0.02)
        return False

    @staticmethod
    def _members(d: Path) -> list[str]:
        try:
            return (d / "cgroup.procs").read_text().split()
        except OSError:
            return []

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

    @staticmethod
    def _kill_all(d: Path, keep: int | None = None) -> None:
        for pid in RunCgroup._members(d):
            if pid == str(keep):
                continue
            try:
                os.kill(int(pid), 9)
            except (ProcessLookupError, PermissionError, ValueError):
                pass
