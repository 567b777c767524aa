"""Kill -9 every service in turn, restart the broker, stop MinIO: afterwards every id is accounted for."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from infra.bootstrap import bootstrap
from tests.e2e.pipeline import MODEL, PipelineRun, assert_every_id_accounted_for, every_episode_closed

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


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
        # 1. a rollout worker dies mid-episode (its 6th step's 8 episodes started, never ended); a new one
        # takes over
        run.start("producer-a", "producers", *run.producer_args(400, "producer-a", 1), fault="mid_episode:6")
        run.wait_killed("producer-a")
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
        assert_every_id_accounted_for(run, orphans=True)
    finally:
        run.close()


