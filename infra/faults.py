"""Fault injection for crash tests: TRAJPIPE_FAULT=point[:n] kills the process at the n-th pass of `point`.

Points: the learner's mid_update, after_save, after_publish; a rollout worker's mid_episode (its step's
EpisodeStarted events are delivered, the rest of the step never is: every episode of the step is orphaned);
the streams worker's wedged_batch (`fault_hit`: its events agent hangs on the n-th batch, as a stuck client
would) and processed_batch (killed after the n-th batch's outputs and metrics are on the broker, before
its offsets can be committed: the batch is processed again after the restart).

Under torchrun, `point:n@rank` fires only in that rank, and a fault fires only in the job's first attempt
(torchrun's restarts, TORCHELASTIC_RESTART_COUNT > 0, run clean): one injected crash, then the recovery.
"""
from __future__ import annotations

import os
import signal
from collections import Counter
from typing import Callable, Optional

POINTS = ("mid_update", "after_save", "after_publish", "mid_episode", "wedged_batch", "processed_batch")
ENV_VAR = "TRAJPIPE_FAULT"
_passes: Counter[str] = Counter()


def fault_point(name: str, before: Optional[Callable[[], None]] = None) -> None:
    """SIGKILL this process here when TRAJPIPE_FAULT names this point (and its count is reached); `before`
    runs first (e.g. a flush, so what was sent until here is delivered)."""
    if fault_hit(name):
        if before is not None:
            before()
        kill()


def kill() -> None:
    """SIGKILL this process: no flush, no commit, no handler runs."""
    os.kill(os.getpid(), signal.SIGKILL)


def fault_hit(name: str) -> bool:
    """True on the n-th pass of `name` when TRAJPIPE_FAULT is `name:n` (n = 1 if omitted), else False."""
    spec = os.environ.get(ENV_VAR, "")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return False
    spec, _, rank = spec.partition("@")
    if rank and os.environ.get("RANK", "0") != rank:
        return False
    point, _, count = spec.partition(":")
    if point != name:
        return False
    _passes[name] += 1
    return _passes[name] == int(count or 1)
