"""Against the real broker and store: event round trips, taps, bootstrap, object store, claim checks."""
from __future__ import annotations

import hashlib
import io
import os
import uuid
from typing import Any

import pytest

from infra.bootstrap import bootstrap, partition_count, topic_config
from infra.claims import offload, resolve
from infra.kafka import Publisher, end_offsets, read_topic
from infra.objectstore import PART, ObjectStore
from infra.settings import Settings
from schemas import codec
from schemas.errors import IntegrityError, ObjectNotFound
from schemas.examples import example_events
from schemas.packing import pack_floats, pack_ids
from schemas.records import PipelineMetric, PolicyTurn
from schemas.topics import Topics
from tests.taps import publish_in_transaction
from tests.unit.test_codec import every_record

pytestmark = pytest.mark.integration


def test_every_event_type_round_trips_through_kafka_and_a_tap_sees_the_same(stack: Settings, topics: Topics) -> None:
    events = [e for ep in range(3) for e in example_events(run=topics.ns, episode_id=f"ep-{ep}")]
    pub = Publisher(stack)
    for ev in events:
        pub.send(topics.events, ev.episode_id.encode(), codec.encode(ev))
    pub.close()
    assert pub.stats.delivered == len(events) and pub.stats.failed == 0

    first = [codec.decode(m.value()) for m in read_topic(stack, topics.events)]
    tap = [codec.decode(m.value()) for m in read_topic(stack, topics.events)]
    key = lambda e: e.event_id  # noqa: E731
    assert sorted(first, key=key) == sorted(events, key=key)
    assert sorted(tap, key=key) == sorted(first, key=key)
    # one partition holds an episode, in order
    for ep in range(3):
        seqs = [e.seq for e in first if e.episode_id == f"ep-{ep}"]
        assert seqs == sorted(seqs) == [0, 1, 2, 3]


def test_every_record_type_round_trips_through_kafka(stack: Settings, topics: Topics) -> None:
    records = every_record()
    pub = Publisher(stack)
    for rec in records:
        pub.send(topics.metrics, None, codec.encode(rec))
    pub.close()
    assert [codec.decode(m.value()) for m in read_topic(stack, topics.metrics)] == records


def test_a_topic_whose_end_is_a_commit_marker_is_read_to_its_end(stack: Settings, topics: Topics) -> None:
    # Reading up to the end offset, a tap waited for a record at the marker's offset, which never arrives: it
    # raised TimeoutError instead of returning what the topic holds.
    records = [PipelineMetric(source="java", name="x", value=float(i), window_end=i) for i in range(3)]
    publish_in_transaction(stack, topics.metrics, records)
    (low, high), = end_offsets(stack, topics.metrics).values()
    assert high - low == len(records) + 1  # the marker
    assert [codec.decode(m.value()) for m in read_topic(stack, topics.metrics, timeout=30)] == records


def test_consumer_group_tap_reads_independently(stack: Settings, topics: Topics) -> None:
    from infra.kafka import consumer

    events = example_events(run=topics.ns)
    pub = Publisher(stack)
    for ev in events:
        pub.send(topics.events, ev.episode_id.encode(), codec.encode(ev))
    pub.close()
    seen: dict[str, list[str]] = {}
    for group in (f"{topics.ns}-learner", f"{topics.ns}-monitor"):
        c = consumer(stack, group)
        c.subscribe([topics.events])
        got: list[str] = []
        for _ in range(100):
            msg = c.poll(0.5)
            if msg is not None and not msg.error():
                got.append(codec.decode(msg.value()).event_id)
                if len(got) == len(events):
                    break
        c.commit(asynchronous=False)
        c.close()
        seen[group] = got
    assert seen[f"{topics.ns}-learner"] == seen[f"{topics.ns}-monitor"] == [e.event_id for e in events]


def test_bootstrap_is_idempotent_and_compacts_checkpoints(stack: Settings, ns: str) -> None:
    first = bootstrap(stack, ns, partitions=3)
    second = bootstrap(stack, ns, partitions=3)
    topics = Topics(ns, partitions=3)
    assert sorted(first.created) == sorted(s.name for s in topics.specs())
    assert second.created == [] and sorted(second.existing) == sorted(first.created)
    assert topic_config(stack, topics.checkpoints)["cleanup.policy"] == "compact"
    assert topic_config(stack, topics.task_stats)["cleanup.policy"] == "compact"
    assert topic_config(stack, topics.events)["cleanup.policy"] == "delete"
    assert partition_count(stack, topics.events) == 3
    assert partition_count(stack, topics.changelog("episodes")) == 3


def test_object_store_put_get_list_of_a_multi_mb_object(store: ObjectStore) -> None:
    prefix = f"test/{uuid.uuid4().hex}/"
    blob = os.urandom(6 * 1024 * 1024 + 17)
    digest = store.put_verified(prefix + "big.bin", blob)
    store.put(prefix + "small.bin", b"x")
    assert store.get(prefix + "big.bin", sha256=digest) == blob
    assert store.list(prefix) == [prefix + "big.bin", prefix + "small.bin"]
    assert store.size(prefix + "big.bin") == len(blob)


class Wire:
    """The real MinIO client behind a wire that can flip one byte of a body after its headers were made."""

    def __init__(self, client: Any, corrupt: bool) -> None:
        self.client, self.corrupt, self.gets = client, corrupt, 0

    def put_object(self, bucket: str, key: str, data: io.BytesIO, length: int, **kwargs: Any) -> Any:
        body = bytearray(data.read())
        if self.corrupt:
            body[len(body) // 2] ^= 0xFF
        return self.client.put_object(bucket, key, io.BytesIO(bytes(body)), length, **kwargs)

    def get_object(self, *args: Any, **kwargs: Any) -> Any:
        self.gets += 1
        return self.client.get_object(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


class NoEcho(Wire):
    """A store that stores what it gets but does not say which checksum it checked (older S3 stores)."""

    def put_object(self, *args: Any, **kwargs: Any) -> Any:
        result = super().put_object(*args, **kwargs)
        return type("Answer", (), {"etag": result.etag, "http_headers": {}})()


def test_an_echoed_sha256_check_is_believed_and_without_it_the_etag_decides(
        store: ObjectStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """MinIO echoes the x-amz-checksum-sha256 it verified: no MD5 of the data is then computed (73 ms of a
    52 MB checkpoint). A store that does not echo it gets the ETag comparison, and a mismatch is read back."""
    from infra import objectstore

    md5s: list[int] = []
    monkeypatch.setattr(objectstore, "expected_etag", lambda data: md5s.append(len(data)) or "not-the-etag")
    key = f"test/{uuid.uuid4().hex}/weights.bin"
    blob = os.urandom(3 << 20)
    real = store._client
    store._client = wire = Wire(real, corrupt=False)
    digest = store.put_verified(key, blob, sha256=hashlib.sha256(blob).hexdigest())
    assert md5s == [] and wire.gets == 0 and store.get(key, sha256=digest) == blob
    store._client = wire = NoEcho(real, corrupt=False)
    assert store.put_verified(key + ".2", blob) == digest
    assert md5s == [len(blob)] and wire.gets == 1  # the ETag "differed": read back and checked
    store._client = real
    with pytest.raises(IntegrityError):  # a wrong digest given by the caller is refused, nothing stored
        store.put_verified(key + ".3", blob, sha256=hashlib.sha256(b"other").hexdigest())
    assert not store.exists(key + ".3")


@pytest.mark.parametrize("size", [12 << 20, PART + (3 << 20)])  # one PUT; two parts
def test_a_verified_write_is_checked_on_arrival_without_reading_it_back(store: ObjectStore, size: int) -> None:
    key = f"test/{uuid.uuid4().hex}/weights.bin"
    blob = os.urandom(size)
    real = store._client
    store._client = wire = Wire(real, corrupt=False)
    digest = store.put_verified(key, blob)
    assert wire.gets == 0 and store.get(key, sha256=digest) == blob
    store._client = wire = Wire(real, corrupt=True)  # a byte flipped in transit
    if size <= PART:  # the server's sha256 check refuses it: nothing is stored
        with pytest.raises(IntegrityError, match="other bytes"):
            store.put_verified(key + ".2", blob)
        store._client = real
        assert not store.exists(key + ".2")
    else:  # in parts: the ETag differs, so the write is read back, and that finds it
        with pytest.raises(IntegrityError):
            store.put_verified(key + ".2", blob)
        assert wire.gets == 1


def test_missing_object_is_a_clear_error(store: ObjectStore) -> None:
    with pytest.raises(ObjectNotFound) as info:
        store.get(f"test/{uuid.uuid4().hex}/nope")
    assert "NoSuchKey" in str(info.value) and store.bucket in str(info.value)


def test_large_payload_travels_by_claim_check(stack: Settings, topics: Topics, store: ObjectStore) -> None:
    ev = example_events(run=topics.ns)[1]
    big = PolicyTurn(turn=0, obs_text="", obs_tokens=b"", text="x" * 10, tokens=pack_ids(range(100_000)),
                     logprobs=pack_floats([-0.5] * 100_000), finish_reason="length")
    ev = ev.__class__(**{**ev.__dict__, "body": big})
    slim = offload(ev, store, topics.ns, threshold=512 * 1024)
    assert slim.body.claim is not None and len(codec.encode(slim)) < 2048
    pub = Publisher(stack)
    pub.send(topics.events, slim.episode_id.encode(), codec.encode(slim))
    pub.close()
    (msg,) = list(read_topic(stack, topics.events))
    assert resolve(codec.decode(msg.value()), store) == ev
