"""The archive's record and object format: deterministic Avro container files of raw Kafka records.

    data = write_archive(records, key)     # same records and key -> the same bytes
    for rec in iter_archive(data): ...     # ArchivedEvent, value = the event's original bytes
    where = parse_archive_key(key)         # ArchiveObject(topic, date, partition, first, last)
"""
from __future__ import annotations

import datetime as dt
import hashlib
import io
import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, ClassVar, Iterable, Iterator, Optional, Sequence

import fastavro
from fastavro.schema import to_parsing_canonical_form

from schemas.errors import ConfigError, DecodeError
from schemas.registry import AVRO_DIR

CODECS = ("deflate", "null")
MAGIC = b"Obj\x01"
Header = tuple[str, Optional[bytes]]


@dataclass(frozen=True)
class ArchivedEvent:
    SCHEMA: ClassVar[str] = "trajpipe.ArchivedEvent"
    topic: str
    partition: int
    offset: int
    timestamp: int  # Kafka record timestamp, ms
    key: Optional[bytes]
    value: bytes  # the single-object-encoded event, untouched
    headers: tuple[Header, ...] = ()


@dataclass(frozen=True)
class ArchiveObject:
    """Where an archive object sits, read back from its key."""

    key: str
    topic: str
    date: str
    partition: int
    first: int
    last: int


def _strip_logical(node: Any) -> Any:
    # Timestamps stay plain ints (ms), as in the codec; fastavro would turn them into datetimes.
    if isinstance(node, dict):
        return {k: _strip_logical(v) for k, v in node.items() if k != "logicalType"}
    if isinstance(node, list):
        return [_strip_logical(v) for v in node]
    return node


@lru_cache(maxsize=1)
def archive_schema() -> Any:
    doc = json.loads((AVRO_DIR / "ArchivedEvent.avsc").read_text())
    return fastavro.parse_schema(_strip_logical(doc))


def to_row(rec: ArchivedEvent) -> dict[str, Any]:
    row = dict(rec.__dict__)
    row["headers"] = [{"key": k, "value": v} for k, v in rec.headers]
    return row


def from_row(row: dict[str, Any]) -> ArchivedEvent:
    headers = tuple((h["key"], h["value"]) for h in row["headers"]) if row["headers"] else ()
    return ArchivedEvent(row["topic"], row["partition"], row["offset"], row["timestamp"], row["key"], row["value"],
                         headers)


@lru_cache(maxsize=1)
def _current_canonical() -> str:
    return to_parsing_canonical_form(archive_schema())  # type: ignore[no-any-return]


def _rows(data: bytes) -> Iterator[dict[str, Any]]:
    """Container rows, resolved against the current schema only when written with another one (twice as fast)."""
    rows = fastavro.reader(io.BytesIO(data))
    if to_parsing_canonical_form(rows.writer_schema) == _current_canonical():
        return rows  # type: ignore[return-value]
    return fastavro.reader(io.BytesIO(data), reader_schema=archive_schema())  # type: ignore[return-value]


def sync_marker(key: str) -> bytes:
    """16 bytes derived from the object key: a random marker would make every rewrite differ."""
    return hashlib.sha256(key.encode()).digest()[:16]


def write_archive(records: Iterable[ArchivedEvent], key: str, compression: str = "deflate") -> bytes:
    """An Avro container of `records` in the order given, with no wall-clock metadata."""
    if compression not in CODECS:
        raise ConfigError(f"archive codec {compression!r}: use one of {', '.join(CODECS)}")
    buf = io.BytesIO()
    fastavro.writer(buf, archive_schema(), (to_row(r) for r in records), codec=compression,
                    sync_marker=sync_marker(key), codec_compression_level=6)
    return buf.getvalue()


def iter_archive(data: bytes) -> Iterator[ArchivedEvent]:
    """The records of an archive object, in the order they were written."""
    if bytes(data[:4]) != MAGIC:
        raise DecodeError("bad_magic", f"first bytes {bytes(data[:4]).hex()} are not an Avro container", "byte 0")
    try:
        for row in _rows(data):
            yield from_row(row)
    except (EOFError, StopIteration, IndexError) as exc:
        raise DecodeError("truncated", f"archive object ends early: {exc!r}") from exc
    except DecodeError:
        raise
    except Exception as exc:  # fastavro and zlib raise many types on corrupt containers
        raise DecodeError("schema_mismatch", f"not an archive object: {exc!r}") from exc


def read_archive(data: bytes) -> list[ArchivedEvent]:
    return list(iter_archive(data))


def archive_prefix(ns: str, topic: str) -> str:
    """The prefix under which schemas.keys.archive_key puts every object of `topic`."""
    return f"archive/{ns}/{topic}/"


def utc_date(ms: int) -> str:
    return dt.datetime.fromtimestamp(ms / 1000, tz=dt.timezone.utc).strftime("%Y-%m-%d")


def parse_archive_key(key: str) -> ArchiveObject:
    """The inverse of schemas.keys.archive_key (topic, date, partition and offsets)."""
    try:
        _, _ns, topic, date_part, part, name = key.split("/")
        first, _, last = name.removesuffix(".avro").partition("-")
        if not (date_part.startswith("date=") and part.startswith("p")):
            raise ValueError(key)
        return ArchiveObject(key, topic, date_part[5:], int(part[1:]), int(first), int(last))
    except ValueError as exc:
        raise DecodeError("schema_mismatch", f"{key!r} is not an archive key") from exc


def sorted_objects(keys: Sequence[str]) -> list[ArchiveObject]:
    """Archive objects by partition then first offset; keys that are not archive keys are ignored."""
    found = []
    for key in keys:
        try:
            found.append(parse_archive_key(key))
        except DecodeError:
            continue
    return sorted(found, key=lambda o: (o.partition, o.first, o.last))
