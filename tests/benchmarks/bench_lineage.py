"""Lineage query time on a run of N trajectories: through the batch manifests vs a scan of the scored topic.

    python tests/benchmarks/bench_lineage.py [--trajectories 100000] [--batch 64] [--queries 5]

Writes N scored trajectories (one turn of 32 tokens each) to a fresh namespace's scored topic on the running
broker, with one batch manifest per `--batch` of them (their real partition and offsets) and a checkpoint
announcement per 10 batches, then times `consumers.lineage.trace` for trajectories spread over the run
(the query: batches topic, the batch's range of the scored topic, checkpoints), against locating the same
trajectories by scanning the scored topic from offset 0 (how lineage found them before).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from confluent_kafka import Producer  # noqa: E402

from consumers.lineage import locate, trace  # noqa: E402
from infra.bootstrap import bootstrap  # noqa: E402
from infra.kafka import producer_config, read_topic  # noqa: E402
from infra.namespaces import delete_namespace  # noqa: E402
from infra.objectstore import ObjectStore  # noqa: E402
from infra.settings import Settings  # noqa: E402
from schemas import codec  # noqa: E402
from schemas.keys import batch_id, shard_key  # noqa: E402
from schemas.packing import pack_floats, pack_ids  # noqa: E402
from schemas.records import BatchManifest, CheckpointPublished, SourcePosition, Trajectory, TrajectoryTurn  # noqa: E402
from schemas.topics import Topics  # noqa: E402
from tests.benchmarks.report import Figure, record, scratch  # noqa: E402

T0 = 1_700_000_000_000


def scored(ns: str, i: int) -> Trajectory:
    turn = TrajectoryTurn(turn=0, policy_version=i // 4096, obs_text="", obs_tokens=b"", text=f" {i % 97}",
                          tokens=pack_ids(range(3, 35)), logprobs=pack_floats([-0.5] * 32), finish_reason="stop")
    return Trajectory(trajectory_id=f"traj-{i:08d}", episode_id=f"ep-{i}", group_id=f"g-{i // 8}", task_id="t",
                      domain="math", run=ns, status="completed", task_spec="{}", prompt_text="1+1=",
                      prompt_tokens=pack_ids(range(3, 15)), turns=(turn,), reward=float(i % 2),
                      reward_components={"outcome/correct": float(i % 2)}, reward_fn="default", reward_version="1",
                      advantage=0.5 - i % 2, group_reward_mean=0.5, group_reward_std=0.5,
                      source_topic=f"{ns}.rollout.events", source_offsets=(SourcePosition(0, i),), started_ts=T0 + i,
                      ended_ts=T0 + i + 1)


def write_run(settings: Settings, topics: Topics, n: int, batch: int) -> None:
    producer = Producer(producer_config(settings))
    for i in range(n):
        t = scored(topics.ns, i)
        producer.produce(topics.scored, key=t.group_id.encode(), value=codec.encode(t))
        if i % 10_000 == 0:
            producer.poll(0)
    assert producer.flush(120) == 0
    by_partition: dict[int, list[tuple[int, str]]] = {}
    for message in read_topic(settings, topics.scored):
        t = codec.decode(message.value() or b"", Trajectory)
        by_partition.setdefault(message.partition() or 0, []).append((message.offset() or 0, t.trajectory_id))
    announced: list[str] = []
    version = 0
    for partition, rows in sorted(by_partition.items()):
        for at in range(0, len(rows), batch):
            chunk = rows[at:at + batch]
            first, last = chunk[0][0], chunk[-1][0]
            manifest = BatchManifest(
                batch_id=batch_id(topics.scored, partition, first, last), run=topics.ns, bucket="trajpipe",
                key=shard_key(topics.ns, topics.scored, partition, first, last), sha256="-", size=0,
                num_trajectories=len(chunk), num_tokens=32 * len(chunk), source_topic=topics.scored,
                partition=partition, first_offset=first, last_offset=last, policy_version_min=0,
                policy_version_max=0, reward_mean=0.5, reward_std=0.5,
                trajectory_ids=tuple(tid for _, tid in chunk), ts=T0)
            producer.produce(topics.batches, value=codec.encode(manifest))
            announced.append(manifest.batch_id)
            if len(announced) == 10:
                version += 1
                event = CheckpointPublished(run=topics.ns, version=version, step=version, bucket="trajpipe",
                                            prefix=f"checkpoints/{topics.ns}/v{version}/", manifest_key="-",
                                            manifest_sha256="-", algorithm="grpo", batch_ids=tuple(announced), ts=T0)
                producer.produce(topics.checkpoints, key=f"{topics.ns}:{version}".encode(), value=codec.encode(event))
                announced = []
    assert producer.flush(120) == 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--queries", type=int, default=5)
    args = parser.parse_args()
    settings = Settings.from_env()
    topics = Topics(scratch("bench"), partitions=4)
    bootstrap(settings, topics.ns, partitions=4)
    store = ObjectStore(settings)
    try:
        started = time.perf_counter()
        write_run(settings, topics, args.trajectories, args.batch)
        print(f"{args.trajectories:,} scored trajectories in batches of {args.batch}, written in "
              f"{time.perf_counter() - started:.1f} s")
        wanted = [f"traj-{i:08d}" for i in
                  (round(k * (args.trajectories - 1) / max(1, args.queries - 1)) for k in range(args.queries))]
        indexed, scanned = [], []
        for tid in wanted:
            started = time.perf_counter()
            lineage = trace(settings, topics.ns, tid, store)
            indexed.append(time.perf_counter() - started)
            assert lineage is not None and lineage.batches, tid
            started = time.perf_counter()
            assert locate(settings, topics, tid) is not None  # no batches given: the scan of the scored topic
            scanned.append(time.perf_counter() - started)
        for label, times in (("lineage query (batch manifests, the batch's range, checkpoints)", indexed),
                             ("locating by scanning the scored topic from offset 0", scanned)):
            print(f"{label:<66} median {statistics.median(times):6.3f} s  max {max(times):6.3f} s  "
                  f"({len(times)} trajectories)")
        print(f"ratio: the whole query is {statistics.median(scanned) / statistics.median(indexed):.1f}x faster "
              "than the scan alone")
        query, scan = statistics.median(indexed), statistics.median(scanned)
        record("bench_lineage", f"{args.trajectories:,} scored trajectories in batches of {args.batch}, "
               f"{args.queries} lineage queries", [
                   Figure("lineage query, median", query, "s", query / scan, "scanning the scored topic"),
                   Figure("lineage query, max", max(indexed), "s"),
               ])
    finally:
        delete_namespace(settings, topics.ns, force=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
