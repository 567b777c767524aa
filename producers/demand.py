"""What the learner still needs for its next version, read from the log: a rollout worker that has made its
quota goes on generating while the learner is short instead of waiting for a version it cannot make.

    demand = LearnerDemand(platform, topics)
    short = demand.shortfall(ready.manifest)   # batches missing for the next version (<= 0: it has them), or None
    queued = demand.rollouts_since(ready.manifest.offsets)   # of the batches held, those of rollouts, or None

A version's manifest says where the learner stood in the batches topic when it made that version (`offsets`)
and how many batches the next one trains on (`next_batches`); what the topic holds past those offsets is there
for it to read. Batches still being assembled from episodes already made are not counted: the worker gives
them time to arrive (--demand-settle-s) before it trusts a shortfall.
"""
from __future__ import annotations

import bisect
import logging
from array import array
from typing import Any, Optional

from confluent_kafka import KafkaException

from infra.kafka import consumer, read_past, watermarks
from infra.settings import Settings
from schemas.codec import codec
from schemas.errors import DecodeError
from schemas.manifests import CheckpointManifest
from schemas.records import BatchManifest
from schemas.topics import Topics

log = logging.getLogger(__name__)


class LearnerDemand:
    def __init__(self, settings: Settings, topics: Topics, timeout_s: float = 5.0) -> None:
        self.settings, self.topic, self.timeout_s = settings, topics.batches, timeout_s
        self._consumer: Any = None
        # What rollouts_since has read of the topic: per partition, the next offset to read and the offsets of
        # the batches of rollouts (records never change, so each is read once), 8 bytes each. Offsets the topic's
        # retention deleted are let go, so a worker holds no more of them than the topic does.
        self._read_to: dict[int, int] = {}
        self._rollouts: dict[int, array[int]] = {}

    def shortfall(self, manifest: CheckpointManifest) -> Optional[int]:
        """Batches of rollouts the learner lacks to make the version after `manifest`'s; None when the manifest does
        not say what it needs (an older learner) or the broker cannot say what the topic holds. Demonstrations are
        never a rollout worker's to make: left over from an SFT phase, they looked like batches the learner held,
        and the worker waited out its --quota-wait-s while the learner waited for rollouts."""
        if manifest.next_batches <= 0:
            return None
        held = self.rollouts_since(manifest.offsets)
        return None if held is None else manifest.next_batches - held

    def rollouts_since(self, offsets: dict[int, int]) -> Optional[int]:
        """Batches of rollouts the topic holds past `offsets`: the learner's RL phase trains on them. Batches of
        demonstrations (policy_version_max < 0) are not counted: left over from an SFT phase, the learner only
        skips them, and counted they would look like work it has queued. None when the broker cannot say."""
        try:
            marks = watermarks(self._client(), self.topic, self.timeout_s)
            if not marks:
                return None
            self._read(marks)
            self._forget_deleted(marks)
        except (KafkaException, KeyError, TimeoutError) as exc:
            log.warning("batches topic %s: cannot read its batches (%s)", self.topic, exc)
            return None
        return sum(len(found) - bisect.bisect_left(found, max(marks[p][0], offsets.get(p, marks[p][0])))
                   for p, found in self._rollouts.items() if p in marks)

    def _read(self, marks: dict[int, tuple[int, int]]) -> None:
        """Read every partition from where it was left (or its start) to its high watermark."""
        found: list[tuple[int, int]] = []  # taken only once every partition is read (a timeout reads it again)
        for msg in read_past(self._client(), self.topic, marks, self._read_to, self.timeout_s):
            try:
                batch = codec.decode(msg.value() or b"", expect=BatchManifest)
            except DecodeError:
                batch = None  # the learner dead-letters it: nothing it trains on
            if batch is not None and batch.policy_version_max >= 0:
                found.append((msg.partition() or 0, msg.offset() or 0))
        for part, offset in sorted(found):
            self._rollouts.setdefault(part, array("q")).append(offset)

    def _forget_deleted(self, marks: dict[int, tuple[int, int]]) -> None:
        """Drop the offsets below each partition's low watermark: retention deleted those batches, and no count
        includes them (rollouts_since counts from the low watermark at the earliest)."""
        for part, (low, _) in marks.items():
            found = self._rollouts.get(part)
            if found:
                del found[:bisect.bisect_left(found, low)]

    def _client(self) -> Any:
        """One consumer for watermarks and reads: it never subscribes nor commits (assigned partitions only)."""
        if self._consumer is None:
            self._consumer = consumer(self.settings, f"{self.topic}-demand", **{"enable.partition.eof": True})
        return self._consumer

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
