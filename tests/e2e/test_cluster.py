"""A three-broker KRaft cluster: one broker killed -9 in the middle of a pipeline run and brought back later;
every id is accounted for (0 episodes lost, 0 trajectories duplicated, 0 batches trained twice)."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from infra.bootstrap import bootstrap, topic_config
from infra.kafka import admin
from tests.e2e.pipeline import MODEL, PipelineRun, assert_every_id_accounted_for, unclosed_episodes

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

BROKER_AWAY_S = 20.0


def test_a_broker_killed_mid_run_on_a_three_broker_cluster_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    run = PipelineRun(tmp_path, brokers=3)
    t = run.topics
    try:
        status = run.launcher.status()
        assert [name for name in status if name.startswith("kafka")] == ["kafka", "kafka-2", "kafka-3"]
        assert all(s["ready"] for s in status.values()), status
        assert run.settings.kafka_bootstrap.count(",") == 2  # clients know every node

        bootstrap(run.settings, run.ns, partitions=2)
        # replicated 3 times with 2 in sync required: the cluster's settings decide, not the code
        meta = admin(run.settings).list_topics(timeout=10)
        for spec in t.specs():
            assert all(len(p.replicas) == 3 for p in meta.topics[spec.name].partitions.values()), spec.name
        assert topic_config(run.settings, t.events)["min.insync.replicas"] == "2"

        # Every episode here ends (no producer dies), so the timeouts only decide how long an episode may wait
        # on a partition whose leader died: its writes wait for the new leader (~9 s alone, over 12 s once with
        # another test on the cores), and the brokers left still answer, so the wait counts as idle time.
        run.start("streams", "streams", "--episode-timeout-s", "45", "--group-timeout-s", "45")
        run.start("writer", "consumers.shard_writer", "--max-trajectories", "16", "--max-age-s", "2")
        run.start("learner", "learner", *MODEL, "--updates-per-checkpoint", "2", "--max-policy-lag", "1000",
                  "--cache-dir", str(tmp_path / "cache"))
        run.start("producer", "producers", *run.producer_args(96, "producer", 1))
        run.wait_until("trajectories", lambda: run.count(t.trajectories) >= 40)

        # the broker that leads the events' first partition dies: leadership moves, writes go on with 2 of 3
        leader = admin(run.settings).list_topics(t.events, timeout=10).topics[t.events].partitions[0].leader
        victim = "kafka" if leader == 1 else f"kafka-{leader}"
        # counted before the kill: until the cluster fences the dead leader (~9 s) a count waits on it, and
        # meanwhile the streams worker may write all that is left
        before = run.count(t.trajectories)
        run.launcher.kill(victim)
        killed = time.monotonic()
        status = run.launcher.status()
        assert not status[victim]["running"] and sum(s["running"] for s in status.values()) == 3, status
        # a second worker starts while the broker is away: its episodes are written with 2 of 3 whatever the
        # first worker had left (it may have finished before the kill)
        run.start("producer-2", "producers", *run.producer_args(96, "producer-2", 2))
        run.wait_until("trajectories while a broker is away", lambda: run.count(t.trajectories) >= before + 24)
        time.sleep(max(0.0, killed + BROKER_AWAY_S - time.monotonic()))
        assert run.launcher.start(victim) == "started"

        for name in ("producer", "producer-2"):
            assert run.procs[name].wait(timeout=400) == 0, run.logs()
        run.wait_until("every started episode closed", lambda: not unclosed_episodes(run), timeout=300, every=5)
        for topic in (t.trajectories, t.scored, t.batches):
            run.settled(topic)
        run.settled(t.checkpoints, quiet_s=10)
        for name in ("learner", "writer", "streams"):
            assert run.stop(name) == 0, run.logs()
        lineage = assert_every_id_accounted_for(run, orphans=False)
        assert lineage[-1].version >= 3, "the learner hardly trained: the test proves little"
    finally:
        run.close()
