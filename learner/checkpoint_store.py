"""Checkpoints in the object store and on the compacted topic: store, verify, announce, find the newest.

Order of a save (each step can crash; the restart reads only what was announced):
    1. the files under checkpoints/<ns>/v<N>/, each written and read back
    2. manifest.json (sha256 per file, the batch offsets and ids this version consumed)
    3. CheckpointPublished on <ns>.policy.checkpoints (flushed, acknowledged)
    4. the consumer offsets of the batches topic are committed (by the caller)
"""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Mapping, Optional

from infra.kafka import Publisher, read_topic
from infra.objectstore import ObjectStore
from infra.settings import Settings
from learner.checkpoint_files import verify_files
from learner.settings import parse_init
from schemas.codec import codec
from schemas.errors import CheckpointError, DecodeError, IntegrityError, ManifestError, ObjectNotFound
from schemas.keys import checkpoint_announcement_key, checkpoint_prefix
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
        entry = manifest.files.get(name)  # its sha256 is computed once, for the manifest
        store.put_verified(prefix + name, data, sha256=entry.sha256 if entry is not None else None)
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
    publisher.send(topics.checkpoints, checkpoint_announcement_key(manifest.run, manifest.version).encode(),
                   codec.encode(event))
    publisher.flush()
    return event


def published(settings: Settings, topics: Topics) -> list[CheckpointPublished]:
    """One announcement per (run, version), the last one made, oldest version first (the compacted topic
    keeps every version: one key each)."""
    events: dict[tuple[str, int], CheckpointPublished] = {}
    for msg in read_topic(settings, topics.checkpoints):
        try:
            event = codec.decode(msg.value() or b"", expect=CheckpointPublished)
        except DecodeError:
            continue  # not ours to fix here; the monitor shows the topic's dead weight
        events[(event.run, event.version)] = event
    return sorted(events.values(), key=lambda e: e.version)


def load(store: ObjectStore, event: CheckpointPublished) -> LoadedCheckpoint:
    """Download a checkpoint and verify the manifest and every file against their sha256."""
    try:
        body = store.get(event.manifest_key, sha256=event.manifest_sha256)
        manifest = CheckpointManifest.from_json(body)
        files = fetch_files(store, event.prefix, manifest)
    except (IntegrityError, ObjectNotFound) as exc:
        raise CheckpointError(f"checkpoint v{event.version} does not verify: {exc}") from exc
    return LoadedCheckpoint(event, manifest, files)


def newest(settings: Settings, topics: Topics, store: ObjectStore, run: str) -> Optional[LoadedCheckpoint]:
    """The newest announced checkpoint of `run` that verifies (a broken one is skipped, loudly); None when
    `run` announced nothing. CheckpointError when it announced versions and none verifies: starting over
    from fresh weights would announce a second, different v0."""
    announced = [e for e in published(settings, topics) if e.run == run]
    for event in reversed(announced):
        try:
            return load(store, event)
        except CheckpointError as exc:
            print(f"warning: {exc}; trying the version before it", file=sys.stderr, flush=True)
    if announced:
        raise CheckpointError(f"{run} announced v{announced[0].version}..v{announced[-1].version} on "
                              f"{topics.checkpoints} and none of them verifies in the store: restore the "
                              f"checkpoints/{run}/ objects, or start a new namespace")
    return None


def resume_point(settings: Settings, topics: Topics, store: ObjectStore,
                 run: str) -> Optional[tuple[LoadedCheckpoint, list[CheckpointManifest]]]:
    """Where a restarted learner of `run` resumes: the newest announced version that carries the optimizer
    state and verifies, and the manifests of the announced versions after it, oldest first (weights-only
    under --moments-every, or with files that do not verify): the learner trains their batches again, and
    stores again a version whose files do not verify. None when `run` announced nothing.

    Reads the announcements once and downloads the files of the resume point only: the versions after it
    come down once, when the learner compares them with what it trained again. A newest manifest that does
    not verify is skipped, loudly (that version is then made anew); one below a readable version is an
    error, since the versions after the resume point must be trained again in order."""
    announced = [e for e in published(settings, topics) if e.run == run]
    later: list[CheckpointManifest] = []
    for event in reversed(announced):
        try:
            manifest = CheckpointManifest.from_json(store.get(event.manifest_key, sha256=event.manifest_sha256))
        except (IntegrityError, ObjectNotFound, ManifestError) as exc:
            if later:
                raise CheckpointError(f"v{event.version} of {run}: its manifest does not verify ({exc}), and "
                                      f"v{later[-1].version} after it must be trained again from an older "
                                      f"version: restore the checkpoints/{run}/ objects") from exc
            print(f"warning: checkpoint v{event.version} does not verify: {exc}; trying the version before it",
                  file=sys.stderr, flush=True)
            continue
        if manifest.has_moments:
            try:
                return load(store, event), later[::-1]
            except CheckpointError as exc:  # trained again from an older version, and stored again
                print(f"warning: {exc}; trying the version before it", file=sys.stderr, flush=True)
        later.append(manifest)
    if announced:
        raise CheckpointError(f"{run} announced v{announced[0].version}..v{announced[-1].version} on "
                              f"{topics.checkpoints} and none of them verifies in the store with the optimizer "
                              f"state a resume needs: restore the checkpoints/{run}/ objects, or start a new "
                              "namespace")
    return None


def read_manifest(store: ObjectStore, ns: str, version: int) -> CheckpointManifest:
    """The manifest of version `version` of `ns`, from the store (the weights stay there)."""
    return CheckpointManifest.from_json(store.get(checkpoint_prefix(ns, version) + MANIFEST_FILE))


def load_version(store: ObjectStore, ns: str, version: int) -> LoadedCheckpoint:
    """Version `version` of `ns` straight from the store (its manifest names every file's sha256), whether or
    not its announcement is still on the compacted topic."""
    with verifying(ns, version):
        manifest = read_manifest(store, ns, version)
    return load_files(store, ns, manifest)


def load_files(store: ObjectStore, ns: str, manifest: CheckpointManifest) -> LoadedCheckpoint:
    """The files of a manifest already read (and verified against its announcement), each verified."""
    version, prefix = manifest.version, checkpoint_prefix(ns, manifest.version)
    with verifying(ns, version):
        files = fetch_files(store, prefix, manifest)
    event = CheckpointPublished(run=manifest.run, version=version, step=manifest.step, bucket=store.bucket,
                                prefix=prefix, manifest_key=prefix + MANIFEST_FILE, manifest_sha256="",
                                algorithm=manifest.algorithm, batch_ids=tuple(manifest.batch_ids), ts=0)
    return LoadedCheckpoint(event, manifest, files)


def fetch_files(store: ObjectStore, prefix: str, manifest: CheckpointManifest) -> dict[str, bytes]:
    """Every file the manifest lists, from under `prefix`, each checked against its sha256 and size."""
    files = {name: store.get(prefix + name, sha256=entry.sha256) for name, entry in manifest.files.items()}
    verify_files(files, manifest.files)
    return files


@contextmanager
def verifying(ns: str, version: int) -> Iterator[None]:
    """Reading checkpoint v`version` of `ns`: a missing object or one that does not verify raised as the
    CheckpointError that says which."""
    try:
        yield
    except ObjectNotFound as exc:
        raise CheckpointError(f"checkpoint v{version} of {ns} is not in the store (a retention of its learner, "
                              f"--keep-last/--keep-every, may have let it go): {exc}") from exc
    except (IntegrityError, ManifestError) as exc:
        raise CheckpointError(f"checkpoint v{version} of {ns} does not verify: {exc}") from exc


def trained_batch_ids(settings: Settings, topics: Topics, run: str, up_to: int) -> set[str]:
    """Batch ids trained into versions <= up_to (the lineage a restart continues)."""
    return {b for e in published(settings, topics) if e.run == run and e.version <= up_to for b in e.batch_ids}


def ancestors(store: ObjectStore, run: str) -> list[tuple[str, int]]:
    """The (run, version) checkpoints `run` descends from, nearest first: its v0 manifest's `init_from`, that
    run's, and so on. The chain ends where a run started fresh, or where an ancestor's objects are gone (its
    trajectories then count as outside the lineage)."""
    chain: list[tuple[str, int]] = []
    while True:
        try:
            origin = read_manifest(store, run, 0).init_from
        except (ManifestError, ObjectNotFound):
            return chain
        if not origin:
            return chain
        parent, version = parse_init(origin, run)  # as --init wrote it (a run never names itself)
        if any(parent == r for r, _ in chain):
            raise CheckpointError(f"checkpoints of {run} name {origin} as their origin: a cycle")
        chain.append((parent, version))
        run = parent


def prunable(version: int, keep_last: int, keep_every: int, protected: set[int]) -> Optional[int]:
    """The version that a retention of the last `keep_last` versions (and every `keep_every`-th, and the
    `protected` ones) lets go when `version` is announced: each version is let go once, when it falls out of
    the last `keep_last` (None: nothing to let go, or no retention)."""
    old = version - keep_last
    if keep_last <= 0 or old <= 0 or old in protected or (keep_every > 0 and old % keep_every == 0):
        return None
    return old


def prune(store: ObjectStore, ns: str, version: int) -> int:
    """Delete a version's files (weights, optimizer, config); its manifest stays, so lineage still says what
    trained into it and why not. Returns the bytes freed."""
    prefix = checkpoint_prefix(ns, version)
    try:
        manifest = read_manifest(store, ns, version)
    except (ManifestError, ObjectNotFound):
        return 0
    for name in manifest.files:
        store.delete(prefix + name)
    return sum(entry.size for entry in manifest.files.values())
