"""Fault injection for crash tests: TRAJPIPE_FAULT=point[:n] kills the process at the n-th pass of `point`."""
from __future__ import annotations

import os
import signal
from collections import Counter

POINTS = ("mid_update", "after_save", "after_publish")
_passes: Counter[str] = Counter()


def fault_point(name: str) -> None:
    """SIGKILL this process here when TRAJPIPE_FAULT names this point (and its count is reached)."""
    spec = os.environ.get("TRAJPIPE_FAULT", "")
    if not spec:
        return
    point, _, count = spec.partition(":")
    if point != name:
        return
    _passes[name] += 1
    if _passes[name] >= int(count or 1):
        os.kill(os.getpid(), signal.SIGKILL)
