"""What the learner still needs for its next version, read from the log: a rollout worker that has made its
quota goes on generating while the learner is short instead of waiting for a version it cannot make.

    demand = LearnerDemand(platform, topics)
    short = demand.shortfall(ready.manifest)   # batches missing for the next version (<= 0: it has them), or None

A version's manifest says where the learner stood in the batches topic when it made that version (`offsets`)
and how many batches the next one trains on (`next_batches`); what the topic holds past those offsets is there
for it to read. Batches still being assembled from episodes already made are not counted: the worker gives
them time to arrive (--demand-settle-s) before it trusts a shortfall.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

from confluent_kafka import KafkaException, TopicPartition

from infra.kafka import consumer
from infra.settings import Settings
from schemas.manifests import CheckpointManifest
from schemas.topics import Topics

log = logging.getLogger(__name__)


class LearnerDemand:
    def __init__(self, settings: Settings, topics: Topics, timeout_s: float = 5.0) -> None:
        self.settings, self.topic, self.timeout_s = settings, topics.batches, timeout_s
        self._consumer: Any = None
        self._partitions: list[int] = []

    def shortfall(self, manifest: CheckpointManifest) -> Optional[int]:
        """Batches the learner lacks to make the version after `manifest`'s; None when the manifest does not say
        what it needs (an older learner) or the broker cannot say what the topic holds."""
        if manifest.next_batches <= 0:
            return None
        held = self.held_since(manifest.offsets)
        return None if held is None else manifest.next_batches - held

    def held_since(self, offsets: dict[int, int]) -> Optional[int]:
        """Batch records the topic holds past `offsets` (per partition; a partition not in them from its start)."""
        try:
            c = self._open()
            held = 0
            for p in self._partitions:
                low, high = c.get_watermark_offsets(TopicPartition(self.topic, p), timeout=self.timeout_s)
                held += max(0, high - max(low, offsets.get(p, low)))
            return held
        except KafkaException as exc:
            log.warning("batches topic %s: its end is unknown (%s); the worker waits as with a fixed quota",
                        self.topic, exc)
            return None

    def _open(self) -> Any:
        if self._consumer is None:
            c = consumer(self.settings, f"{self.topic}-demand")  # never subscribes nor commits: watermarks only
            topic = c.list_topics(self.topic, timeout=self.timeout_s).topics.get(self.topic)
            if topic is None or topic.error is not None or not topic.partitions:
                c.close()
                raise KafkaException(f"no partitions known for {self.topic}")
            self._consumer, self._partitions = c, sorted(topic.partitions)
        return self._consumer

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
