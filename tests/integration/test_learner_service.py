"""The learner service against the real broker and store: crash at every point, restart, each batch once."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from consumers.shards import write_shard
from infra.kafka import Publisher
from infra.objectstore import ObjectStore
from infra.settings import Settings
from learner import checkpoint_store
from schemas import codec
from schemas.keys import batch_id, shard_key
from schemas.manifests import CheckpointManifest
from schemas.packing import pack_floats, pack_ids
from schemas.records import BatchManifest, SourcePosition, Trajectory, TrajectoryTurn
from schemas.topics import Topics

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def trajectory(rng: random.Random, ns: str, i: int) -> Trajectory:
    gen = [rng.randrange(3, 259) for _ in range(rng.randint(3, 8))] + [1]
    reward = float(rng.random() < 0.5)
    turn = TrajectoryTurn(turn=0, policy_version=0, obs_text="", obs_tokens=b"", text="x", tokens=pack_ids(gen),
                          logprobs=pack_floats([-1.5] * len(gen)), finish_reason="stop")
    return Trajectory(trajectory_id=f"traj-{i}", episode_id=f"ep-{i}", group_id=f"g-{i // 4}", task_id="t",
                      domain="math", run=ns, status="completed", task_spec="{}", prompt_text="1+1=",
                      prompt_tokens=pack_ids([52, 46, 52, 64]), turns=(turn,), reward=reward,
                      reward_components={"outcome/correct": reward}, reward_fn="default", reward_version="1",
                      advantage=reward - 0.5, group_reward_mean=0.5, group_reward_std=0.5,
                      source_topic=f"{ns}.rollout.events", source_offsets=(SourcePosition(0, i),),
                      started_ts=i, ended_ts=i + 1)


def publish_batches(stack: Settings, store: ObjectStore, topics: Topics, n_batches: int) -> list[str]:
    rng = random.Random(3)
    pub = Publisher(stack)
    ids = []
    for b in range(n_batches):
        first, last = b * 4, b * 4 + 3
        trajs = [trajectory(rng, topics.ns, i) for i in range(first, last + 1)]
        key = shard_key(topics.ns, topics.scored, 0, first, last)
        data = write_shard(trajs, key)
        sha = store.put_verified(key, data)
        bid = batch_id(topics.scored, 0, first, last)
        manifest = BatchManifest(batch_id=bid, run=topics.ns, bucket=store.bucket, key=key, sha256=sha,
                                 size=len(data), num_trajectories=4, num_tokens=40, source_topic=topics.scored,
                                 partition=0, first_offset=first, last_offset=last, policy_version_min=0,
                                 policy_version_max=0, reward_mean=0.5, reward_std=0.5,
                                 trajectory_ids=tuple(t.trajectory_id for t in trajs), ts=b)
        pub.send(topics.batches, None, codec.encode(manifest))
        if b == 2:  # a shard writer restarted: the same manifest again
            pub.send(topics.batches, None, codec.encode(manifest))
        ids.append(bid)
    pub.close()
    return ids


def run_learner(stack: Settings, ns: str, tmp: Path, fault: str | None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **stack.as_env(), "PYTHONPATH": str(ROOT)}
    env.pop("TRAJPIPE_FAULT", None)
    if fault:
        env["TRAJPIPE_FAULT"] = fault
    return subprocess.run(
        [sys.executable, "-m", "learner", "--ns", ns, "--layers", "2", "--width", "64", "--updates-per-checkpoint",
         "2", "--idle-exit", "4", "--cache-dir", str(tmp / "cache"), "--lr", "1e-3"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def announced_lineage(stack: Settings, store: ObjectStore, topics: Topics) -> list[CheckpointManifest]:
    events = [e for e in checkpoint_store.published(stack, topics) if e.run == topics.ns]
    final = max(e.version for e in events)
    keys = [f"checkpoints/{topics.ns}/v{v}/manifest.json" for v in range(final + 1)]
    return [CheckpointManifest.from_json(store.get(k)) for k in keys]


def test_crash_at_each_point_then_restart_trains_every_batch_exactly_once(
        stack: Settings, topics: Topics, store: ObjectStore, tmp_path: Path) -> None:
    published = publish_batches(stack, store, topics, 12)
    for fault in ("mid_update:3", "after_save:2", "after_publish:2"):
        proc = run_learner(stack, topics.ns, tmp_path, fault)
        assert proc.returncode == -9, f"{fault} did not fire: {proc.stderr[-2000:]}"
    proc = run_learner(stack, topics.ns, tmp_path, None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed v" in proc.stderr

    lineage = announced_lineage(stack, store, topics)
    trained = [b for m in lineage for b in m.batch_ids]
    assert sorted(trained) == sorted(published)  # each once: no repeat, no skip
    assert lineage[0].version == 0 and lineage[0].batch_ids == []
    assert [m.version for m in lineage] == list(range(len(lineage)))
    final = lineage[-1]
    assert final.offsets == {0: 13}  # 12 manifests + the duplicate, all consumed
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["version"] == final.version


def test_a_checkpoint_loads_with_from_pretrained(stack: Settings, topics: Topics, store: ObjectStore,
                                                  tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    publish_batches(stack, store, topics, 2)
    assert run_learner(stack, topics.ns, tmp_path, None).returncode == 0
    loaded = checkpoint_store.newest(stack, topics, store, run=topics.ns)
    assert loaded is not None and loaded.manifest.version == 1
    for name, data in loaded.files.items():
        (tmp_path / name).write_bytes(data)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    assert model.config.num_hidden_layers == 2
