"""Dedupe memory: what a streams worker keeps per closed episode for the dedupe horizon.

    python tests/benchmarks/bench_dedupe.py [--markers 200000] [--events-per-episode 4] [--rate 5309]

Measures (tracemalloc) the table entries of N closed-episode markers as the worker keeps them (key bytes and
ClosedEpisode), against the former layout that kept every event id, and scales both to one worker at the
streams benchmark's rate for the default one-hour horizon.
"""
from __future__ import annotations

import argparse
import gc
import sys
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from schemas.keys import new_event_id  # noqa: E402
from streams.assembly import ClosedEpisode  # noqa: E402
from tests.benchmarks.report import Figure, record  # noqa: E402


@dataclass(frozen=True)
class FormerMarker:  # the layout before markers were bounded per episode
    status: str
    closed_ts: int
    event_ids: tuple[str, ...]
    partition: int = 0


def measure(n: int, make: Callable[[int], Any]) -> float:
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    table = {("ep-" + new_event_id()).encode(): make(i) for i in range(n)}
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert len(table) == n
    return used / n


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--markers", type=int, default=200_000)
    p.add_argument("--events-per-episode", type=int, default=4, help="the streams benchmark's mix averages 4")
    p.add_argument("--rate", type=float, default=5309.0, help="events/s (bench_streams.py on 2 cores)")
    p.add_argument("--horizon-s", type=float, default=3600.0)
    a = p.parse_args()
    k = a.events_per_episode
    former = measure(a.markers, lambda i: FormerMarker("completed", 1_700_000_000_000 + i,
                                                       tuple(new_event_id() for _ in range(k)), i % 2))
    now = measure(a.markers, lambda i: ClosedEpisode("completed", 1_700_000_000_000 + i, k - 1, (), i % 2))
    episodes = a.rate / k * a.horizon_s
    print(f"closed-episode markers, {k} events an episode, {a.markers} measured")
    print(f"  former (every event id): {former:7.0f} B/episode -> {former * episodes / 2**30:5.2f} GiB per worker "
          f"for {a.horizon_s / 3600:.0f} h at {a.rate:.0f} events/s")
    print(f"  now (seq range):         {now:7.0f} B/episode -> {now * episodes / 2**30:5.2f} GiB per worker "
          f"({former / now:.1f}x less)")
    record("bench_dedupe", f"closed-episode markers for a {a.horizon_s / 3600:.0f} h dedupe horizon, {k} events an "
           f"episode, at {a.rate:,.0f} events/s", [
               Figure("bytes per closed episode", now, "B", now / former, "every event id kept"),
               Figure("memory per worker for the horizon", now * episodes / 2**30, "GiB"),
           ])


if __name__ == "__main__":
    main()
