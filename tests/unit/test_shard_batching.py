"""The shard writer's pure parts: where batches are cut, replayed plans, and manifests derived from content."""
from __future__ import annotations

import math

import pytest

from consumers.batching import BatchBounds, Batcher
from consumers.shard_writer import WriterSettings, build_manifest, num_tokens
from schemas.errors import ConfigError
from tests.unit.test_shards import make_trajectory


def feed(batcher: Batcher, partition: int, offsets: range, size: int = 10, now: float = 0.0) -> list[tuple[int, int]]:
    out = []
    for off in offsets:
        out += [(b.first, b.last) for b in batcher.add(partition, off, make_trajectory(off), size, now)]
    return out


def test_count_bound_cuts_every_n() -> None:
    b = Batcher(BatchBounds(max_trajectories=3, max_age_s=60))
    assert feed(b, 0, range(8)) == [(0, 2), (3, 5)]
    assert b.pending == 2


def test_byte_bound_closes_before_a_record_that_would_overflow() -> None:
    b = Batcher(BatchBounds(max_trajectories=100, max_bytes=25, max_age_s=60))
    assert feed(b, 0, range(5), size=10) == [(0, 1), (2, 3)]
    huge = b.add(0, 5, make_trajectory(5), 1000, 0.0)  # a record bigger than the bound ships alone
    assert [(x.first, x.last) for x in huge] == [(4, 4), (5, 5)]


def test_partitions_are_batched_separately() -> None:
    b = Batcher(BatchBounds(max_trajectories=2, max_age_s=60))
    assert feed(b, 0, range(1)) == [] and feed(b, 1, range(1)) == []
    assert feed(b, 0, range(1, 2)) == [(0, 1)]
    assert set(b.open) == {1}


def test_time_bound_and_drain() -> None:
    b = Batcher(BatchBounds(max_trajectories=10, max_age_s=5))
    feed(b, 0, range(2), now=0.0)
    feed(b, 1, range(2), now=3.0)
    assert b.due(4.9) == []
    assert [(x.partition, x.first, x.last) for x in b.due(5.0)] == [(0, 0, 1)]
    writable, unfinished = b.drain()
    assert [(x.partition, x.last) for x in writable] == [(1, 1)] and unfinished == [] and b.open == {}


def test_a_stored_plan_overrides_every_bound() -> None:
    b = Batcher(BatchBounds(max_trajectories=2, max_age_s=1))
    b.set_plan(0, {3: 9, 10: 10})
    assert feed(b, 0, range(3)) == [(0, 1)]
    # offset 2 was open when 3 arrived: the plan starts at 3, so the open batch ends at 2
    assert feed(b, 0, range(3, 8), now=0.0) == [(2, 2)]
    assert b.due(100.0) == []  # a planned batch ignores the time bound
    assert feed(b, 0, range(8, 12)) == [(3, 9), (10, 10)]
    writable, unfinished = b.drain()
    assert [(x.first, x.last) for x in writable] == [(11, 11)] and unfinished == []


def test_an_unfinished_planned_batch_is_never_written_with_another_cut() -> None:
    b = Batcher(BatchBounds(max_trajectories=2, max_age_s=1))
    b.set_plan(0, {0: 5})
    feed(b, 0, range(3))
    writable, unfinished = b.drain()
    assert writable == [] and [(x.first, x.last) for x in unfinished] == [(0, 2)]


def test_skipped_records_commit_now_or_ride_with_the_open_batch() -> None:
    b = Batcher(BatchBounds(max_trajectories=3, max_age_s=60))
    assert b.skip(0, 0) == 1
    feed(b, 0, range(1, 3))
    assert b.skip(0, 3) is None
    (batch,) = b.add(0, 4, make_trajectory(4), 10, 0.0)
    assert (batch.first, batch.last, batch.end) == (1, 4, 4)
    feed(b, 0, range(5, 6))
    b.skip(0, 6)
    (late,) = b.due(100.0)
    assert (late.last, late.end) == (5, 6)  # commit past the dead letter, key by the last trajectory


def test_revoke_drops_open_batches_and_plans() -> None:
    b = Batcher(BatchBounds(max_trajectories=5, max_age_s=60))
    b.set_plan(1, {0: 3})
    feed(b, 0, range(2))
    assert [x.partition for x in b.revoke([0, 1])] == [0]
    assert b.open == {} and b.plans == {}


@pytest.mark.parametrize("kwargs", [{"max_trajectories": 0}, {"max_bytes": 0}, {"max_age_s": 0}])
def test_bounds_are_validated(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        BatchBounds(**kwargs)  # type: ignore[arg-type]


def test_writer_settings_are_validated() -> None:
    assert WriterSettings(ns="demo").consumer_group == "demo.shard-writer"
    for bad in ({"ns": "bad ns"}, {"ns": "x", "compression": "zstd"}, {"ns": "x", "store_retry_for_s": 0}):
        with pytest.raises(ConfigError):
            WriterSettings(**bad)  # type: ignore[arg-type]


def test_manifest_is_derived_from_content_only() -> None:
    trajs = [make_trajectory(i, version=i, reward=float(i)) for i in range(4)]
    kwargs = dict(key="k", sha256="s", size=10, bucket="b", topic="t.trajectories.scored", partition=1, first=5, last=8)
    m = build_manifest(trajs, **kwargs)  # type: ignore[arg-type]
    assert m == build_manifest(list(trajs), **kwargs)  # type: ignore[arg-type]
    assert m.batch_id == "t.trajectories.scored:1:5-8" and m.num_trajectories == 4
    assert (m.policy_version_min, m.policy_version_max) == (0, 4)  # turns are versions i and i + 1
    assert m.reward_mean == 1.5 and math.isclose(m.reward_std, math.sqrt(1.25))
    assert m.ts == max(t.ended_ts for t in trajs) and m.run == "r"
    assert m.trajectory_ids == tuple(t.trajectory_id for t in trajs)
    # 4 prompt tokens + turn 0 (0 obs + 3 generated) + turn 1 (1 obs + 4 generated)
    assert num_tokens(trajs[0]) == 12 and m.num_tokens == 48
