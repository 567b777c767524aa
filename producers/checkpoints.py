"""Follows <ns>.policy.checkpoints: downloads each new checkpoint, verifies every sha256, hands it to the worker.

    follower = CheckpointFollower(settings, topics, store)
    follower.start()                        # background thread: consume, download, verify
    ready = follower.take_ready()           # a verified checkpoint newer than the last taken, or None
    backend.load_weights(ready.weights, ready.version)
"""
from __future__ import annotations

import logging
import threading
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

from confluent_kafka import TopicPartition

from infra.kafka import consumer
from infra.objectstore import ObjectStore
from infra.settings import Settings
from schemas.codec import codec
from schemas.errors import CheckpointError, DecodeError, IntegrityError, ManifestError, ObjectStoreError
from schemas.manifests import BROADCAST_FILE, WEIGHTS_FILE, CheckpointManifest
from schemas.packing import sha256_hex
from schemas.records import CheckpointPublished
from schemas.topics import Topics

log = logging.getLogger(__name__)
KEEP_REFUSALS = 20  # the newest reasons a worker keeps (and reports) of the checkpoints it refused


@dataclass(frozen=True)
class VerifiedCheckpoint:
    version: int
    weights: dict[str, Any]  # tensor name -> tensor, loaded from verified safetensors bytes
    event: CheckpointPublished
    manifest: CheckpointManifest  # verified: its batch offsets and next_batches say what the learner still needs
    file: str = WEIGHTS_FILE  # which weights: the float32 ones, or the learner's bfloat16 broadcast
    size: int = 0  # bytes of it downloaded


def fetch_verified(store: ObjectStore, event: CheckpointPublished, broadcast: bool = True) -> VerifiedCheckpoint:
    """Download and verify a checkpoint's weights: its bfloat16 broadcast when the learner wrote one and
    `broadcast` (a worker following the learner), else the float32 weights; CheckpointError says what did not
    verify."""
    from safetensors import SafetensorError
    from safetensors.torch import load as load_safetensors

    try:
        manifest_bytes = store.get(event.manifest_key)
        if sha256_hex(manifest_bytes) != event.manifest_sha256:
            raise IntegrityError(f"manifest {event.manifest_key} sha256 differs from the published one")
        manifest = CheckpointManifest.from_json(manifest_bytes)
        name = BROADCAST_FILE if broadcast and BROADCAST_FILE in manifest.files else WEIGHTS_FILE
        entry = manifest.files.get(name)
        if entry is None:
            raise ManifestError(f"manifest of v{event.version} lists no {WEIGHTS_FILE}")
        data = store.get(event.prefix + name, sha256=entry.sha256)
        weights = load_safetensors(data)
    except (IntegrityError, ManifestError, ObjectStoreError) as exc:
        raise CheckpointError(f"checkpoint v{event.version} refused: {exc}") from exc
    except SafetensorError as exc:
        raise CheckpointError(f"checkpoint v{event.version} refused: {name} is not readable safetensors: {exc}") from exc
    return VerifiedCheckpoint(event.version, weights, event, manifest, name, len(data))


def find_announcement(settings: Settings, topics: Topics, version: Optional[int]) -> CheckpointPublished:
    """The announcement of `version` (None: the newest) on a namespace's checkpoint topic."""
    from infra.kafka import read_topic

    events = []
    for msg in read_topic(settings, topics.checkpoints):
        try:
            events.append(codec.decode(msg.value() or b"", expect=CheckpointPublished))
        except DecodeError:
            continue
    matches = [e for e in events if version is None or e.version == version]
    if not matches:
        raise CheckpointError(f"{topics.checkpoints} has no checkpoint {'at all' if version is None else f'v{version}'}")
    return max(matches, key=lambda e: e.version)


class CheckpointFollower:
    """Keeps the newest published version known and the newest verified checkpoint ready to load."""

    def __init__(self, settings: Settings, topics: Topics, store: ObjectStore, run: Optional[str] = None) -> None:
        self.settings, self.topics, self.store = settings, topics, store
        self.run = run or topics.ns
        self.latest_published = 0
        self.latest_announced = 0
        self.refused: deque[str] = deque(maxlen=KEEP_REFUSALS)  # the newest reasons
        self.refused_count = 0
        # Set once every announcement that existed at start has been read: "the newest" is known from then on.
        self.caught_up = threading.Event()
        self._ready: Optional[VerifiedCheckpoint] = None
        self._taken = -1  # no checkpoint taken yet: even v0 (the learner's initial weights) is news
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="checkpoint-follower", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def take_ready(self) -> Optional[VerifiedCheckpoint]:
        with self._lock:
            ready, self._ready = self._ready, None
            if ready is not None:
                self._taken = ready.version
            return ready

    def _loop(self) -> None:
        c = consumer(self.settings, f"{self.topics.ns}-follower-{uuid.uuid4().hex[:8]}")
        c.assign([TopicPartition(self.topics.checkpoints, 0, 0)])  # compacted: replay it all from the start
        end = self._end_offset(c)
        try:
            while not self._stop.is_set():
                msg = c.poll(0.5)
                if msg is not None and not msg.error():
                    self.handle(msg.value() or b"")
                    offset = msg.offset()
                    end = end if end is None or offset is None or offset + 1 < end else 0
                if end == 0 or (end is None and msg is None):
                    self.caught_up.set()
        finally:
            c.close()

    def _end_offset(self, c: Any) -> Optional[int]:
        """The end of the topic at start (0 when empty), or None when the broker cannot say yet."""
        try:
            _, high = c.get_watermark_offsets(TopicPartition(self.topics.checkpoints, 0), timeout=10)
            return int(high)
        except Exception as exc:  # a broker still starting: fall back to "a poll that found nothing"
            log.warning("checkpoint topic end unknown (%s); caught up once a poll finds nothing", exc)
            return None

    def handle(self, value: bytes) -> None:
        try:
            event = codec.decode(value, expect=CheckpointPublished)
        except DecodeError as exc:
            self.refuse(f"undecodable checkpoint announcement: {exc}")
            return
        if event.run != self.run or event.version <= max(self._taken, self._ready.version if self._ready else -1):
            return
        self.latest_announced = max(self.latest_announced, event.version)
        try:
            verified = fetch_verified(self.store, event)
        except CheckpointError as exc:
            self.refuse(str(exc))
            return
        with self._lock:
            self._ready = verified
            # Lag is measured against verified versions: a refused one must not pause the fleet forever.
            self.latest_published = max(self.latest_published, event.version)
        log.info("checkpoint v%d verified and ready", event.version)

    def refuse(self, reason: str) -> None:
        """Count and log a checkpoint this worker will not use (the reason is in its report)."""
        self.refused.append(reason)
        self.refused_count += 1
        log.error("%s", reason)
