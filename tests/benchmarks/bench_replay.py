"""Replay benchmark: N archived events re-scored (decode, fold, reward, encode) vs raw archive reads.

    python tests/benchmarks/bench_replay.py [--events 1000000] [--partitions 4] [--keep]

Synthetic math episodes (EpisodeStarted, PolicyTurn with 64 tokens, EpisodeEnded) are encoded and written
straight into archive objects of a fresh namespace, as the archiver lays them out; then both passes read them
back through consumers.history.ArchiveHistory (object fetch, inflate, Avro container decode). Re-scoring uses
the streams stage's pure functions (streams.assembly.fold, streams.rewards) when they are importable.
"""
from __future__ import annotations

import argparse
import sys
import time
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from consumers.archive import ArchiveBounds, ChunkBuilder  # noqa: E402
from consumers.history import ArchiveHistory  # noqa: E402
from infra.objectstore import ObjectStore  # noqa: E402
from infra.settings import Settings  # noqa: E402
from schemas import codec  # noqa: E402
from schemas.archive import ArchivedEvent, archive_prefix, write_archive  # noqa: E402
from schemas.examples import example_events  # noqa: E402
from schemas.keys import new_event_id, trajectory_id  # noqa: E402
from schemas.packing import pack_floats, pack_ids  # noqa: E402
from schemas.records import (  # noqa: E402
    Body,
    EpisodeEnded,
    EpisodeStarted,
    PolicyTurn,
    RolloutEvent,
    SourcePosition,
    Trajectory,
    TrajectoryTurn,
)
from schemas.topics import Topics  # noqa: E402
from tests.benchmarks.report import Figure, record, scratch  # noqa: E402

T0 = 1_700_000_000_000
TOKENS = 64


def episode_events(i: int) -> list[RolloutEvent]:
    base = example_events()[0]
    answer = str(i % 7)
    bodies: list[Body] = [
        EpisodeStarted(prompt_text=f"{i % 5}+{i % 7 - i % 5}=", prompt_tokens=pack_ids(range(12)),
                       task_spec=f'{{"answer": "{answer}"}}', group_size=4, max_turns=1, temperature=1.0,
                       max_new_tokens=TOKENS),
        PolicyTurn(turn=0, obs_text="", obs_tokens=b"", text=f" the answer is {answer if i % 3 else i % 7 + 1}",
                   tokens=pack_ids(range(3, 3 + TOKENS)), logprobs=pack_floats([-0.5] * TOKENS),
                   finish_reason="length" if i % 4 == 0 else "stop"),
        EpisodeEnded(status="truncated" if i % 4 == 0 else "completed", num_turns=1),
    ]
    return [replace(base, event_id=new_event_id(T0 + i), episode_id=f"ep-{i}", group_id=f"grp-{i // 4}",
                    task_id=f"t-{i // 4}", domain="math", ts=T0 + i, seq=k, body=body)
            for k, body in enumerate(bodies)]


def synthetic(n_events: int, partitions: int, topic: str) -> Iterator[ArchivedEvent]:
    """Archived records of whole episodes, spread over partitions by episode (as keys do), offsets per partition."""
    offsets = [0] * partitions
    i = 0
    produced = 0
    while produced < n_events:
        p = zlib.crc32(f"ep-{i}".encode()) % partitions
        for ev in episode_events(i)[: n_events - produced]:
            yield ArchivedEvent(topic, p, offsets[p], ev.ts, ev.episode_id.encode(), codec.encode(ev))
            offsets[p] += 1
            produced += 1
        i += 1


def archive(store: ObjectStore, ns: str, n_events: int, partitions: int) -> int:
    """Write the synthetic records as archive objects; returns the bytes stored."""
    topic = Topics(ns).events
    builder = ChunkBuilder(ArchiveBounds(max_events=50_000))
    stored = 0
    for rec in synthetic(n_events, partitions, topic):
        for chunk in builder.add(rec, 0.0):
            stored += len(put(store, ns, chunk))
    for chunk in builder.drain():
        stored += len(put(store, ns, chunk))
    return stored


def put(store: ObjectStore, ns: str, chunk) -> bytes:  # type: ignore[no-untyped-def]
    data = write_archive(chunk.records, chunk.key(ns))
    store.put(chunk.key(ns), data)
    return data


class Folder:
    """Episode events -> Trajectory, for when streams.assembly is not there (enough for the benchmark)."""

    def __init__(self, topic: str) -> None:
        self.topic = topic
        self.open: dict[str, list[tuple[ArchivedEvent, RolloutEvent]]] = {}

    def add(self, rec: ArchivedEvent, event: RolloutEvent) -> Trajectory | None:
        events = self.open.setdefault(event.episode_id, [])
        events.append((rec, event))
        if not isinstance(event.body, EpisodeEnded):
            return None
        del self.open[event.episode_id]
        return self.fold(events)

    def fold(self, events: list[tuple[ArchivedEvent, RolloutEvent]]) -> Trajectory:
        first, last = events[0][1], events[-1][1]
        start = first.body
        assert isinstance(start, EpisodeStarted) and isinstance(last.body, EpisodeEnded)
        turns = tuple(TrajectoryTurn(turn=e.body.turn, policy_version=e.policy_version, obs_text=e.body.obs_text,
                                     obs_tokens=e.body.obs_tokens, text=e.body.text, tokens=e.body.tokens,
                                     logprobs=e.body.logprobs, finish_reason=e.body.finish_reason)
                      for _, e in events if isinstance(e.body, PolicyTurn))
        return Trajectory(
            trajectory_id=trajectory_id(first.episode_id), episode_id=first.episode_id, group_id=first.group_id,
            task_id=first.task_id, domain=first.domain, run=first.run, status=last.body.status,
            task_spec=start.task_spec, prompt_text=start.prompt_text, prompt_tokens=start.prompt_tokens, turns=turns,
            reward=0.0, reward_components={}, reward_fn="", reward_version="", advantage=0.0, group_reward_mean=0.0,
            group_reward_std=0.0, source_topic=self.topic,
            source_offsets=tuple(SourcePosition(r.partition, r.offset) for r, _ in events),
            started_ts=first.ts, ended_ts=last.ts)


class StreamsFolder:
    """The streams stage's own pure fold (streams.assembly), when it is there."""

    def __init__(self, topic: str) -> None:
        from streams import assembly

        self.assembly = assembly
        self.topic = topic
        self.open: dict[str, Any] = {}

    def add(self, rec: ArchivedEvent, event: RolloutEvent) -> Trajectory | None:
        state = self.assembly.fold(self.open.get(event.episode_id), event, SourcePosition(rec.partition, rec.offset))
        if state.ended is None:
            self.open[event.episode_id] = state
            return None
        self.open.pop(event.episode_id, None)
        return self.assembly.to_trajectory(state, self.topic)  # type: ignore[no-any-return]


def folder(topic: str) -> tuple[str, Folder | StreamsFolder]:
    try:
        return "streams.assembly.fold", StreamsFolder(topic)
    except ImportError:
        return "a local fold", Folder(topic)


def reward_fn() -> tuple[str, Callable[[Trajectory], Trajectory]]:
    try:
        from streams.rewards import get_reward_fn
    except ImportError:
        return "decode + fold + re-encode (no reward functions found)", lambda t: t
    fn = get_reward_fn("default", "2")

    def score(t: Trajectory) -> Trajectory:
        result = fn(t)
        return replace(t, reward=result.total, reward_components=result.components, reward_fn="default",
                       reward_version="2")
    return "decode + fold + reward default:2 + encode", score


def timed(label: str, n_expected: int, run: Callable[[], int]) -> float:
    start = time.perf_counter()
    n = run()
    seconds = time.perf_counter() - start
    assert n == n_expected, f"{label}: {n} events, expected {n_expected}"
    rate = n / seconds
    print(f"{label:<58} {n:>9,} events  {seconds:7.2f} s  {rate:>10,.0f} events/s")
    return rate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--keep", action="store_true", help="leave the archive objects in the store")
    args = parser.parse_args()
    started = time.monotonic()
    store = ObjectStore(Settings.from_env())
    store.ensure_bucket()
    ns = scratch("bench")
    topic = Topics(ns).events

    start = time.perf_counter()
    size = archive(store, ns, args.events, args.partitions)
    print(f"archived {args.events:,} synthetic events into {len(store.list(archive_prefix(ns, topic)))} objects, "
          f"{size / 1e6:.1f} MB, in {time.perf_counter() - start:.1f} s")

    def raw() -> int:
        return sum(1 for _ in ArchiveHistory(store, ns, topic).records())

    label, score = reward_fn()
    fold_label, _ = folder(topic)
    print(f"fold: {fold_label}")

    def rescore() -> int:
        fold, n, trajectories = folder(topic)[1], 0, 0
        for rec in ArchiveHistory(store, ns, topic).records():
            trajectory = fold.add(rec, codec.decode(rec.value, RolloutEvent))
            if trajectory is not None:
                codec.encode(score(trajectory))
                trajectories += 1
            n += 1
        return n

    raw_rate = timed("raw archive read (fetch, inflate, container decode)", args.events, raw)
    replay_rate = timed(f"replay: {label}", args.events, rescore)
    print(f"ratio replay / raw read: {replay_rate / raw_rate:.3f}  (raw read is {raw_rate / replay_rate:.1f}x faster)")
    record("bench_replay", f"{args.events:,} archived events in {args.partitions} partitions", [
        Figure("raw archive read", raw_rate, "events/s"),
        Figure("replay through re-scoring (decode, fold, reward v2, encode)", replay_rate, "events/s",
               replay_rate / raw_rate, "raw read"),
    ], started)
    if not args.keep:
        for key in store.list(archive_prefix(ns, topic)):
            store.delete(key)
    return 0


if __name__ == "__main__":
    sys.exit(main())
