"""A memory and process bound for a whole run (every process of it, and the tmpfs pages it writes).

    group = RunCgroup.create(memory_bytes=1 << 30, processes=64)   # None where no cgroup can be made
    argv = group.wrap(argv)                                        # joins the group, then execs argv
    ...run it...
    group.oom_killed()                                             # did the limit kill something?
    group.remove()

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
        return cls(where, tuple(dirs))

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
