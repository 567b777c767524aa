"""Housekeeping against the real broker and store: namespaces listed with their sizes, one deleted whole."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from confluent_kafka import TopicPartition

from infra.bootstrap import bootstrap
from infra.kafka import Publisher, admin, consumer
from infra.namespaces import Namespace, count_records, delete_namespace, delete_prefixed, survey
from infra.objectstore import ObjectStore
from infra.settings import Settings
from schemas.errors import PipelineError
from schemas.topics import Topics

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def test_namespaces_are_listed_with_their_sizes_and_one_is_deleted_whole(stack: Settings, ns: str,
                                                                       store: ObjectStore) -> None:
    run, evals = Topics(ns), Topics(f"{ns}-eval-v3")  # the second's name starts with the first's
    for t in (run, evals):
        bootstrap(stack, t.ns, partitions=1)
    pub = Publisher(stack)
    for i in range(5):
        pub.send(run.events, b"k", b"v%d" % i)
    pub.send(evals.events, b"k", b"v")
    pub.close()
    store.put(f"shards/{ns}/a.avro", b"x" * 1000)
    store.put(f"checkpoints/{ns}/v0/model.safetensors", b"y" * 3000)
    store.put(f"shards/{evals.ns}/b.avro", b"z" * 10)
    running = consumer(stack, f"{ns}.learner")  # a consumer of the namespace, still running
    running.subscribe([run.events])
    for _ in range(40):
        running.poll(0.5)
        if running.assignment():
            break
    try:
        listed = survey(stack, store)
        mine, theirs = listed[ns], listed[evals.ns]
        assert (mine.records, mine.objects, mine.object_bytes) == (5, 2, 4000)
        assert (theirs.records, theirs.objects, theirs.object_bytes) == (1, 1, 10)
        assert sorted(mine.topics) == sorted(s.name for s in run.specs()) and mine.active == [f"{ns}.learner"]
        with pytest.raises(PipelineError, match="running consumers"):
            delete_namespace(stack, ns)
    finally:
        running.close()

    out = subprocess.run([sys.executable, "-m", "infra", "delete-namespace", ns], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env={**os.environ, **stack.as_env()})
    assert out.returncode == 0, out.stderr
    after = survey(stack, store)
    assert ns not in after and after[evals.ns].records == 1 and after[evals.ns].objects == 1
    assert store.list(f"shards/{ns}/") == [] and store.list(f"checkpoints/{ns}/") == []


def test_a_test_sessions_namespaces_are_cleared_in_one_pass_and_no_other_is_touched(stack: Settings, ns: str,
                                                                                   store: ObjectStore) -> None:
    other = f"k{ns[1:]}"  # a namespace the session did not issue
    made = [Topics(ns), Topics(f"{ns}-from-shards"), Topics(other)]
    for t in made:
        bootstrap(stack, t.ns, partitions=1)
    for t in made:
        store.put(f"checkpoints/{t.ns}/v0/model.safetensors", b"w" * 10)
    group = consumer(stack, f"{ns}.learner")
    group.subscribe([made[0].events])
    for _ in range(40):
        group.poll(0.5)
        if group.assignment():
            break
    group.commit(offsets=[TopicPartition(made[0].events, 0, 0)], asynchronous=False)
    group.close()  # an idle group of the namespace, with a committed offset

    done = delete_prefixed(stack, [ns])
    left = survey(stack, store)
    assert ns not in left and f"{ns}-from-shards" not in left
    assert done["topics_deleted"] == len(made[0].specs()) + len(made[1].specs()) and done["objects_deleted"] == 2
    assert done["groups_deleted"] == 1 and done["failed"] == []
    assert sorted(left[other].topics) == sorted(s.name for s in made[2].specs()) and left[other].objects == 1
    delete_prefixed(stack, [other])


def test_a_namespace_deleted_while_they_are_listed_drops_out_of_the_listing(stack: Settings, ns: str,
                                                                           store: ObjectStore) -> None:
    """Listing reads the broker's topics, then each one's offsets: a topic deleted in between (another
    session clearing its namespaces) is no longer there to ask, which must not fail the listing."""
    kept, gone = Topics(ns), Topics(f"{ns}-gone")
    for t in (kept, gone):
        bootstrap(stack, t.ns, partitions=1)
    pub = Publisher(stack)
    pub.send(kept.events, b"k", b"v")
    pub.close()
    listed_before = admin(stack).list_topics(timeout=30)  # what the listing read before the deletion
    delete_prefixed(stack, [gone.ns])
    wait_until_gone(stack, [s.name for s in gone.specs()])

    stale = Namespace(gone.ns, topics=[s.name for s in gone.specs()])
    found = {ns: Namespace(ns, topics=[s.name for s in kept.specs()]), gone.ns: stale}
    count_records(stack, listed_before, found)
    assert found[ns].records == 1 and found[ns].topics == [s.name for s in kept.specs()]
    assert gone.ns not in found  # nothing of it left: no topic, and it had no object
    listed = survey(stack, store)
    assert listed[ns].records == 1 and gone.ns not in listed


def wait_until_gone(settings: Settings, names: list[str], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while set(names) & set(admin(settings).list_topics(timeout=30).topics):
        assert time.monotonic() < deadline, f"topics still listed after {timeout_s}s"
        time.sleep(0.5)
