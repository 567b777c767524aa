"""Trajectory shards: deterministic Avro object container files of scored trajectories.

    data = write_shard(trajectories, key)   # same trajectories and key -> the same bytes
    trajectories = read_shard(data)         # DecodeError if the bytes are not a Trajectory shard
"""
from __future__ import annotations

import hashlib
import io
from typing import Any, Sequence, cast

import fastavro

from schemas.codec import codec, from_avro, to_avro
from schemas.errors import ConfigError, DecodeError
from schemas.records import Trajectory

CODECS = ("deflate", "null")
MAGIC = b"Obj\x01"


def sync_marker(key: str) -> bytes:
    """16 bytes derived from the object key: a random marker would make every rewrite differ."""
    return hashlib.sha256(key.encode()).digest()[:16]


def write_shard(trajectories: Sequence[Trajectory], key: str, compression: str = "deflate") -> bytes:
    """An Avro container of `trajectories` with the current Trajectory schema and no wall-clock metadata."""
    if compression not in CODECS:
        raise ConfigError(f"shard codec {compression!r}: use one of {', '.join(CODECS)}")
    buf = io.BytesIO()
    fastavro.writer(buf, codec.entry(Trajectory).parsed, (to_avro(t) for t in trajectories),
                    codec=compression, sync_marker=sync_marker(key), codec_compression_level=6)
    return buf.getvalue()


def read_shard(data: bytes) -> list[Trajectory]:
    """The trajectories of a shard, read with the current Trajectory schema (older shards are upcast)."""
    if bytes(data[:4]) != MAGIC:
        raise DecodeError("bad_magic", f"first bytes {bytes(data[:4]).hex()} are not an Avro container", "byte 0")
    try:
        rows = list(fastavro.reader(io.BytesIO(data), reader_schema=codec.entry(Trajectory).parsed))
        return [from_avro(Trajectory, cast(dict[str, Any], row)) for row in rows]
    except (EOFError, StopIteration, IndexError) as exc:
        raise DecodeError("truncated", f"shard ends early: {exc!r}") from exc
    except Exception as exc:  # fastavro and zlib raise many types on corrupt containers
        raise DecodeError("schema_mismatch", f"not a Trajectory shard: {exc!r}") from exc


def shard_range(key: str) -> tuple[int, int]:
    """(first, last) source offsets from a key made by schemas.keys.shard_key."""
    name = key.rsplit("/", 1)[-1].removesuffix(".avro")
    first, _, last = name.partition("-")
    try:
        return int(first), int(last)
    except ValueError as exc:
        raise DecodeError("schema_mismatch", f"{key!r} is not a shard key") from exc
