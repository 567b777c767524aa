"""Dedupe memory and upkeep: what a streams worker keeps per closed episode for the dedupe horizon, and what
forgetting it costs.

    python tests/benchmarks/bench_dedupe.py [--markers 200000] [--events-per-episode 4] [--rate 5309]
                                            [--held 1000000]

Measures (tracemalloc) the table entries of N closed-episode markers as the worker keeps them (key bytes and
ClosedEpisode), against the former layout that kept every event id, and scales both to one worker at the
streams benchmark's rate for the default one-hour horizon.

Then a worker (its real Pipeline, tables in memory, no broker) holding `--held` closed-episode markers, one
closed group per 8 of them and 200 open groups: one prune with nothing due and one sweep's look for late
groups, by the worker's index of markers in closing order (streams.expiry) against the former walk of every
entry, which held the event loop for the whole walk.
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from schemas.keys import new_event_id  # noqa: E402
from streams.assembly import ClosedEpisode  # noqa: E402
from streams.grouping import ClosedGroup, GroupState  # noqa: E402
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


def held_pipeline(n: int) -> Any:
    """A worker's pipeline whose tables hold n closed-episode markers, n / 8 closed groups and 200 open ones,
    as a recovery leaves them, indexed; every marker closed just now (none due)."""
    from streams.app import build_app
    from streams.outbox import MemoryOutbox
    from streams.settings import StreamSettings

    app = build_app(StreamSettings(ns="bench", partitions=2), outbox=MemoryOutbox())
    pipeline = app.pipeline  # type: ignore[attr-defined]
    ts = 1_700_000_000_000
    seen, groups = pipeline.tables.seen.table.data, pipeline.tables.groups.table.data
    for i in range(n):
        seen[b"ep-%012d" % i] = ClosedEpisode("completed", ts + i, 3, (), i % 2)
    for i in range(n // 8):
        groups[b"g-%012d" % i] = ClosedGroup(ts + i, tuple(f"traj-{i}-{j}" for j in range(8)), False, i % 2)
    for i in range(200):
        groups[b"open-%03d" % i] = GroupState(f"open-{i}", 8, ts, i % 2)
    pipeline.index()
    return pipeline


def former_prune(pipeline: Any) -> None:
    """The walk the worker did every 30 sweeps before it kept its markers in closing order."""
    horizon, now = pipeline.settings.dedupe_horizon_s * 1000, time.monotonic()
    for key, closed in pipeline.tables.seen.items():
        if pipeline.event_time.age_ms(closed.partition, closed.closed_ts, now - closed.since) > horizon:
            pipeline.tables.seen.delete(pipeline.outbox, closed.partition, key)
    for key, group in pipeline.tables.groups.items():
        if isinstance(group, ClosedGroup) and \
                pipeline.trajectory_time.age_ms(group.partition, group.closed_ts, now - group.since) > horizon:
            pipeline.tables.groups.delete(pipeline.outbox, group.partition, key)


def former_late_groups(pipeline: Any) -> list[Any]:
    """The walk every sweep (each second) did to find the groups past their timeout."""
    now = time.monotonic()
    return [(key, group) for key, group in pipeline.tables.groups.items() if isinstance(group, GroupState)
            and now - group.since > pipeline.settings.group_timeout_s]


def timed(fn: Callable[[], Any], repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--markers", type=int, default=200_000)
    p.add_argument("--events-per-episode", type=int, default=4, help="the streams benchmark's mix averages 4")
    p.add_argument("--rate", type=float, default=5309.0, help="events/s (bench_streams.py on 2 cores)")
    p.add_argument("--horizon-s", type=float, default=3600.0)
    p.add_argument("--held", type=int, default=1_000_000, help="closed-episode markers the worker holds")
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

    pipeline = held_pipeline(a.held)
    started = time.perf_counter()
    pipeline.index()
    index_s = time.perf_counter() - started
    walk_s, prune_s = timed(lambda: former_prune(pipeline)), timed(pipeline.prune)
    late_walk_s, late_s = timed(lambda: former_late_groups(pipeline)), timed(pipeline._open_groups)
    assert len(pipeline.closed_episodes) == a.held and len(pipeline.open_groups) == 200  # nothing was due
    print(f"a worker holding {a.held:,} closed-episode markers ({a.held / (a.rate / k):,.0f} s at {a.rate:,.0f} "
          f"events/s), {a.held // 8:,} closed groups, 200 open:")
    print(f"  prune (every 30 sweeps), nothing due: former walk {walk_s * 1000:9.1f} ms, in closing order "
          f"{prune_s * 1000:7.3f} ms")
    print(f"  late groups (every sweep):            former walk {late_walk_s * 1000:9.1f} ms, by the index "
          f"{late_s * 1000:7.3f} ms")
    print(f"  indexing after a recovery or rebalance (once): {index_s * 1000:.0f} ms")
    record("bench_dedupe", f"closed-episode markers for a {a.horizon_s / 3600:.0f} h dedupe horizon, {k} events an "
           f"episode, at {a.rate:,.0f} events/s; a worker holding {a.held:,} of them", [
               Figure("bytes per closed episode", now, "B", now / former, "every event id kept"),
               Figure("memory per worker for the horizon", now * episodes / 2**30, "GiB"),
               Figure("forgetting, nothing due: the former walk of every entry", walk_s * 1000, "ms"),
               Figure("forgetting, nothing due: markers in closing order", prune_s * 1000, "ms"),
               Figure("a sweep's look for late groups: the former walk", late_walk_s * 1000, "ms"),
               Figure("a sweep's look for late groups: the open groups' index", late_s * 1000, "ms"),
               Figure("indexing the tables after a recovery or rebalance", index_s * 1000, "ms"),
           ])


if __name__ == "__main__":
    main()
