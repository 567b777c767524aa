"""Object-key layout in the object store, and ids derived from source positions."""
from __future__ import annotations

import hashlib
import os
import time


def shard_key(ns: str, topic: str, partition: int, first: int, last: int) -> str:
    return f"shards/{ns}/{topic}/p{partition:04d}/{first:020d}-{last:020d}.avro"


def batch_id(topic: str, partition: int, first: int, last: int) -> str:
    return f"{topic}:{partition}:{first}-{last}"


def checkpoint_prefix(ns: str, version: int) -> str:
    return f"checkpoints/{ns}/v{version}/"


def archive_key(ns: str, topic: str, date: str, partition: int, first: int, last: int) -> str:
    return f"archive/{ns}/{topic}/date={date}/p{partition:04d}/{first:020d}-{last:020d}.avro"


def checkpoint_announcement_key(run: str, version: int) -> str:
    """One key per version on the compacted checkpoint topic: compaction drops only a version's re-announcement,
    never an older version (the history eval, lineage and a falling-back learner read)."""
    return f"{run}/v{version:010d}"


def claim_key(ns: str, episode_id: str, event_id: str) -> str:
    return f"claims/{ns}/{episode_id}/{event_id}.bin"


def trajectory_id(episode_id: str) -> str:
    """Deterministic: the same episode always gives the same trajectory id (idempotent outputs)."""
    return "traj-" + hashlib.sha256(episode_id.encode()).hexdigest()[:24]


_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


def new_event_id(now_ms: int | None = None) -> str:
    """A ULID: 48-bit millisecond time then 80 random bits, Crockford base32; sorts by time."""
    ms = int(time.time() * 1000) if now_ms is None else now_ms
    value = (ms << 80) | int.from_bytes(os.urandom(10), "big")
    return "".join(_CROCKFORD[(value >> (5 * i)) & 31] for i in range(25, -1, -1))
