"""Kill -9 every service in turn, restart the broker, stop MinIO: afterwards every id is accounted for."""
from __future__ import annotations

import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from infra.bootstrap import bootstrap
from infra.kafka import read_topic
from infra.objectstore import ObjectStore
from learner import checkpoint_store
from schemas import codec
from schemas.keys import trajectory_id
from schemas.manifests import CheckpointManifest
from schemas.records import BatchManifest, DeadLetter, EpisodeEnded, EpisodeStarted, RolloutEvent, Trajectory
from tests.e2e.pipeline import MODEL, PipelineRun

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def decode_all(run: PipelineRun, topic: str) -> list:  # type: ignore[type-arg]
    return [codec.decode(m.value()) for m in read_topic(run.settings, topic, timeout=120)]


def test_crashes_and_outages_lose_nothing_and_train_each_batch_once(tmp_path: Path) -> None:
    run = PipelineRun(tmp_path)
    t = run.topics
    try:
        bootstrap(run.settings, run.ns, partitions=2)
        streams_args = ["--episode-timeout-s", "12", "--group-timeout-s", "12"]
        writer_args = ["--max-trajectories", "16", "--max-age-s", "2"]
        learner_args = [*MODEL, "--updates-per-checkpoint", "2", "--max-policy-lag", "1000", "--cache-dir",
                        str(tmp_path / "cache")]
        run.start("streams", "streams", *streams_args)
        run.start("writer", "consumers.shard_writer", *writer_args)
        run.start("learner", "learner", *learner_args)
        run.start("producer-a", "producers", *run.producer_args(400, "producer-a", 1))

        # 1. a rollout worker dies mid-episode; a new one takes over
        run.wait_until("first events", lambda: run.count(t.events) >= 120)
        run.kill9("producer-a")
        run.start("producer-b", "producers", *run.producer_args(96, "producer-b", 2))
        # 2. the streams worker dies with episodes half-assembled
        run.wait_until("trajectories", lambda: run.count(t.trajectories) >= 40)
        run.kill9("streams")
        run.start("streams", "streams", *streams_args)
        # 3. the shard writer dies between batches
        run.wait_until("batches", lambda: run.count(t.batches) >= 2)
        run.kill9("writer")
        run.start("writer", "consumers.shard_writer", *writer_args)
        # 4. the learner dies; it resumes from its newest announced checkpoint
        run.wait_until("checkpoints", lambda: run.count(t.checkpoints) >= 2)
        run.kill9("learner")
        run.start("learner", "learner", *learner_args)
        # 5. the broker restarts; 6. MinIO is away for a while
        run.launcher.stop(run.launcher.kafka)
        time.sleep(3)
        run.launcher.start("kafka")
        run.launcher.kill("minio")
        time.sleep(6)
        run.launcher.start("minio")

        assert run.procs["producer-b"].wait(timeout=400) == 0, run.logs()
        # the sweeper closes producer-a's orphans once idle for 12 s (of event or wall time)
        run.wait_until("every started episode closed", lambda: every_episode_closed(run), timeout=300, every=5)
        run.settled(t.trajectories)
        run.settled(t.scored)
        run.settled(t.batches)
        run.settled(t.checkpoints, quiet_s=10)
        for name in ("learner", "writer", "streams"):
            assert run.stop(name) == 0, run.logs()
        assert_every_id_accounted_for(run)
    finally:
        run.close()


def every_episode_closed(run: PipelineRun) -> bool:
    started = {e.episode_id for e in decode_all(run, run.topics.events) if isinstance(e.body, EpisodeStarted)}
    return started <= {t.episode_id for t in decode_all(run, run.topics.trajectories)}


def describe(episodes: set[str], events: list[RolloutEvent], run: PipelineRun) -> str:
    rows = [f"{e.producer_id} {e.episode_id} seq={e.seq} {type(e.body).__name__} ts={e.ts}"
            for e in events if e.episode_id in episodes]
    return f"{len(episodes)} episodes without a trajectory:\n" + "\n".join(rows[:40]) + "\n" + run.logs(4000)


def assert_every_id_accounted_for(run: PipelineRun) -> None:
    t = run.topics
    events: list[RolloutEvent] = decode_all(run, t.events)
    started = {e.episode_id for e in events if isinstance(e.body, EpisodeStarted)}
    ended = {e.episode_id for e in events if isinstance(e.body, EpisodeEnded)}
    assert len(started) >= 100 and ended <= started

    trajectories: list[Trajectory] = decode_all(run, t.trajectories)
    by_id = {tr.trajectory_id: tr for tr in trajectories}
    # every episode that ended is in exactly one trajectory (ids are derived from the episode: re-emits share it)
    missing = {ep for ep in ended if trajectory_id(ep) not in by_id}
    assert not missing, describe(missing, events, run)
    assert {tr.episode_id for tr in by_id.values()} == started
    orphans = started - ended  # producer-a's in-flight episodes: closed by the sweeper, never trained
    assert orphans and all(by_id[trajectory_id(ep)].status == "abandoned" for ep in orphans)
    for tr in by_id.values():  # emitted twice (at least once) means emitted identically
        assert all(codec.encode(x) == codec.encode(tr) for x in trajectories if x.trajectory_id == tr.trajectory_id)

    dead: list[DeadLetter] = decode_all(run, t.deadletter)
    assert dead == [], [d.reason for d in dead]

    scored = {tr.trajectory_id for tr in decode_all(run, t.scored)}
    assert scored <= set(by_id)
    manifests: dict[str, BatchManifest] = {}
    for m in decode_all(run, t.batches):
        assert manifests.setdefault(m.batch_id, m) == m  # a republished manifest is the same manifest
    in_batches = Counter(tid for m in manifests.values() for tid in m.trajectory_ids)
    assert set(in_batches) == scored and max(in_batches.values()) == 1  # every scored trajectory in one batch

    store = ObjectStore(run.settings)
    announced = [e for e in checkpoint_store.published(run.settings, t) if e.run == run.ns]
    final = max(e.version for e in announced)
    lineage = [CheckpointManifest.from_json(store.get(f"checkpoints/{run.ns}/v{v}/manifest.json"))
               for v in range(final + 1)]
    for e in announced:  # no checkpoint lost: every announced one still verifies
        checkpoint_store.load(store, e)
    trained = Counter(b for m in lineage for b in m.batch_ids)
    assert set(trained) == set(manifests) and max(trained.values()) == 1  # every batch trained exactly once
    per_version = defaultdict(list)
    for m in lineage:
        per_version[m.version].append(m)
    assert sorted(per_version) == list(range(final + 1))
