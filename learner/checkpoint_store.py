"""Checkpoints in the object store and on the compacted topic: store, verify, announce, find the newest.

Order of a save (each step can crash; the restart reads only what was announced):
    1. the files under checkpoints/<ns>/v<N>/, each written and read back
    2. manifest.json (sha256 per file, the batch offsets and ids this version consumed)
    3. CheckpointPublished on <ns>.policy.checkpoints (flushed, acknowledged)
    4. the consumer offsets of the batches topic are committed (by the caller)
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping, Optional

from infra.kafka import Publisher, read_topic
from infra.objectstore import ObjectStore
from infra.settings import Settings
from learner.checkpoint_files import verify_files
from schemas.codec import codec
from schemas.errors import CheckpointError, DecodeError, IntegrityError, ObjectNotFound
from schemas.keys import checkpoint_prefix
from schemas.manifests import CheckpointManifest
from schemas.packing import sha256_hex
from schemas.records import CheckpointPublished
from schemas.topics import Topics

MANIFEST_FILE = "manifest.json"


@dataclass(frozen=True)
class LoadedCheckpoint:
    event: CheckpointPublished
    manifest: CheckpointManifest
    files: dict[str, bytes]


def store_files(store: ObjectStore, ns: str, version: int, files: Mapping[str, bytes],
                manifest: CheckpointManifest) -> tuple[str, str]:
    """Steps 1-2: every file verified in the store, then the manifest; returns (manifest key, its sha256)."""
    prefix = checkpoint_prefix(ns, version)
    for name, data in sorted(files.items()):
        store.put_verified(prefix + name, data)
    body = manifest.to_json()
    store.put_verified(prefix + MANIFEST_FILE, body)
    return prefix + MANIFEST_FILE, sha256_hex(body)


def announce(publisher: Publisher, topics: Topics, store: ObjectStore, manifest: CheckpointManifest,
             manifest_key: str, manifest_sha: str) -> CheckpointPublished:
    """Step 3: publish and wait for the broker's acknowledgement."""
    event = CheckpointPublished(
        run=manifest.run, version=manifest.version, step=manifest.step, bucket=store.bucket,
        prefix=checkpoint_prefix(topics.ns, manifest.version), manifest_key=manifest_key,
        manifest_sha256=manifest_sha, algorithm=manifest.algorithm, batch_ids=tuple(manifest.batch_ids),
        ts=int(time.time() * 1000),
    )
    publisher.send(topics.checkpoints, manifest.run.encode(), codec.encode(event))
    publisher.flush()
    return event


def published(settings: Settings, topics: Topics) -> list[CheckpointPublished]:
    """Every announcement still on the compacted topic, oldest version first."""
    events = []
    for msg in read_topic(settings, topics.checkpoints):
        try:
            events.append(codec.decode(msg.value() or b"", expect=CheckpointPublished))
        except DecodeError:
            continue  # not ours to fix here; the monitor shows the topic's dead weight
    return sorted(events, key=lambda e: e.version)


def load(store: ObjectStore, event: CheckpointPublished) -> LoadedCheckpoint:
    """Download a checkpoint and verify the manifest and every file against their sha256."""
    try:
        body = store.get(event.manifest_key, sha256=event.manifest_sha256)
        manifest = CheckpointManifest.from_json(body)
        files = {name: store.get(event.prefix + name, sha256=entry.sha256) for name, entry in manifest.files.items()}
        verify_files(files, manifest.files)
    except (IntegrityError, ObjectNotFound) as exc:
        raise CheckpointError(f"checkpoint v{event.version} does not verify: {exc}") from exc
    return LoadedCheckpoint(event, manifest, files)


def newest(settings: Settings, topics: Topics, store: ObjectStore, run: str) -> Optional[LoadedCheckpoint]:
    """The newest announced checkpoint of `run` that verifies (a broken one is skipped, loudly)."""
    for event in reversed([e for e in published(settings, topics) if e.run == run]):
        try:
            return load(store, event)
        except CheckpointError as exc:
            print(f"warning: {exc}; trying an older one", flush=True)
    return None


def trained_batch_ids(settings: Settings, topics: Topics, run: str, up_to: int) -> set[str]:
    """Batch ids trained into versions <= up_to (the lineage a restart continues)."""
    return {b for e in published(settings, topics) if e.run == run and e.version <= up_to for b in e.batch_ids}
