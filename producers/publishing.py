"""Publishes a worker's facts: claim-checks large payloads, encodes, keys by episode, counts deliveries."""
from __future__ import annotations

from infra.claims import offload
from infra.kafka import Publisher
from infra.objectstore import ObjectStore
from infra.settings import Settings
from schemas.codec import codec
from schemas.records import RolloutEvent
from schemas.topics import Topics


class EventSink:
    """Every event goes to <ns>.rollout.events keyed by episode_id, so one partition holds an episode in order."""

    def __init__(self, settings: Settings, topics: Topics, store: ObjectStore) -> None:
        self.topics = topics
        self.store = store
        # Retries until the broker is back (a restart) rather than failing records.
        self.publisher = Publisher(settings, None, **{"message.timeout.ms": 600_000})

    def emit(self, event: RolloutEvent) -> None:
        event = offload(event, self.store, self.topics.ns)
        self.publisher.send(self.topics.events, event.episode_id.encode(), codec.encode(event))

    @property
    def stats(self) -> dict[str, int]:
        s = self.publisher.stats
        return {"sent": s.sent, "delivered": s.delivered, "failed": s.failed, "pending": s.pending}

    def flush(self) -> None:
        self.publisher.flush(timeout=600)

    def close(self) -> None:
        self.publisher.close(timeout=600)
