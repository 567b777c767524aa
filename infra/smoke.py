"""A smoke round trip through the real servers: every event type through Kafka, one object through MinIO."""
from __future__ import annotations

import time
import uuid

from infra.bootstrap import bootstrap
from infra.kafka import Publisher, read_topic
from infra.objectstore import ObjectStore
from infra.settings import Settings
from schemas import codec
from schemas.examples import example_events
from schemas.topics import Topics


def run_smoke(settings: Settings, ns: str | None = None) -> dict[str, object]:
    ns = ns or f"smoke-{uuid.uuid4().hex[:8]}"
    topics = Topics(ns)
    report = bootstrap(settings, ns)
    events = example_events(run=ns)
    started = time.monotonic()
    publisher = Publisher(settings)
    for ev in events:
        publisher.send(topics.events, ev.episode_id.encode(), codec.encode(ev))
    publisher.close()
    back = [codec.decode(m.value() or b"") for m in read_topic(settings, topics.events)]
    store = ObjectStore(settings)
    payload = uuid.uuid4().bytes * 1024
    digest = store.put_verified(f"smoke/{ns}/object.bin", payload)
    return {
        "namespace": ns,
        "topics_created": len(report.created),
        "events_sent": len(events),
        "events_read_back_equal": sorted(back, key=lambda e: e.seq) == sorted(events, key=lambda e: e.seq),
        "object_sha256": digest,
        "seconds": round(time.monotonic() - started, 2),
    }
