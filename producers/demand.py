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

from confluent_kafka import KafkaException

from infra.kafka import consumer, watermarks
from infra.settings import Settings
from schemas.manifests import CheckpointManifest
from schemas.topics import Topics

log = logging.getLogger(__name__)


class LearnerDemand:
    def __init__(self, settings: Settings, topics: Topics, timeout_s: float = 5.0) -> None:
        self.settings, self.topic, self.timeout_s = settings, topics.batches, timeout_s
        self._consumer: Any = None

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
            if self._consumer is None:  # never subscribes nor commits: watermarks only
                self._consumer = consumer(self.settings, f"{self.topic}-demand")
            marks = watermarks(self._consumer, self.topic, self.timeout_s)
        except (KafkaException, KeyError) as exc:
            marks, why = {}, str(exc)
        else:
            why = "no partitions known"
        if not marks:
            log.warning("batches topic %s: its end is unknown (%s); the worker waits as with a fixed quota",
                        self.topic, why)
            return None
        return sum(max(0, high - max(low, offsets.get(p, low))) for p, (low, high) in marks.items())

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
