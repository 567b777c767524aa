"""The shard writer as a process against the real broker and store: exact shards, crash-restart, dead letters."""
from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from confluent_kafka import TopicPartition

from consumers.shards import read_shard, shard_range
from infra.kafka import Publisher, consumer, end_offsets, read_topic
from infra.launcher import Launcher
from infra.objectstore import ObjectStore
from infra.settings import Settings
from schemas import codec
from schemas.keys import batch_id, shard_key
from schemas.records import BatchManifest, DeadLetter, PipelineMetric, Trajectory
from schemas.topics import Topics
from tests.unit.test_shards import make_trajectory

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def produce(stack: Settings, topic: str, records: list[tuple[int, bytes]]) -> None:
    pub = Publisher(stack)
    for partition, value in records:
        pub.send(topic, None, value, partition=partition)
    pub.close()


def scored(ns: str, counts: dict[int, int], start: int = 0) -> tuple[list[tuple[int, bytes]], list[Trajectory]]:
    """`counts[p]` trajectories for partition p, as records to produce and as the trajectories themselves."""
    records, trajs = [], []
    i = start
    for partition, n in counts.items():
        for _ in range(n):
            t = make_trajectory(i, run=ns, version=i % 5)
            records.append((partition, codec.encode(t)))
            trajs.append(t)
            i += 1
    return records, trajs


def start_writer(stack: Settings, ns: str, log: Path, *args: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, **stack.as_env(), "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "consumers.shard_writer", "--ns", ns, "--progress-every-s", "0.2",
                             *args], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "ab"))


def finish(proc: subprocess.Popen[bytes], log: Path, timeout: float = 90.0) -> None:
    rc = proc.wait(timeout=timeout)
    assert rc == 0, log.read_text()[-3000:]


def wait_for(check, timeout: float = 60.0, what: str = "condition") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def manifests(stack: Settings, topics: Topics) -> list[BatchManifest]:
    return [codec.decode(m.value(), expect=BatchManifest) for m in read_topic(stack, topics.batches)]


def manifest_count(stack: Settings, topics: Topics) -> int:
    return sum(hi - lo for lo, hi in end_offsets(stack, topics.batches).values())


def shards(store: ObjectStore, ns: str) -> dict[str, bytes]:
    return {key: store.get(key) for key in store.list(f"shards/{ns}/")}


def committed(stack: Settings, topics: Topics, group: str) -> dict[int, int]:
    c = consumer(stack, group)
    try:
        tps = c.committed([TopicPartition(topics.scored, p) for p in range(topics.partitions)], timeout=10)
        return {tp.partition: tp.offset for tp in tps}
    finally:
        c.close()


def check_consistent(stack: Settings, topics: Topics, store: ObjectStore, expected: list[Trajectory]) -> list[BatchManifest]:
    """Every trajectory in exactly one shard; shards and manifests agree; duplicates only of identical manifests."""
    objects = shards(store, topics.ns)
    found: Counter[str] = Counter()
    for key, data in objects.items():
        found.update(t.trajectory_id for t in read_shard(data))
    assert found == Counter(t.trajectory_id for t in expected)
    by_id: dict[str, set[BatchManifest]] = defaultdict(set)
    got = manifests(stack, topics)
    for m in got:
        by_id[m.batch_id].add(m)
    assert all(len(copies) == 1 for copies in by_id.values()), "a batch id was published with different content"
    assert sorted(m.key for (m,) in by_id.values()) == sorted(objects)
    for (m,) in by_id.values():
        data = objects[m.key]
        assert (m.sha256, m.size) == (hashlib.sha256(data).hexdigest(), len(data))
        assert m.trajectory_ids == tuple(t.trajectory_id for t in read_shard(data))
        assert m.key == shard_key(topics.ns, topics.scored, m.partition, m.first_offset, m.last_offset)
        assert (m.first_offset, m.last_offset) == shard_range(m.key)
    for p in range(topics.partitions):  # offset ranges of one partition never overlap
        spans = sorted(shard_range(k) for k in objects if f"/p{p:04d}/" in k)
        assert all(a[1] < b[0] for a, b in zip(spans, spans[1:])), spans
    return got


def test_writes_exactly_the_expected_shards_and_a_rerun_rewrites_them_identically(
        stack: Settings, topics: Topics, store: ObjectStore, tmp_path: Path) -> None:
    records, trajs = scored(topics.ns, {0: 12, 1: 11})
    produce(stack, topics.scored, records)
    log = tmp_path / "writer.log"
    finish(start_writer(stack, topics.ns, log, "--max-trajectories", "5", "--max-age-s", "600",
                        "--exit-when-idle-s", "3"), log)

    spans = {0: [(0, 4), (5, 9), (10, 11)], 1: [(0, 4), (5, 9), (10, 10)]}
    keys = sorted(shard_key(topics.ns, topics.scored, p, a, b) for p, ss in spans.items() for a, b in ss)
    first = shards(store, topics.ns)
    assert sorted(first) == keys
    got = check_consistent(stack, topics, store, trajs)
    assert [m.batch_id for m in got if m.partition == 0] == [batch_id(topics.scored, 0, a, b) for a, b in spans[0]]
    assert len(got) == 6 and sum(m.num_trajectories for m in got) == 23
    assert committed(stack, topics, f"{topics.ns}.shard-writer") == {0: 12, 1: 11}
    assert "batches=6 trajectories=23" in log.read_text()
    figures = metric_totals(stack, topics)  # its own figures on the metrics topic say the same
    assert (figures["shards/batches"], figures["shards/trajectories"], figures["shards/replayed"]) == (6, 23, 0)

    # As if every commit had been lost: another group re-reads everything, with other bounds and even
    # another codec. The stored shards fix the cut and are kept, so the manifests are republished unchanged.
    finish(start_writer(stack, topics.ns, log, "--group", f"{topics.ns}.again", "--max-trajectories", "2",
                        "--max-age-s", "0.1", "--codec", "null", "--exit-when-idle-s", "3"), log)
    assert shards(store, topics.ns) == first
    again = check_consistent(stack, topics, store, trajs)
    assert len(again) == 12 and set(again) == set(got)
    assert "replayed=6" in log.read_text()
    assert metric_totals(stack, topics)["shards/replayed"] == 6


def metric_totals(stack: Settings, topics: Topics) -> dict[str, float]:
    totals: dict[str, float] = {}
    for message in read_topic(stack, topics.metrics):
        metric = codec.decode(message.value(), PipelineMetric)
        if metric.source == "shards":
            assert metric.labels.get("writer"), metric  # which writer: several writers' figures add up
            totals[metric.name] = totals.get(metric.name, 0.0) + metric.value
    return totals


@pytest.mark.slow
def test_kill_9_mid_run_then_restart_loses_nothing_and_copies_nothing(
        stack: Settings, topics: Topics, store: ObjectStore, tmp_path: Path) -> None:
    records, trajs = scored(topics.ns, {0: 150, 1: 150})
    produce(stack, topics.scored, records)
    log = tmp_path / "writer.log"
    proc = start_writer(stack, topics.ns, log, "--max-trajectories", "4", "--max-age-s", "0.5")
    wait_for(lambda: manifest_count(stack, topics) >= 3, what="the first manifests")
    assert proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    written_before = len(store.list(f"shards/{topics.ns}/"))
    assert written_before < 75, "the writer finished before it was killed; the test proves nothing"

    finish(start_writer(stack, topics.ns, log, "--max-trajectories", "7", "--max-age-s", "0.5",
                        "--exit-when-idle-s", "3"), log)
    check_consistent(stack, topics, store, trajs)
    assert committed(stack, topics, f"{topics.ns}.shard-writer") == {0: 150, 1: 150}


def test_time_bound_closes_a_batch_and_sigterm_finishes_the_open_one(
        stack: Settings, topics: Topics, store: ObjectStore, tmp_path: Path) -> None:
    log = tmp_path / "writer.log"
    records, trajs = scored(topics.ns, {0: 3})
    produce(stack, topics.scored, records)
    proc = start_writer(stack, topics.ns, log, "--max-trajectories", "100", "--max-age-s", "1")
    wait_for(lambda: manifest_count(stack, topics) == 1, what="the time-bound batch")
    proc.send_signal(signal.SIGTERM)
    finish(proc, log, timeout=30)

    more, more_trajs = scored(topics.ns, {1: 2}, start=3)
    produce(stack, topics.scored, more)
    proc = start_writer(stack, topics.ns, log, "--max-trajectories", "100", "--max-age-s", "600")
    wait_for(lambda: "consumed=2 open=2" in log.read_text(), what="the writer to hold the open batch")
    proc.send_signal(signal.SIGTERM)
    finish(proc, log, timeout=30)
    got = check_consistent(stack, topics, store, trajs + more_trajs)
    assert [(m.partition, m.first_offset, m.last_offset) for m in got] == [(0, 0, 2), (1, 0, 1)]


def test_a_corrupt_record_is_dead_lettered_and_the_rest_is_written(
        stack: Settings, topics: Topics, store: ObjectStore, tmp_path: Path) -> None:
    records, trajs = scored(topics.ns, {0: 3, 1: 1})
    garbage, truncated = b"not an event", records[0][1][:20]
    produce(stack, topics.scored, records[:2] + [(0, garbage)] + records[2:] + [(1, truncated)])
    log = tmp_path / "writer.log"
    finish(start_writer(stack, topics.ns, log, "--max-trajectories", "10", "--max-age-s", "600",
                        "--exit-when-idle-s", "3"), log)

    got = check_consistent(stack, topics, store, trajs)
    assert sorted((m.partition, m.first_offset, m.last_offset) for m in got) == [(0, 0, 3), (1, 0, 0)]
    dead = sorted((codec.decode(m.value(), expect=DeadLetter) for m in read_topic(stack, topics.deadletter)),
                  key=lambda d: d.partition)
    assert [(d.stage, d.reason, d.partition, d.offset, d.original) for d in dead] == [
        ("shard_writer", "bad_magic", 0, 2, garbage), ("shard_writer", "truncated", 1, 1, truncated)]
    assert all(d.source_topic == topics.scored for d in dead)
    # the dead letter at the end of partition 1 is committed past too: a restart does not repeat it
    assert committed(stack, topics, f"{topics.ns}.shard-writer") == {0: 4, 1: 2}


@pytest.mark.slow
def test_the_writer_waits_out_an_object_store_outage(
        topics: Topics, own_minio: tuple[Launcher, Settings], tmp_path: Path) -> None:
    launcher, settings = own_minio
    store = ObjectStore(settings)
    store.ensure_bucket()
    records, trajs = scored(topics.ns, {0: 6, 1: 6})
    produce(settings, topics.scored, records)
    log = tmp_path / "writer.log"
    launcher.kill("minio")
    try:
        proc = start_writer(settings, topics.ns, log, "--max-trajectories", "4", "--max-age-s", "600",
                            "--exit-when-idle-s", "3", "--store-retry-s", "2")
        # blocked on the store past one 2 s attempt window, and still alive
        wait_for(lambda: "still trying" in log.read_text(), what="the writer to wait for the store")
        assert proc.poll() is None
    finally:
        launcher.start("minio")
    finish(proc, log)
    check_consistent(settings, topics, store, trajs)
    assert committed(settings, topics, f"{topics.ns}.shard-writer") == {0: 6, 1: 6}


def test_a_trajectory_re_emitted_into_the_open_batch_is_written_once(
        stack: Settings, topics: Topics, store: ObjectStore, tmp_path: Path) -> None:
    # Streams killed between flushing a group and recording it closed re-emit it: here both copies arrive
    # before the batch that holds the first one is written.
    records, trajs = scored(topics.ns, {0: 4})
    produce(stack, topics.scored, records[:3] + records[1:3] + records[3:])
    log = tmp_path / "writer.log"
    finish(start_writer(stack, topics.ns, log, "--max-trajectories", "10", "--max-age-s", "600",
                        "--exit-when-idle-s", "3"), log)
    (manifest,) = manifests(stack, topics)
    assert manifest.trajectory_ids == tuple(t.trajectory_id for t in trajs)
    assert (manifest.first_offset, manifest.last_offset) == (0, 5)
    assert "duplicates=2" in log.read_text()
    assert committed(stack, topics, f"{topics.ns}.shard-writer")[0] == 6


def test_a_writer_that_takes_over_partitions_knows_the_batches_another_writer_published_meanwhile(
        stack: Settings, topics: Topics, store: ObjectStore, tmp_path: Path) -> None:
    """Writer B starts while the batches topic is empty; writer A, in the same group, then writes every trajectory
    and leaves. The streams stage sends one of them again (at least once); B, taking the partition over, drops
    the copy as a duplicate instead of batching it a second time, which the learner would train on twice."""
    from consumers.batching import BatchBounds
    from consumers.shard_writer import ShardWriter, WriterSettings

    records, trajs = scored(topics.ns, {0: 4})
    produce(stack, topics.scored, records)
    b = ShardWriter(stack, WriterSettings(ns=topics.ns, bounds=BatchBounds(max_trajectories=2, max_age_s=0.1),
                                          exit_when_idle_s=3.0, progress_every_s=0.2), store=store)
    log = tmp_path / "a.log"
    finish(start_writer(stack, topics.ns, log, "--max-trajectories", "2", "--max-age-s", "0.1",
                        "--exit-when-idle-s", "3"), log)
    assert sorted(t for m in manifests(stack, topics) for t in m.trajectory_ids) == sorted(
        t.trajectory_id for t in trajs)
    produce(stack, topics.scored, [records[1]])  # the copy, at a later offset
    assert b.run() == 0
    assert b.progress.duplicates == 1 and b.progress.batches == 0
    ids = [t for m in manifests(stack, topics) for t in m.trajectory_ids]
    assert sorted(ids) == sorted(t.trajectory_id for t in trajs)  # each once
