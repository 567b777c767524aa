"""The learner's batch reader against the real broker and store: dedupe, cache repair, prefetch, resume, outage."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from consumers.batch_reader import BatchReader, LoadedBatch, ShardCache
from consumers.shard_writer import build_manifest
from consumers.shards import write_shard
from infra.kafka import Publisher
from infra.launcher import Launcher
from infra.objectstore import ObjectStore
from infra.settings import Settings
from schemas import codec
from schemas.keys import shard_key
from schemas.records import BatchManifest, Trajectory
from schemas.topics import Topics
from tests.unit.test_shards import make_trajectory

pytestmark = pytest.mark.integration


def store_batches(store: ObjectStore, topics: Topics, n: int, size: int = 3) -> list[tuple[BatchManifest, list[Trajectory]]]:
    """`n` shards of `size` trajectories from partition 0 of the scored topic, stored as the writer would."""
    out = []
    for b in range(n):
        first, last = b * size, b * size + size - 1
        trajs = [make_trajectory(i, run=topics.ns, version=b) for i in range(first, last + 1)]
        key = shard_key(topics.ns, topics.scored, 0, first, last)
        data = write_shard(trajs, key)
        digest = store.put_verified(key, data)
        out.append((build_manifest(trajs, key=key, sha256=digest, size=len(data), bucket=store.bucket,
                                   topic=topics.scored, partition=0, first=first, last=last), trajs))
    return out


def publish(stack: Settings, topics: Topics, values: list[bytes]) -> None:
    pub = Publisher(stack)
    for value in values:
        pub.send(topics.batches, b"scored:0", value)
    pub.close()


def stored_and_published(stack: Settings, store: ObjectStore, topics: Topics, n: int) -> list[tuple[BatchManifest, list[Trajectory]]]:
    batches = store_batches(store, topics, n)
    publish(stack, topics, [codec.encode(m) for m, _ in batches])
    return batches


def reader(stack: Settings, topics: Topics, cache_dir: Path, group: str = "learner", **kwargs: object) -> BatchReader:
    cache = ShardCache(cache_dir, max_bytes=64 * 1024 * 1024)
    return BatchReader(stack, topics.ns, f"{topics.ns}.{group}", cache, **kwargs)  # type: ignore[arg-type]


def drain(r: BatchReader, first_timeout: float = 20.0) -> list[LoadedBatch]:
    out: list[LoadedBatch] = []
    while (batch := r.next_batch(timeout=first_timeout if not out else 3.0)) is not None:
        out.append(batch)
    return out


def test_manifests_become_batches_once_in_log_order(stack: Settings, topics: Topics, store: ObjectStore,
                                                    tmp_path: Path) -> None:
    batches = store_batches(store, topics, 4)
    values = [codec.encode(m) for m, _ in batches]
    # a republished manifest (shard-writer restart) and a record that is no manifest at all
    publish(stack, topics, values[:2] + [values[0], b"garbage"] + values[2:])
    with reader(stack, topics, tmp_path / "cache") as r:
        got = drain(r)
        assert [b.manifest for b in got] == [m for m, _ in batches]
        assert [list(b.trajectories) for b in got] == [t for _, t in batches]
        assert [b.offset for b in got] == [0, 1, 4, 5]
        assert got[1].policy_versions == [(1, 2)] * 3  # make_trajectory: turn k is version b + k
        assert r.positions() == {0: 6}
        m = r.metrics()
        assert (m["reader/batches"], m["reader/duplicates"], m["reader/bad_manifests"]) == (4, 1, 1)
        assert m["cache/misses"] == 4 and m["time/wait_data_s"] > 0
        r.commit()
    with reader(stack, topics, tmp_path / "cache") as again:  # the same group resumes after the commit
        assert again.positions() == {0: 6}
        assert again.next_batch(timeout=2.0) is None


def test_a_corrupt_cached_shard_is_detected_and_refetched(stack: Settings, topics: Topics, store: ObjectStore,
                                                          tmp_path: Path) -> None:
    ((manifest, trajs),) = stored_and_published(stack, store, topics, 1)
    cache_dir = tmp_path / "cache"
    with reader(stack, topics, cache_dir, group="a") as r:
        assert list(drain(r)[0].trajectories) == trajs
    path = cache_dir / f"{manifest.sha256}.shard"
    good = path.read_bytes()
    path.write_bytes(good[:-7] + b"garbage")
    with reader(stack, topics, cache_dir, group="b") as r:
        (batch,) = drain(r)
        assert list(batch.trajectories) == trajs
        stats = r.cache.stats
        assert (stats.corrupt, stats.misses, stats.hits) == (1, 1, 0)
    assert path.read_bytes() == good
    with reader(stack, topics, cache_dir, group="c") as r:
        drain(r)
        assert (r.cache.stats.hits, r.cache.stats.misses) == (1, 0)


def test_prefetch_keeps_the_next_batches_ready_and_no_more(stack: Settings, topics: Topics, store: ObjectStore,
                                                           tmp_path: Path) -> None:
    batches = stored_and_published(stack, store, topics, 6)
    with reader(stack, topics, tmp_path / "cache", prefetch=2) as r:
        first = r.next_batch(timeout=20.0)
        assert first is not None and first.manifest == batches[0][0]
        deadline = time.monotonic() + 20
        while r.ready() < 2:
            assert time.monotonic() < deadline, "the prefetcher did not fill up"
            time.sleep(0.05)
        time.sleep(0.5)
        assert r.ready() == 2 and r.cache.stats.misses == 3  # bounded: nothing fetched beyond the two
        start = time.monotonic()
        second = r.next_batch(timeout=0)
        assert second is not None and second.manifest == batches[1][0]
        assert time.monotonic() - start < 0.1 and second.wait_s < 0.1


def test_seek_to_recorded_offsets_resumes_exactly(stack: Settings, topics: Topics, store: ObjectStore,
                                                  tmp_path: Path) -> None:
    batches = stored_and_published(stack, store, topics, 6)
    ids = [m.batch_id for m, _ in batches]
    with reader(stack, topics, tmp_path / "cache") as r:
        trained = [r.next_batch(timeout=20.0) for _ in range(3)]
        checkpoint = r.positions()  # what a checkpoint would record, with the trained batch ids
    assert checkpoint == {0: 3} and [b.manifest.batch_id for b in trained if b] == ids[:3]

    with reader(stack, topics, tmp_path / "cache") as r:
        r.seek(checkpoint)
        r.mark_seen(ids[:3])
        assert [b.manifest.batch_id for b in drain(r)] == ids[3:]
        r.commit(checkpoint)  # committed only up to the checkpoint, not what was read since
    with reader(stack, topics, tmp_path / "cache") as r:
        assert r.positions() == checkpoint
        # rewound further than the checkpoint: the trained ids still keep those batches out
        r.seek({0: 0})
        r.mark_seen(ids[:3])
        assert [b.manifest.batch_id for b in drain(r)] == ids[3:]
        assert r.metrics()["reader/duplicates"] == 3


def test_stale_shards_are_not_downloaded_when_a_lag_is_set(stack: Settings, topics: Topics, store: ObjectStore,
                                                           tmp_path: Path) -> None:
    batches = stored_and_published(stack, store, topics, 4)  # batch b holds policy versions b and b + 1
    with reader(stack, topics, tmp_path / "cache", max_policy_lag=1) as r:
        r.set_policy_version(3)
        got = drain(r)
    assert [b.stale for b in got] == [True, False, False, False]
    assert got[0].trajectories == () and got[0].manifest == batches[0][0]
    assert r.cache.stats.misses == 3 and r.metrics()["reader/stale_batches"] == 1


@pytest.mark.slow
def test_the_reader_waits_out_an_object_store_outage(topics: Topics, own_minio: tuple[Launcher, Settings],
                                                     tmp_path: Path) -> None:
    launcher, settings = own_minio
    store = ObjectStore(settings)
    store.ensure_bucket()
    batches = stored_and_published(settings, store, topics, 2)
    restarter = threading.Thread(target=lambda: (time.sleep(3), launcher.start("minio")))
    with reader(settings, topics, tmp_path / "cache", store_retry_for_s=2.0) as r:
        launcher.kill("minio")
        restarter.start()
        try:
            got = drain(r, first_timeout=120.0)
        finally:
            restarter.join()
    assert [list(b.trajectories) for b in got] == [t for _, t in batches]
    assert r.store.retries >= 1 and got[0].wait_s > 2.0  # it met the whole outage (~3 s), not a blip


def test_a_batches_topic_that_appears_seconds_after_the_reader_asks_is_waited_for_then_a_missing_one_refused(
        stack: Settings, ns: str, tmp_path: Path) -> None:
    """A broker that has just started can deny a topic bootstrap created seconds earlier: the reader asks again
    for a while (the demo's learner exited 2 once, right after `infra up`), then names the fix."""
    import threading

    from infra.bootstrap import bootstrap, partition_count
    from schemas.errors import ConfigError

    topics = Topics(ns, partitions=2)
    later = threading.Timer(3.0, lambda: bootstrap(stack, ns, partitions=2))
    later.start()
    try:
        positions = reader(stack, topics, tmp_path / "a")._committed_positions()
    finally:
        later.join()
    assert len(positions) == partition_count(stack, topics.batches) and set(positions.values()) == {0}
    missing = Topics(f"{ns}-never", partitions=2)
    with pytest.raises(ConfigError, match="bootstrap"):
        reader(stack, missing, tmp_path / "b")._committed_positions()
