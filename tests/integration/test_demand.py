"""What the learner still needs for its next version, read from a real batches topic and a version's manifest."""
from __future__ import annotations

import pytest
from confluent_kafka import TopicPartition

from infra.kafka import Publisher, admin, end_offsets
from infra.settings import Settings
from producers.demand import LearnerDemand
from schemas.manifests import CheckpointManifest
from schemas.topics import Topics
from tests.streams_data import batch_record

pytestmark = pytest.mark.integration


def manifest(offsets: dict[int, int], next_batches: int) -> CheckpointManifest:
    return CheckpointManifest(run="r", version=3, step=3, algorithm="grpo", files={}, offsets=offsets, batch_ids=[],
                              next_batches=next_batches)


def test_the_shortfall_is_what_the_next_version_needs_less_the_batches_past_the_versions_offsets(
        stack: Settings, topics: Topics) -> None:
    pub = Publisher(stack)
    for i in range(5):
        pub.send(topics.batches, None, batch_record(i, 2), partition=0)
    pub.close()
    demand = LearnerDemand(stack, topics)
    try:
        assert demand.shortfall(manifest({}, 7)) == 2  # a version before any batch was read: the whole topic
        assert demand.shortfall(manifest({0: 2}, 4)) == 1  # 3 held past offset 2, 4 needed
        assert demand.shortfall(manifest({0: 1}, 4)) == 0
        assert demand.shortfall(manifest({0: 0}, 2)) == -3  # more than it needs: a worker waits
        assert demand.shortfall(manifest({0: 9}, 2)) == 2  # offsets past the end (a trimmed topic): nothing held
        assert demand.shortfall(manifest({}, 0)) is None  # a manifest that does not say (an older learner)
    finally:
        demand.close()


def test_a_topic_the_broker_does_not_know_leaves_the_demand_unknown(stack: Settings) -> None:
    demand = LearnerDemand(stack, Topics("no-such-namespace-demand"), timeout_s=2.0)
    try:
        assert demand.shortfall(manifest({}, 4)) is None
    finally:
        demand.close()


def test_the_rollouts_queued_past_a_versions_offsets_leave_out_demonstrations_and_unreadable_records(
        stack: Settings, topics: Topics) -> None:
    """An SFT phase's left-over demonstrations are on the topic ahead of the rollouts: the learner only skips them,
    so they are not rollouts queued for it. Each record is read once, however often the worker asks."""
    pub = Publisher(stack)
    for n in range(5):
        pub.send(topics.batches, None, batch_record(n, -1), partition=0)
    pub.send(topics.batches, None, b"not a batch", partition=0)
    for n in range(5, 8):
        pub.send(topics.batches, None, batch_record(n, 4), partition=0)
    pub.close()
    demand = LearnerDemand(stack, topics)
    try:
        assert demand.rollouts_since({}) == 3  # of 9 records
        assert demand.shortfall(manifest({}, 2)) == -1
        assert demand.rollouts_since({0: 7}) == 2  # past the first rollout batch (offset 6)
        pub = Publisher(stack)
        pub.send(topics.batches, None, batch_record(8, 5), partition=0)
        pub.close()
        assert demand.rollouts_since({0: 7}) == 3
        high = end_offsets(stack, topics.batches)[0][1]
        assert demand.rollouts_since({0: high}) == 0 and demand._read_to[0] == high
    finally:
        demand.close()


def test_batches_the_topics_retention_deleted_are_let_go_and_never_counted(stack: Settings, topics: Topics) -> None:
    """A long run: the worker asks after every version, and the topic's retention deletes its oldest batches.
    What the demand holds of them goes with them, and the counts stay those of what the topic holds."""
    pub = Publisher(stack)
    for n in range(10):
        pub.send(topics.batches, None, batch_record(n, 3), partition=0)
    pub.close()
    demand = LearnerDemand(stack, topics)
    try:
        assert demand.rollouts_since({}) == 10 and len(demand._rollouts[0]) == 10
        client = admin(stack)  # held until the deletion is done: its thread answers the futures
        for future in client.delete_records([TopicPartition(topics.batches, 0, 6)]).values():
            future.result(timeout=30)  # the low watermark is now 6, as retention leaves it
        assert demand.rollouts_since({}) == 4
        assert list(demand._rollouts[0]) == [6, 7, 8, 9]  # the deleted offsets are let go
        assert demand.rollouts_since({0: 8}) == 2 and demand.shortfall(manifest({0: 2}, 5)) == 1
    finally:
        demand.close()
