"""Lineage and export against the real broker and store: a trajectory traced to its events, batch, checkpoint."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from consumers.archive import Archiver
from consumers.shards import write_shard
from consumers.lineage import trace
from infra.bootstrap import delete_topics
from infra.kafka import read_topic
from infra.objectstore import ObjectStore
from infra.settings import Settings
from schemas.keys import shard_key
from schemas.records import BatchManifest, CheckpointPublished, SourcePosition
from schemas.topics import Topics
from tests.conftest import ROOT
from tests.taps import episode, produce, publish, trajectory, turn

pytestmark = pytest.mark.integration
T0 = 1_700_000_000_000


def recorded(stack: Settings, topics: Topics, store: ObjectStore) -> str:
    """An episode, its scored trajectory, a batch (and its shard) that carries it and a checkpoint trained on
    that batch."""
    produce(stack, topics.events, episode("ep-x", T0, turns=2, versions=[4, 4, 4, 5, 5, 5]) + episode("ep-y", T0))
    positions = [SourcePosition(m.partition() or 0, m.offset() or 0) for m in read_topic(stack, topics.events)
                 if m.key() == b"ep-x"]
    traj = replace(trajectory("ep-x", 0.75, turns=[turn(" 3", version=4), turn(" 4", version=5)]),
                   source_topic=topics.events, source_offsets=tuple(positions), reward_components={"a": 0.5})
    publish(stack, topics.scored, [trajectory("ep-y"), traj], key=b"g-1")  # one partition, offsets 0 and 1
    partition = {m.partition() or 0 for m in read_topic(stack, topics.scored)}.pop()
    key = shard_key(topics.ns, topics.scored, partition, 0, 1)
    sha = store.put_verified(key, write_shard([trajectory("ep-y"), traj], key))
    batch = BatchManifest(batch_id=f"{topics.scored}:{partition}:0-1", run="r", bucket=store.bucket, key=key,
                          sha256=sha, size=1, num_trajectories=2, num_tokens=8, source_topic=topics.scored,
                          partition=partition, first_offset=0, last_offset=1, policy_version_min=4,
                          policy_version_max=5, reward_mean=0.5, reward_std=0.1,
                          trajectory_ids=(trajectory("ep-y").trajectory_id, traj.trajectory_id), ts=T0)
    publish(stack, topics.batches, [batch])
    publish(stack, topics.checkpoints, [CheckpointPublished(
        run="r", version=6, step=60, bucket="trajpipe", prefix="p", manifest_key="m", manifest_sha256="s",
        algorithm="grpo", batch_ids=(batch.batch_id,), ts=T0)], key=b"r")
    return traj.trajectory_id


def test_lineage_names_events_versions_reward_batch_and_checkpoint(stack: Settings, topics: Topics,
                                                                   store: ObjectStore) -> None:
    tid = recorded(stack, topics, store)
    lineage = trace(stack, topics.ns, tid, store)
    assert lineage is not None and lineage.found_on["topic"] == topics.scored
    assert [e["type"] for e in lineage.source_events] == [
        "EpisodeStarted", "PolicyTurn", "SandboxResult", "PolicyTurn", "SandboxResult", "EpisodeEnded"]
    assert {e["from"] for e in lineage.source_events} == {"topic"} and not lineage.missing_source_offsets
    assert lineage.policy_versions == [4, 5]
    assert lineage.reward == {"reward": 0.75, "reward_fn": "default", "reward_version": "1", "components": {"a": 0.5},
                              "advantage": 0.0, "group_reward_mean": 0.0, "group_reward_std": 0.0}
    assert [b["batch_id"] for b in lineage.batches] == [f"{topics.scored}:{lineage.found_on['partition']}:0-1"]
    assert [(c["version"], c["from"]) for c in lineage.checkpoints] == [(6, "topic")]
    assert trace(stack, topics.ns, "traj-none", store) is None


def test_lineage_reads_the_archive_when_the_events_are_gone(stack: Settings, topics: Topics,
                                                            store: ObjectStore) -> None:
    tid = recorded(stack, topics, store)
    archiver = Archiver(stack, topics.ns, store=store)
    archiver.run_once(timeout_s=60)
    archiver.close()
    delete_topics(stack, [topics.events])
    out = subprocess.run([sys.executable, "-m", "consumers.lineage", "--ns", topics.ns, tid, "--json"], cwd=ROOT,
                         env={**os.environ, **stack.as_env()}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert len(doc["source_events"]) == 6 and {e["from"] for e in doc["source_events"]} == {"archive"}
    assert doc["checkpoints"][0]["version"] == 6


def test_lineage_finds_a_trajectory_through_its_batch_then_in_the_shard_when_the_topic_is_gone(
        stack: Settings, topics: Topics, store: ObjectStore) -> None:
    tid = recorded(stack, topics, store)
    publish(stack, topics.scored, [trajectory(f"later-{i}") for i in range(50)], key=b"g-1")  # after its range
    lineage = trace(stack, topics.ns, tid, store)
    assert lineage is not None and (lineage.found_on["topic"], lineage.found_on["offset"]) == (topics.scored, 1)
    delete_topics(stack, [topics.scored])  # retention dropped the scored records: the batch's shard has them
    lineage = trace(stack, topics.ns, tid, store)
    assert lineage is not None and lineage.found_on["topic"].endswith("/00000000000000000000-00000000000000000001.avro")
    assert lineage.policy_versions == [4, 5] and lineage.reward["reward"] == 0.75 and len(lineage.source_events) == 6
    assert [c["version"] for c in lineage.checkpoints] == [6]


def test_export_cli_writes_dpo_pairs(stack: Settings, topics: Topics, tmp_path: Path) -> None:
    publish(stack, topics.scored, [trajectory("a", 0.0, group_id="g"), trajectory("b", 1.0, group_id="g"),
                                   trajectory("c", 1.0, group_id="h", status="abandoned")])
    out = subprocess.run([sys.executable, "-m", "consumers.export", "--ns", topics.ns, "--format", "dpo",
                          "--out", str(tmp_path / "dpo.jsonl")], cwd=ROOT,
                         env={**os.environ, **stack.as_env()}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["rows"] == 1 and json.loads(out.stdout)["untrainable"] == 1
    (row,) = [json.loads(line) for line in (tmp_path / "dpo.jsonl").read_text().splitlines()]
    assert row == {"prompt": "2+2=", "chosen": " 4", "rejected": " 4"}


def test_lineage_says_not_trained_and_why_when_the_checkpoint_dropped_the_trajectory(
        stack: Settings, topics: Topics, store: ObjectStore) -> None:
    from schemas.manifests import CheckpointManifest

    tid = recorded(stack, topics, store)
    batch_id = f"{topics.scored}:0:0-1"
    key = f"checkpoints/{topics.ns}/v7/manifest.json"
    store.put(key, CheckpointManifest(run="r", version=7, step=70, algorithm="grpo", files={}, offsets={0: 2},
                                      batch_ids=[batch_id], untrained={tid: "stale (3 versions behind)"}).to_json())
    publish(stack, topics.checkpoints, [CheckpointPublished(
        run="r", version=7, step=70, bucket="trajpipe", prefix=f"checkpoints/{topics.ns}/v7/", manifest_key=key,
        manifest_sha256="s", algorithm="grpo", batch_ids=(batch_id,), ts=T0)], key=b"r/v7")
    lineage = trace(stack, topics.ns, tid, store)
    assert lineage is not None
    by_version = {c["version"]: c["not_trained"] for c in lineage.checkpoints}
    assert by_version == {6: None, 7: "stale (3 versions behind)"}  # v6's manifest is not in the store
