"""The learner service against the real broker and store: crash at every point, restart, each batch once."""
from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from typing import Any

import pytest
import torch

from consumers.shards import read_shard, write_shard
from infra.bootstrap import bootstrap, delete_topics
from infra.kafka import Publisher, read_topic
from infra.objectstore import ObjectStore
from infra.settings import Settings
from learner import checkpoint_store
from learner.checkpoint_files import read_checkpoint
from schemas import codec
from schemas.keys import batch_id, shard_key
from schemas.manifests import LEARNER_FINISHED_LINE, CheckpointManifest
from schemas.packing import pack_floats, pack_ids
from schemas.records import BatchManifest, SourcePosition, Trajectory, TrajectoryTurn
from schemas.topics import Topics

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def trajectory(rng: random.Random, ns: str, i: int, status: str = "completed", version: int = 0,
               answer: tuple[int, ...] = ()) -> Trajectory:
    gen = list(answer) or [rng.randrange(3, 259) for _ in range(rng.randint(3, 8))] + [1]
    reward = float(rng.random() < 0.5)
    turn = TrajectoryTurn(turn=0, policy_version=version, obs_text="", obs_tokens=b"", text="x", tokens=pack_ids(gen),
                          logprobs=pack_floats([-1.5] * len(gen)), finish_reason="stop")
    return Trajectory(trajectory_id=f"traj-{i}", episode_id=f"ep-{i}", group_id=f"g-{i // 4}", task_id="t",
                      domain="math", run=ns, status=status, task_spec="{}", prompt_text="1+1=",
                      prompt_tokens=pack_ids([52, 46, 52, 64]), turns=(turn,), reward=reward,
                      reward_components={"outcome/correct": reward}, reward_fn="default", reward_version="1",
                      advantage=reward - 0.5, group_reward_mean=0.5, group_reward_std=0.5,
                      source_topic=f"{ns}.rollout.events", source_offsets=(SourcePosition(0, i),),
                      started_ts=i, ended_ts=i + 1)


def publish_batches(stack: Settings, store: ObjectStore, topics: Topics, n_batches: int,
                    aborted: tuple[int, ...] = (), versions: dict[int, int | tuple[int, ...]] | None = None,
                    run: str | None = None, answer: tuple[int, ...] = ()) -> list[str]:
    """n_batches of 4 trajectories (the same bytes for every namespace); batches in `aborted` train nothing;
    `versions`: batch -> the policy version of its turns, or of each trajectory's (default 0); `run`: the run
    that generated them (default: this namespace's; another one's for replayed history); `answer`: the tokens
    every trajectory generated (default: random ones)."""
    rng = random.Random(3)
    pub = Publisher(stack)
    ids = []
    for b in range(n_batches):
        first, last = b * 4, b * 4 + 3
        status = "aborted" if b in aborted else "completed"
        given = (versions or {}).get(b, 0)
        each = given if isinstance(given, tuple) else (given,) * 4
        trajs = [trajectory(rng, run or topics.ns, i, status, each[i - first], answer) for i in range(first, last + 1)]
        key = shard_key(topics.ns, topics.scored, 0, first, last)
        data = write_shard(trajs, key)
        sha = store.put_verified(key, data)
        bid = batch_id(topics.scored, 0, first, last)
        manifest = BatchManifest(batch_id=bid, run=topics.ns, bucket=store.bucket, key=key, sha256=sha,
                                 size=len(data), num_trajectories=4, num_tokens=40, source_topic=topics.scored,
                                 partition=0, first_offset=first, last_offset=last, policy_version_min=min(each),
                                 policy_version_max=max(each), reward_mean=0.5, reward_std=0.5,
                                 trajectory_ids=tuple(t.trajectory_id for t in trajs), ts=b)
        pub.send(topics.batches, None, codec.encode(manifest))
        if b == 2:  # a shard writer restarted: the same manifest again
            pub.send(topics.batches, None, codec.encode(manifest))
        ids.append(bid)
    pub.close()
    return ids


def run_learner(stack: Settings, ns: str, tmp: Path, fault: str | None, *extra: str,
                launch: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """`python -m learner` on the small model; `launch`: torchrun's arguments, to run it as that job."""
    env = {**os.environ, **stack.as_env(), "PYTHONPATH": str(ROOT)}
    env.pop("TRAJPIPE_FAULT", None)
    if fault:
        env["TRAJPIPE_FAULT"] = fault
    start = [sys.executable, "-m", "torch.distributed.run", *launch] if launch else [sys.executable]
    return subprocess.run(
        [*start, "-m", "learner", "--ns", ns, "--layers", "2", "--width", "64", "--updates-per-checkpoint",
         "2", "--idle-exit", "4", "--cache-dir", str(tmp / "cache"), "--lr", "1e-3", *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def announced_lineage(stack: Settings, store: ObjectStore, topics: Topics) -> list[CheckpointManifest]:
    events = [e for e in checkpoint_store.published(stack, topics) if e.run == topics.ns]
    final = max(e.version for e in events)
    keys = [f"checkpoints/{topics.ns}/v{v}/manifest.json" for v in range(final + 1)]
    return [CheckpointManifest.from_json(store.get(k)) for k in keys]


def final_weights(store: ObjectStore, ns: str, version: int) -> dict[str, Any]:
    from safetensors.torch import load

    return load(checkpoint_store.load_version(store, ns, version).files["model.safetensors"])


def test_crash_at_each_point_then_restart_trains_every_batch_exactly_once(
        stack: Settings, topics: Topics, store: ObjectStore, tmp_path: Path) -> None:
    # SFT, then GRPO with a KL term to checkpoint v0: whether the run switched phase in one process or
    # resumed after the switch, the reference is v0, never the weights it switched or resumed at.
    flags = ("--sft-updates", "2", "--kl-coef", "0.5", "--max-policy-lag", "100")
    published = publish_batches(stack, store, topics, 12)
    for fault in ("mid_update:3", "after_save:2", "after_publish:2"):
        proc = run_learner(stack, topics.ns, tmp_path, fault, *flags)
        assert proc.returncode == -9, f"{fault} did not fire: {proc.stderr[-2000:]}"
    proc = run_learner(stack, topics.ns, tmp_path, None, *flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed v" in proc.stderr

    lineage = announced_lineage(stack, store, topics)
    trained = [b for m in lineage for b in m.batch_ids]
    skipped = [b for m in lineage for b in m.skipped_batches]  # an SFT batch with no success trains nothing
    assert sorted(trained + skipped) == sorted(published)  # each once: no repeat, no skip
    assert lineage[0].version == 0 and lineage[0].batch_ids == []
    assert [m.version for m in lineage] == list(range(len(lineage)))
    final = lineage[-1]
    assert final.offsets == {0: 13}  # 12 manifests + the duplicate, all consumed
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["version"] == final.version

    # The same batches, never interrupted: the same weights, not only the same batch ids.
    calm = Topics(f"{topics.ns}-calm")
    bootstrap(stack, calm.ns, partitions=1)
    publish_batches(stack, store, calm, 12)
    proc = run_learner(stack, calm.ns, tmp_path / "calm", None, *flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    crashed, uninterrupted = final_weights(store, topics.ns, final.version), final_weights(store, calm.ns, final.version)
    assert crashed.keys() == uninterrupted.keys()
    for name, tensor in crashed.items():
        torch.testing.assert_close(tensor, uninterrupted[name], rtol=0, atol=1e-6, msg=name)


def test_weights_only_versions_resume_from_the_moments_before_them_and_end_with_the_same_weights(
        stack: Settings, topics: Topics, store: ObjectStore, tmp_path: Path) -> None:
    """--moments-every 3: v1 and v2 carry no optimizer state. Killed after announcing v2, a restart resumes
    from v0 and trains v1's and v2's batches again (killed once more in the middle of that), in the order they
    were read, two shards an update as they were grouped; then it goes on. The weights at the end are an
    uninterrupted run's that stored the moments in every version."""
    flags = ("--sft-updates", "2", "--kl-coef", "0.5", "--max-policy-lag", "100", "--rl-batches-per-update", "2")
    published = publish_batches(stack, store, topics, 12)
    logs = []
    for fault in ("after_publish:3", "mid_update:3", "after_save:2"):
        proc = run_learner(stack, topics.ns, tmp_path, fault, *flags, "--moments-every", "3")
        assert proc.returncode == -9, f"{fault} did not fire: {proc.stderr[-2000:]}"
        logs.append(proc.stderr)
    proc = run_learner(stack, topics.ns, tmp_path, None, *flags, "--moments-every", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "v1..v2 are weights-only: their batches train again" in logs[1] and "resumed v0" in logs[2]
    assert "v2 trained again (4 batches, 4 updates): the announced weights, bit for bit" in logs[2]
    assert "resumed v3 after 6 updates" in proc.stderr and "trained again" not in proc.stderr

    lineage = announced_lineage(stack, store, topics)
    assert [m.version for m in lineage] == [0, 1, 2, 3, 4]
    moments = [v for v, m in enumerate(lineage) if "optimizer.safetensors" in m.files]
    assert moments == [0, 3, 4]  # v0, every third, and the clean stop's
    weights_only = lineage[1].files
    assert set(weights_only) == {"model.safetensors", "config.json", "trainer_state.json"}
    assert lineage[3].files["optimizer.safetensors"].size > 1.5 * lineage[3].files["model.safetensors"].size
    trained = [b for m in lineage for b in m.batch_ids]
    skipped = [b for m in lineage for b in m.skipped_batches]
    assert sorted(trained + skipped) == sorted(published)  # each once, whatever was trained again
    assert lineage[-1].offsets == {0: 13}

    calm = Topics(f"{topics.ns}-calm")
    bootstrap(stack, calm.ns, partitions=1)
    publish_batches(stack, store, calm, 12)
    proc = run_learner(stack, calm.ns, tmp_path / "calm", None, *flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for v in range(5):
        crashed, uninterrupted = final_weights(store, topics.ns, v), final_weights(store, calm.ns, v)
        assert crashed.keys() == uninterrupted.keys()
        for name, tensor in crashed.items():
            torch.testing.assert_close(tensor, uninterrupted[name], rtol=0, atol=0, msg=f"v{v} {name}")


def test_a_batch_that_trains_nothing_is_skipped_with_its_reason_and_no_version(
        stack: Settings, topics: Topics, store: ObjectStore, tmp_path: Path) -> None:
    published = publish_batches(stack, store, topics, 4, aborted=(1,))
    proc = run_learner(stack, topics.ns, tmp_path, None, "--updates-per-checkpoint", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lineage = announced_lineage(stack, store, topics)
    assert [m.version for m in lineage] == [0, 1, 2, 3]          # three updates, three versions
    assert [m.batch_ids for m in lineage[1:]] == [[published[0]], [published[2]], [published[3]]]
    assert lineage[2].skipped_batches == {published[1]: "no trainable tokens (skipped/aborted=4)"}
    assert "nan" not in proc.stderr and f"batch {published[1]} skipped" in proc.stderr


def test_with_a_bf16_broadcast_a_following_worker_downloads_half_the_bytes_and_eval_the_float32_weights(
        stack: Settings, topics: Topics, store: ObjectStore, tmp_path: Path) -> None:
    from safetensors.torch import load as load_safetensors

    from producers.checkpoints import BROADCAST_FILE, WEIGHTS_FILE, CheckpointFollower
    from producers.settings import WorkerSettings
    from producers.worker import RolloutWorker

    publish_batches(stack, store, topics, 2)
    proc = run_learner(stack, topics.ns, tmp_path, None, "--broadcast-bf16")
    assert proc.returncode == 0, proc.stderr
    manifest = checkpoint_store.read_manifest(store, topics.ns, 1)
    assert {WEIGHTS_FILE, BROADCAST_FILE} <= set(manifest.files)
    files = checkpoint_store.load_version(store, topics.ns, 1).files  # every file verified by its sha256
    full = load_safetensors(files[WEIGHTS_FILE])

    settings = WorkerSettings(ns=topics.ns, producer_id="bf16", group_size=2, max_new_tokens=4, layers=2, width=64,
                              episodes=2, prompts_per_step=1)
    worker = RolloutWorker(settings, stack)
    worker.follower = CheckpointFollower(stack, topics, store)
    worker.follower.start()
    try:
        deadline = time.monotonic() + 60
        while worker.backend.version < 1 and time.monotonic() < deadline:
            worker.maybe_load_checkpoint()
            time.sleep(0.2)
    finally:
        worker.follower.stop()
    assert worker.backend.version == 1 and not worker.follower.refused
    own = worker.backend.model.state_dict()  # type: ignore[attr-defined]
    # it generates with the rounded weights, held as float32, and moved half the float32 file's bytes per version
    assert all(torch.equal(own[k], v.to(torch.bfloat16).float()) for k, v in full.items())
    assert any(not torch.equal(own[k], v) for k, v in full.items())
    loaded = worker.report()["checkpoint_bytes"]
    assert loaded == sum(manifest.files[BROADCAST_FILE].size for _ in worker.stats.versions_loaded)
    assert manifest.files[BROADCAST_FILE].size < 0.52 * manifest.files[WEIGHTS_FILE].size
    worker.sink.close()
    worker.code_runner.close()

    # a worker started from a named version (eval, export's card) holds the float32 weights themselves
    evaluator = RolloutWorker(replace(settings, producer_id="eval", follow_checkpoints=False,
                                      init_checkpoint=f"{topics.ns}:1"), stack)
    held = evaluator.backend.model.state_dict()  # type: ignore[attr-defined]
    assert all(torch.equal(held[k], v) for k, v in full.items())
    evaluator.sink.close()
    evaluator.code_runner.close()


def test_an_exported_checkpoint_loads_with_from_pretrained_and_generates_as_the_learners_copy(
        stack: Settings, topics: Topics, store: ObjectStore, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from learner.service import model_from_config
    from producers.policy.tokenizer import PolicyTokenizer, load_hf_tokenizer

    publish_batches(stack, store, topics, 2)
    assert run_learner(stack, topics.ns, tmp_path, None).returncode == 0
    results = [{"version": 1, "mode": "greedy", "success": 0.25, "ci_low": 0.1, "ci_high": 0.4, "episodes": 32,
                "reward_mean": 0.3}]
    (tmp_path / "eval.json").write_text(json.dumps(results))
    out = tmp_path / "hf"
    env = {**os.environ, **stack.as_env(), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "learner.export", "--ns", topics.ns, "--version", "latest", "--out",
                           str(out), "--eval", str(tmp_path / "eval.json")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert not (out / "optimizer.safetensors").exists()  # a plain folder: weights, config, tokenizer, card
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert model.config.num_hidden_layers == 2
    card = (out / "README.md").read_text()
    assert f"# {topics.ns} v1" in card and "grpo" in card and "| greedy | 0.250 |" in card

    loaded = checkpoint_store.load_version(store, topics.ns, 1)
    state = read_checkpoint(loaded.files)
    own = model_from_config(state.model_config).eval()
    own.load_state_dict(state.model, strict=False)
    prompt = "1+1="
    ours = PolicyTokenizer(load_hf_tokenizer(None)).encode(prompt)
    assert tokenizer(prompt, add_special_tokens=True)["input_ids"][:len(ours)] == ours
    ids = torch.tensor([ours])
    with torch.no_grad():
        exported = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
        learners = own.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert exported.tolist() == learners.tolist()


def test_several_shards_make_one_policy_gradient_update(stack: Settings, topics: Topics, store: ObjectStore,
                                                        tmp_path: Path) -> None:
    published = publish_batches(stack, store, topics, 6)
    proc = run_learner(stack, topics.ns, tmp_path, None, "--updates-per-checkpoint", "1", "--rl-batches-per-update",
                       "3", "--max-policy-lag", "100")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lineage = announced_lineage(stack, store, topics)
    assert [m.batch_ids for m in lineage] == [[], published[:3], published[3:]]   # two updates of three shards
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["updates"] == 2


def test_each_version_says_how_many_batches_the_next_one_trains_on(stack: Settings, topics: Topics,
                                                                     store: ObjectStore, tmp_path: Path) -> None:
    """One SFT update (a version of its own), then GRPO updates of 2 shards, a version every 2 updates, 5
    updates in all: v0 needs 1 batch, v1 2 (its phase ends at update 2), v2 4, v3 the 2 of the last update.
    Rollout workers past their quota go on generating while the topic holds fewer past the version's offsets.
    (The first batch has no successful trajectory for SFT: skipped, so v1 reads 2 records; the third batch's
    manifest comes twice, one record more for v2.)"""
    publish_batches(stack, store, topics, 10)
    proc = run_learner(stack, topics.ns, tmp_path, None, "--sft-updates", "1", "--sft-updates-per-checkpoint", "1",
                       "--rl-batches-per-update", "2", "--max-updates", "5", "--max-policy-lag", "100")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lineage = announced_lineage(stack, store, topics)
    assert [(len(m.batch_ids), m.next_batches) for m in lineage] == [(0, 1), (1, 2), (2, 4), (4, 2), (2, 2)]
    assert [m.offsets.get(0, 0) for m in lineage] == [0, 2, 5, 9, 11]


def compact_now(stack: Settings, topic: str) -> None:
    """Make the broker's log cleaner compact `topic` as soon as a segment closes."""
    from confluent_kafka.admin import AlterConfigOpType, ConfigEntry, ConfigResource

    from infra.kafka import admin

    entries = [ConfigEntry(name, value, incremental_operation=AlterConfigOpType.SET) for name, value in (
        ("segment.ms", "300"), ("min.cleanable.dirty.ratio", "0.001"), ("min.compaction.lag.ms", "0"))]
    client = admin(stack)  # held until the futures resolve
    for future in client.incremental_alter_configs([ConfigResource("topic", topic, incremental_configs=entries)]
                                                   ).values():
        future.result(timeout=30)


def test_compaction_keeps_every_version_and_a_broken_newest_falls_back_to_the_one_before(
        stack: Settings, topics: Topics, store: ObjectStore, tmp_path: Path) -> None:
    publish_batches(stack, store, topics, 8)
    proc = run_learner(stack, topics.ns, tmp_path, None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    announced = [e for e in checkpoint_store.published(stack, topics) if e.run == topics.ns]
    versions = [e.version for e in announced]
    assert versions == list(range(len(versions))) and len(versions) >= 4

    # The newest version announced again (a learner restarted after publishing), then the log cleaner runs:
    # it drops that repeat, and must keep every other version.
    compact_now(stack, topics.checkpoints)
    pub = Publisher(stack)
    newest_event = announced[-1]
    for _ in range(2):
        checkpoint_store.announce(pub, topics, store, CheckpointManifest.from_json(
            store.get(newest_event.manifest_key)), newest_event.manifest_key, newest_event.manifest_sha256)
        time.sleep(1.0)  # the next record rolls the segment, which the cleaner may then compact
    deadline = time.monotonic() + 90
    while len(list(read_topic(stack, topics.checkpoints))) > len(versions) + 1:
        assert time.monotonic() < deadline, "the log cleaner never compacted the checkpoint topic"
        time.sleep(2)
    assert [e.version for e in checkpoint_store.published(stack, topics) if e.run == topics.ns] == versions

    # The newest checkpoint stops verifying: the learner resumes from the one before, never from fresh weights.
    newest = versions[-1]
    store.put(f"checkpoints/{topics.ns}/v{newest}/model.safetensors", b"not the weights it announced")
    proc = run_learner(stack, topics.ns, tmp_path, None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"checkpoint v{newest} does not verify" in proc.stderr and f"resumed v{newest - 1}" in proc.stderr
    assert "fresh" not in proc.stderr
    lineage = announced_lineage(stack, store, topics)
    trained = [b for m in lineage for b in [*m.batch_ids, *m.skipped_batches]]
    assert len(trained) == len(set(trained)) == 8  # the broken version's batches trained again, once
    checkpoint_store.load_version(store, topics.ns, newest)  # re-made, and it verifies

    # None verifies: the learner refuses, saying what to do, instead of announcing a second v0.
    for version in versions:
        store.put(f"checkpoints/{topics.ns}/v{version}/model.safetensors", b"gone")
    proc = run_learner(stack, topics.ns, tmp_path, None)
    assert proc.returncode == 2 and "none of them verifies" in proc.stderr, proc.stderr[-2000:]


def test_missing_corrupt_and_garbage_batches_are_skipped_with_their_reason_never_a_crash(
        stack: Settings, topics: Topics, store: ObjectStore, tmp_path: Path) -> None:
    published = publish_batches(stack, store, topics, 8)
    manifests = {m.batch_id: m for m in (codec.decode(msg.value()) for msg in read_topic(stack, topics.batches))}
    missing, corrupt = manifests[published[2]], manifests[published[5]]
    store.delete(missing.key)
    store.put(corrupt.key, b"not the shard its manifest names")
    pub = Publisher(stack)
    pub.send(topics.batches, None, b"\x00garbage, not a BatchManifest")
    pub.close()
    proc = run_learner(stack, topics.ns, tmp_path, None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lineage = announced_lineage(stack, store, topics)
    skipped = {b: why for m in lineage for b, why in m.skipped_batches.items()}
    assert "missing shard" in skipped[missing.batch_id] and missing.key in skipped[missing.batch_id]
    assert "corrupt shard" in skipped[corrupt.batch_id]
    trained = [b for m in lineage for b in m.batch_ids]
    assert sorted(trained + list(skipped)) == sorted(published)  # the others trained, each once
    reader = json.loads(proc.stdout.strip().splitlines()[-1])["reader"]
    assert (reader["reader/missing_shards"], reader["reader/corrupt_shards"], reader["reader/bad_manifests"]) == \
        (1, 1, 1)


def test_a_rebuild_from_the_batch_log_reproduces_every_version_bit_for_bit(
        stack: Settings, topics: Topics, store: ObjectStore, tmp_path: Path) -> None:
    publish_batches(stack, store, topics, 8, aborted=(4,))  # batch 4 trains nothing: skipped, in order
    proc = run_learner(stack, topics.ns, tmp_path, None, "--sft-updates", "2", "--kl-coef", "0.1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    source = announced_lineage(stack, store, topics)
    assert len(source) >= 4 and any(m.skipped_batches for m in source)
    env = {**os.environ, **stack.as_env(), "PYTHONPATH": str(ROOT)}

    def rebuild(to_ns: str, *extra: str, rescored: str = "") -> dict[str, Any]:
        own = ["--rescored", rescored] if rescored else []
        done = subprocess.run([sys.executable, "-m", "learner.rebuild", "--from-ns", topics.ns, "--to-ns", to_ns,
                               "--cache-dir", str(tmp_path / to_ns), "--json", *own, *(("--", *extra) if extra else ())],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode in (0, 1), done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]

    same = rebuild(f"{topics.ns}-rebuilt")
    assert same["versions"] == {str(m.version): "identical" for m in source}
    rebuilt = announced_lineage(stack, store, Topics(f"{topics.ns}-rebuilt"))
    assert [(m.batch_ids, m.skipped_batches) for m in rebuilt] == [(m.batch_ids, m.skipped_batches) for m in source]

    other = rebuild(f"{topics.ns}-lr", "--lr", "3e-3")  # what if: another learning rate on the same batches
    assert other["what_if"] and other["versions"]["0"] == "identical"
    assert all(verdict.startswith("max |diff|") for v, verdict in other["versions"].items() if v != "0")

    # re-scored history: the same scores reproduce the source bit for bit; other ones make a new lineage
    batches = [codec.decode(msg.value()) for msg in read_topic(stack, topics.batches)]
    trajectories = [t for m in batches for t in read_shard(store.get(m.key))]

    def rescore(ns: str, changed: list[Trajectory]) -> None:
        bootstrap(stack, ns, partitions=2)
        pub = Publisher(stack)
        for t in changed:
            pub.send(Topics(ns).scored, t.trajectory_id.encode(), codec.encode(t))
        pub.close()

    rescore(f"{topics.ns}-same", trajectories)
    unchanged = rebuild(f"{topics.ns}-same-train", rescored=f"{topics.ns}-same")
    assert unchanged["left_out"] == 0 and unchanged["versions"] == {str(m.version): "identical" for m in source}
    flipped = [replace(t, reward=-t.reward, advantage=-t.advantage) for t in trajectories[1:]]  # one not scored
    rescore(f"{topics.ns}-flip", flipped)
    what_if = rebuild(f"{topics.ns}-flip-train", rescored=f"{topics.ns}-flip")
    assert what_if["what_if"] and what_if["left_out"] == 1 and what_if["versions"]["0"] == "identical"
    assert any(verdict.startswith("max |diff|") for verdict in what_if["versions"].values())
    retrained = announced_lineage(stack, store, Topics(f"{topics.ns}-flip-train"))
    shard = read_shard(store.get(next(m for m in (codec.decode(msg.value()) for msg in read_topic(
        stack, Topics(f"{topics.ns}-flip-train").batches)) if m.num_trajectories).key))
    assert all(t.advantage == -by_id.advantage for t in shard
               for by_id in trajectories if by_id.trajectory_id == t.trajectory_id)
    assert [m.read_order for m in retrained] == [m.read_order for m in source]  # the same batches, in order

    delete_topics(stack, [topics.batches])  # retention dropped the batch manifests: the shards remain
    again = rebuild(f"{topics.ns}-from-shards")
    assert again["batches_from"] == "the shards in the object store"
    assert again["versions"] == {str(m.version): "identical" for m in source}


def test_each_checkpoint_records_which_trajectories_did_not_train_and_why(
        stack: Settings, topics: Topics, store: ObjectStore, tmp_path: Path) -> None:
    # turns of versions 0, 0, 0, 1, 1, 0, 2, 2: batch 5's are 2 versions behind when it comes; batch 1 is aborted
    publish_batches(stack, store, topics, 8, aborted=(1,), versions={3: 1, 4: 1, 6: 2, 7: 2})
    proc = run_learner(stack, topics.ns, tmp_path, None, "--max-policy-lag", "1", "--prefetch", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lineage = announced_lineage(stack, store, topics)
    manifests = {m.batch_id: m for m in (codec.decode(msg.value()) for msg in read_topic(stack, topics.batches))}
    untrained = {t: why for m in lineage for t, why in m.untrained.items()}
    skipped = {b for m in lineage for b in m.skipped_batches}
    for batch_id, manifest in manifests.items():
        ids = set(manifest.trajectory_ids)
        if batch_id in skipped:  # the aborted batch, and batches gone stale (their turns are all v0), each
            # trajectory with its own reason where an update of other batches took them along
            assert all(untrained[t].startswith(("its batch trained nothing", "stale", "aborted")) for t in ids), \
                (batch_id, [untrained.get(t) for t in ids])
        else:
            assert not ids & set(untrained), batch_id
    aborted = manifests[sorted(manifests, key=lambda b: manifests[b].first_offset)[1]]
    assert all("aborted" in untrained[t] for t in aborted.trajectory_ids)
    assert any("stale" in why for why in untrained.values()), (untrained, [m.skipped_batches for m in lineage])


def learner_counts(stack: Settings, topics: Topics) -> dict[str, float]:
    """The learner's per-update counters on the metrics topic, summed over its updates."""
    totals: dict[str, float] = {}
    for message in read_topic(stack, topics.metrics):
        metric = codec.decode(message.value())
        if metric.source == "learner" and metric.name.startswith(("policy_lag/", "skipped/", "stale/")):
            totals[metric.name] = totals.get(metric.name, 0.0) + metric.value
    return totals


def test_retraining_history_from_a_named_checkpoint_measures_lag_in_the_source_runs_versions(
        stack: Settings, topics: Topics, store: ObjectStore, tmp_path: Path) -> None:
    publish_batches(stack, store, topics, 6)  # the source run: v0..v3
    assert run_learner(stack, topics.ns, tmp_path, None).returncode == 0
    # Its history replayed into a new namespace: the turns keep the source's run and versions (batch b: v_b).
    retrain = Topics(f"{topics.ns}-retrain", partitions=1)
    bootstrap(stack, retrain.ns, partitions=1)
    publish_batches(stack, store, retrain, 6, versions={b: b for b in range(6)}, run=topics.ns)
    proc = run_learner(stack, retrain.ns, tmp_path, None, "--init", f"{topics.ns}:v2", "--max-policy-lag", "2",
                       "--updates-per-checkpoint", "1", "--prefetch", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lineage = announced_lineage(stack, store, retrain)
    assert lineage[0].init_from == f"{topics.ns}:v2"
    source_v2 = final_weights(store, topics.ns, 2)
    assert all(t.equal(source_v2[k]) for k, t in final_weights(store, retrain.ns, 0).items())
    # At version n, a turn of source version s is n + |2 - s| away: batches 0-2 at lag 2 train (v1..v3);
    # then, at v3, batches 3, 4, 5 are 4, 5 and 6 versions away: stale. A local counter would say lag n - s.
    counts = learner_counts(stack, retrain)
    assert (counts["policy_lag/2"], counts["policy_lag/3-4"], counts["policy_lag/5-8"]) == (12, 4, 8)
    assert counts["policy_lag/ahead"] == 0 and counts["stale/dropped"] == 12 and counts["skipped/foreign"] == 0
    assert sum(v for k, v in counts.items() if k.startswith("policy_lag/") and k != "policy_lag/token_mean") == 24
    assert len(lineage) == 4 and lineage[-1].step == 3
    # Restarted without --init, it keeps the lineage its v0 recorded: one more batch of source v2 is 3 away.
    publish_batches(stack, store, retrain, 7, versions={b: 2 for b in range(7)}, run=topics.ns)
    proc = run_learner(stack, retrain.ns, tmp_path, None, "--max-policy-lag", "2", "--updates-per-checkpoint", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"lineage: {retrain.ns}:v0 <- {topics.ns}:v2" in proc.stderr
    after = learner_counts(stack, retrain)
    assert after["policy_lag/3-4"] > 4 and after["skipped/foreign"] == 0 and after["policy_lag/ahead"] == 0


def stored_optimizer(store: ObjectStore, ns: str, version: int) -> Any:
    return read_checkpoint(checkpoint_store.load_version(store, ns, version).files).optimizer


def test_init_moments_carries_the_named_checkpoints_adam_moments_under_the_new_runs_learning_rate(
        stack: Settings, topics: Topics, store: ObjectStore, tmp_path: Path) -> None:
    flags = ("--updates-per-checkpoint", "1", "--max-policy-lag", "99", "--moments-every", "3")
    publish_batches(stack, store, topics, 5)  # the source run: v0..v5, moments in v0, v3 and v5 (its last)
    assert run_learner(stack, topics.ns, tmp_path, None, *flags).returncode == 0
    source = stored_optimizer(store, topics.ns, 3)
    assert source is not None and stored_optimizer(store, topics.ns, 2) is None
    runs = {name: Topics(f"{topics.ns}-{name}", partitions=1) for name in ("moments", "fresh", "weights-only")}
    for t in runs.values():
        bootstrap(stack, t.ns, partitions=1)

    def retrain(name: str, *extra: str) -> subprocess.CompletedProcess[str]:
        return run_learner(stack, runs[name].ns, tmp_path, None, "--idle-exit", "1", "--lr", "5e-4", *extra)

    proc = retrain("moments", "--init", f"{topics.ns}:v3", "--init-moments")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"the weights and Adam moments of {topics.ns}:v3" in proc.stderr
    carried = stored_optimizer(store, runs["moments"].ns, 0)  # v0 stores them: other ranks and a resume read them
    assert carried.tensors.keys() == source.tensors.keys() and any("exp_avg_sq" in k for k in carried.tensors)
    assert all(carried.tensors[k].equal(source.tensors[k]) for k in source.tensors)
    assert carried.meta["scalars"] == source.meta["scalars"]  # Adam's step counts: its bias correction goes on
    assert [g["lr"] for g in carried.meta["param_groups"]] == [5e-4] and source.meta["param_groups"][0]["lr"] == 1e-3
    # Without the flag, v0 starts a fresh Adam, as before.
    assert retrain("fresh", "--init", f"{topics.ns}:v3").returncode == 0
    assert stored_optimizer(store, runs["fresh"].ns, 0).tensors == {}
    # A weights-only version has no moments to carry: a clear error, and nothing published.
    proc = retrain("weights-only", "--init", f"{topics.ns}:v2", "--init-moments")
    assert proc.returncode != 0 and f"--init-moments: {topics.ns}:v2 carries no optimizer state" in proc.stderr
    assert not store.list(f"checkpoints/{runs['weights-only'].ns}/")


def test_an_update_reads_on_past_stale_trajectories_until_it_holds_its_batches_of_trainable_ones(
        stack: Settings, topics: Topics, store: ObjectStore, tmp_path: Path) -> None:
    """--rl-batches-per-update counts trainable trajectories, not batches read: at v1, strictly on-policy, batch 2
    is half v0, batch 3 all v0, batch 4 all v1 and batch 5 half v1, so the second update
    trains batches 2 to 5 (8 trajectories), where counting batches made it train 2 of 2 batches' 8 and the third
    update nothing. A default demo's updates trained 381 of their 512 trajectories on average this way."""
    versions: dict[int, int | tuple[int, ...]] = {2: (0, 0, 1, 1), 3: 0, 4: 1, 5: (1, 1, 0, 0), 6: 2, 7: 2}
    ids = publish_batches(stack, store, topics, 8, versions=versions)
    proc = run_learner(stack, topics.ns, tmp_path, None, "--updates-per-checkpoint", "1", "--max-policy-lag", "0",
                       "--rl-batches-per-update", "2", "--max-updates", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lineage = announced_lineage(stack, store, topics)
    assert [m.version for m in lineage] == [0, 1, 2, 3]
    assert [m.read_order for m in lineage[1:]] == [ids[0:2], ids[2:6], ids[6:8]]
    assert len(lineage[2].untrained) == 8 and all(why.startswith("stale") for why in lineage[2].untrained.values())
    trained = [4 * len(m.read_order) - len(m.untrained) for m in lineage[1:]]
    assert trained == [8, 8, 8]


RETAIN = ("--updates-per-checkpoint", "1", "--max-policy-lag", "99", "--keep-last", "2", "--keep-every", "3")


def test_a_retention_keeps_the_last_versions_every_nth_and_v0_and_every_manifest(
        stack: Settings, topics: Topics, store: ObjectStore, tmp_path: Path) -> None:
    publish_batches(stack, store, topics, 8)
    proc = run_learner(stack, topics.ns, tmp_path, None, *RETAIN)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lineage = announced_lineage(stack, store, topics)  # every manifest is still there
    final = lineage[-1].version
    assert final == 8 and [m.version for m in lineage] == list(range(9))
    kept = {m.version for m in lineage if store.list(f"checkpoints/{topics.ns}/v{m.version}/model.safetensors")}
    assert kept == {0, 3, 6, 7, 8}
    assert all(store.list(f"checkpoints/{topics.ns}/v{v}/") == [f"checkpoints/{topics.ns}/v{v}/manifest.json"]
               for v in set(range(9)) - kept)
    with pytest.raises(Exception, match="retention"):
        checkpoint_store.load_version(store, topics.ns, 5)
    # a restart resumes from the newest, and goes on letting go of what leaves the last two
    publish_batches(stack, store, topics, 10)
    proc = run_learner(stack, topics.ns, tmp_path, None, *RETAIN)
    assert proc.returncode == 0 and "resumed v8" in proc.stderr, proc.stderr[-3000:]
    kept = {v for v in range(11) if store.list(f"checkpoints/{topics.ns}/v{v}/model.safetensors")}
    assert kept == {0, 3, 6, 9, 10}


def test_a_retention_keeps_the_newest_version_with_moments_until_a_newer_one_has_them(
        stack: Settings, topics: Topics, store: ObjectStore, tmp_path: Path) -> None:
    """--keep-last 2 --moments-every 4: v4 leaves the last two while v5 and v6 are weights-only, and a restart
    would resume there, so it stays until v8 has moments."""
    flags = ("--updates-per-checkpoint", "1", "--max-policy-lag", "99", "--keep-last", "2", "--moments-every", "4")
    publish_batches(stack, store, topics, 8)

    def kept() -> set[int]:
        return {v for v in range(10) if store.list(f"checkpoints/{topics.ns}/v{v}/model.safetensors")}

    proc = run_learner(stack, topics.ns, tmp_path, "after_publish:7", *flags)  # v0 is the first
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert kept() == {0, 4, 5, 6}
    proc = run_learner(stack, topics.ns, tmp_path, None, *flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed v4 after 4 updates" in proc.stderr
    assert "v6 trained again (1 batch, 6 updates): the announced weights, bit for bit" in proc.stderr
    assert kept() == {0, 7, 8}
    lineage = announced_lineage(stack, store, topics)
    assert [v for v, m in enumerate(lineage) if "optimizer.safetensors" in m.files] == [0, 4, 8]


def test_a_demo_lets_go_of_the_versions_it_did_not_evaluate_but_not_of_the_resume_point_or_any_manifest(
        stack: Settings, topics: Topics, store: ObjectStore, tmp_path: Path) -> None:
    """A default demo announced 86 versions of ~49 MB and kept every one: a dozen runs filled a 50 GB disk. After
    its evaluation it keeps the versions it evaluated and the newest with moments (v6 here, under
    --moments-every 3), which a restart still resumes from; the others lose their files, never their manifests."""
    from infra.demo import let_go_unevaluated

    publish_batches(stack, store, topics, 8)
    proc = run_learner(stack, topics.ns, tmp_path, None, "--updates-per-checkpoint", "1", "--max-policy-lag", "99",
                       "--moments-every", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifests = {m.version: m for m in announced_lineage(stack, store, topics)}
    assert sorted(manifests) == list(range(9)) and [v for v, m in manifests.items() if m.has_moments] == [0, 3, 6]

    kept, freed = let_go_unevaluated(store, topics.ns, manifests, {2, 5, 8})
    assert kept == [0, 2, 5, 6, 8]
    gone = [1, 3, 4, 7]
    assert freed == sum(e.size for v in gone for e in manifests[v].files.values()) > 0
    prefix = f"checkpoints/{topics.ns}/"
    assert all(store.list(f"{prefix}v{v}/") == [f"{prefix}v{v}/manifest.json"] for v in gone)
    assert all(checkpoint_store.load_version(store, topics.ns, v).manifest == manifests[v] for v in kept)
    resumed = checkpoint_store.resume_point(stack, topics, store, topics.ns)
    assert resumed is not None and resumed[0].event.version == 6 and [m.version for m in resumed[1]] == [7, 8]
    assert let_go_unevaluated(store, topics.ns, manifests, {2, 5, 8}) == (kept, 0)  # a second pass frees nothing


class CountingStore(ObjectStore):
    """The real store, counting the downloads of each key."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.downloads: dict[str, int] = {}

    def get(self, key: str, sha256: str | None = None) -> bytes:
        self.downloads[key] = self.downloads.get(key, 0) + 1
        return super().get(key, sha256)


def test_a_restart_below_weights_only_versions_downloads_each_once_and_stores_a_broken_one_again(
        stack: Settings, topics: Topics, store: ObjectStore, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Resuming from v4 below weights-only v5 and v6 fetches v4's files to resume from, and v5's and v6's
    weights once each, to compare with what it trains again (the newest used to come down twice: once to
    find it, once to compare it), and their manifests once, read to resume (the comparison read them again).
    v5's weights, broken in the store, are stored again from what it trained."""
    from learner.service import LearnerService
    from learner.settings import from_args

    flags = ["--updates-per-checkpoint", "1", "--max-policy-lag", "99", "--moments-every", "4"]
    publish_batches(stack, store, topics, 8)
    proc = run_learner(stack, topics.ns, tmp_path, "after_publish:7", *flags)
    assert proc.returncode == -9, proc.stderr[-2000:]
    prefix = f"checkpoints/{topics.ns}/"
    v6 = final_weights(store, topics.ns, 6)
    store.put(prefix + "v5/model.safetensors", b"not the weights it announced")
    args = ["--ns", topics.ns, "--layers", "2", "--width", "64", "--idle-exit", "4", "--cache-dir",
            str(tmp_path / "cache"), "--lr", "1e-3", *flags]
    service = LearnerService(from_args(args, env={}), stack)
    counting = CountingStore(stack)
    service.store = counting
    assert service.resume().startswith("resumed v4 after 4 updates")
    weights = {k.removeprefix(prefix): n for k, n in counting.downloads.items() if k.endswith("model.safetensors")}
    assert weights == {"v4/model.safetensors": 1}
    try:
        service.replay()
        service.finish_publishing()
    finally:
        service.background.shutdown()
        service.reader.close()
    weights = {k.removeprefix(prefix): n for k, n in counting.downloads.items() if k.endswith("model.safetensors")}
    assert weights == {"v4/model.safetensors": 1, "v5/model.safetensors": 1, "v6/model.safetensors": 1}
    manifests = {k.removeprefix(prefix): n for k, n in counting.downloads.items() if k.endswith("manifest.json")}
    assert manifests["v5/manifest.json"] == manifests["v6/manifest.json"] == 1  # read to resume, not again
    assert service.version == 6 and service.updates == 6
    err = capfd.readouterr().err
    assert "v5 trained again: checkpoint v5 of" in err and "storing it again" in err
    assert "v6 trained again (1 batch, 6 updates): the announced weights, bit for bit" in err
    checkpoint_store.load_version(store, topics.ns, 5)  # stored again, and it verifies
    assert all(torch.equal(v6[k], final_weights(store, topics.ns, 6)[k]) for k in v6)
    lineage = announced_lineage(stack, store, topics)
    assert [m.read_order for m in lineage[5:7]] == [m.batch_ids for m in lineage[5:7]] and lineage[5].step == 5


def test_the_learning_rate_warms_up_over_the_first_updates_and_a_resumed_run_continues_the_ramp(
        stack: Settings, topics: Topics, store: ObjectStore, tmp_path: Path) -> None:
    """A fresh Adam moves every weight by about the learning rate on its first steps: --warmup-updates raises
    it linearly (from the update count, so a run resumed mid-ramp goes on where it was)."""
    publish_batches(stack, store, topics, 8)
    flags = ("--warmup-updates", "4", "--max-policy-lag", "100", "--updates-per-checkpoint", "1")
    first = run_learner(stack, topics.ns, tmp_path, None, *flags, "--max-updates", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    rest = run_learner(stack, topics.ns, tmp_path, None, *flags)
    assert rest.returncode == 0, rest.stderr[-3000:]
    rates = [(codec.decode(m.value()).labels["version"], codec.decode(m.value()).value)
             for m in read_topic(stack, topics.metrics) if codec.decode(m.value()).name == "stats/lr"]
    assert [lr for _, lr in rates] == pytest.approx([0.25e-3, 0.5e-3, 0.75e-3, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3])
    assert [v for v, _ in rates][:3] == ["0", "1", "2"]  # the third update ran after the restart, at v2


class GatedStore(ObjectStore):
    """The real store, with one gate: version `held`'s files are written only once the learner has trained
    an update after it (or `patience` seconds passed). A learner that stores checkpoints before its next
    update can only wait the gate out."""

    def __init__(self, settings: Settings, ns: str, held: int, patience: float) -> None:
        super().__init__(settings)
        self.prefix, self.patience = f"checkpoints/{ns}/v{held}/", patience
        self.learner: Any = None
        self.released_by: str | None = None

    def put_verified(self, key: str, data: bytes, sha256: str | None = None) -> str:
        if key.startswith(self.prefix) and self.released_by is None:
            step = self.learner.updates
            deadline = time.monotonic() + self.patience
            while self.learner.updates <= step and time.monotonic() < deadline:
                time.sleep(0.01)
            self.released_by = "a later update" if self.learner.updates > step else "the deadline"
        return super().put_verified(key, data, sha256)


def test_the_next_update_trains_while_a_checkpoint_is_stored_and_both_ways_end_with_the_same_weights(
        stack: Settings, topics: Topics, store: ObjectStore, tmp_path: Path) -> None:
    from learner.service import LearnerService
    from learner.settings import from_args

    flags = ["--sft-updates", "2", "--kl-coef", "0.5", "--max-policy-lag", "100"]
    published = publish_batches(stack, store, topics, 8)
    args = ["--ns", topics.ns, "--layers", "2", "--width", "64", "--updates-per-checkpoint", "2", "--idle-exit",
            "4", "--cache-dir", str(tmp_path / "cache"), "--lr", "1e-3", *flags]
    service = LearnerService(from_args(args, env={}), stack)
    gated = GatedStore(stack, topics.ns, held=1, patience=60.0)
    gated.learner, service.store = service, gated
    report = service.run()
    assert gated.released_by == "a later update"  # v1 was stored while the update after it trained
    assert report["publish_wait_s"] < report["publish_s"]

    lineage = announced_lineage(stack, store, topics)
    assert [m.version for m in lineage] == list(range(len(lineage))) and report["version"] == lineage[-1].version
    assert sorted(b for m in lineage for b in [*m.batch_ids, *m.skipped_batches]) == sorted(published)
    assert lineage[-1].offsets == {0: 9}

    fore = Topics(f"{topics.ns}-fore")  # the same batches, each checkpoint stored before the next update
    bootstrap(stack, fore.ns, partitions=1)
    publish_batches(stack, store, fore, 8)
    proc = run_learner(stack, fore.ns, tmp_path / "fore", None, *flags, "--foreground-checkpoints")
    assert proc.returncode == 0, proc.stderr[-3000:]

    def own(ids: list[str]) -> list[str]:  # a batch id names its namespace's topic: compare what follows
        return [b.split(".", 1)[1] for b in ids]

    assert [(m.version, own(m.batch_ids), m.offsets) for m in announced_lineage(stack, store, fore)] == [
        (m.version, own(m.batch_ids), m.offsets) for m in lineage]
    for version in range(1, len(lineage)):
        background, foreground = final_weights(store, topics.ns, version), final_weights(store, fore.ns, version)
        for name, tensor in background.items():
            torch.testing.assert_close(tensor, foreground[name], rtol=0, atol=1e-6, msg=f"v{version} {name}")


def test_the_sft_phase_ends_at_its_loss_target_and_a_restarted_learner_stays_in_the_rl_phase(
        stack: Settings, topics: Topics, store: ObjectStore, tmp_path: Path) -> None:
    """--sft-until-loss ends the SFT phase once the mean loss of its last 5 updates reaches the target (here any
    loss does: the phase ends after 5 of at most 20 updates). The end is saved with the checkpoints: a learner
    restarted after it goes on with GRPO instead of going back to imitation until update 20."""
    publish_batches(stack, store, topics, 16)
    flags = ("--algorithm", "grpo", "--sft-updates", "20", "--sft-until-loss", "1000", "--max-policy-lag", "100")
    first = run_learner(stack, topics.ns, tmp_path, None, *flags, "--max-updates", "7")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "SFT phase ends after 5 of at most 20 updates" in first.stderr
    rest = run_learner(stack, topics.ns, tmp_path, None, *flags)
    assert rest.returncode == 0, rest.stderr[-3000:]
    assert "resumed v5 after 7 updates" in rest.stderr and "SFT phase ends" not in rest.stderr
    lineage = announced_lineage(stack, store, topics)
    phases = [(m.step, m.algorithm) for m in lineage]
    assert phases[:4] == [(0, "sft"), (2, "sft"), (4, "sft"), (5, "sft")]  # the phase's end is a checkpoint
    assert [a for _, a in phases[4:]] == ["grpo"] * (len(phases) - 4) and phases[-1][0] > 7


def test_the_sft_phase_ends_once_greedy_decoding_writes_the_demonstrations_and_rl_updates_follow_it(
        stack: Settings, topics: Topics, store: ObjectStore, tmp_path: Path) -> None:
    """--sft-until-match: every trajectory here answers the same; once the policy wrote 0.9 of the last 5 SFT
    updates' sequences greedily before training on them, the SFT phase ends (well before --sft-updates), and
    --rl-updates counts the RL phase from there."""
    publish_batches(stack, store, topics, 60, answer=(55, 56, 57, 1))
    proc = run_learner(stack, topics.ns, tmp_path, None, "--algorithm", "grpo", "--sft-updates", "50",
                       "--sft-until-match", "0.9", "--rl-updates", "3", "--lr", "1e-2", "--max-policy-lag", "100")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ended = re.search(r"SFT phase ends after (\d+) of at most 50 updates: greedy decoding wrote ([0-9.]+) of math's "
                      r"demonstrations in the last 5 updates", proc.stderr)
    assert ended, proc.stderr[-3000:]
    end, match = int(ended[1]), float(ended[2])
    assert 5 <= end < 50 and match >= 0.9
    matches = [float(m) for m in re.findall(r"greedy match ([0-9.]+)", proc.stderr)]
    assert len(matches) == end and matches[0] < 0.9  # one figure per SFT update; the untrained policy wrote few
    assert f"{LEARNER_FINISHED_LINE} {end + 3} " in proc.stderr
    lineage = announced_lineage(stack, store, topics)
    assert [m.step for m in lineage if m.algorithm == "sft"][-1] == end  # the phase's end is a checkpoint
    assert lineage[-1].step == end + 3 and lineage[-1].algorithm == "grpo"
