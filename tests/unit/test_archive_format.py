"""Archive objects: record round trip, deterministic bytes, keys, and how the archiver cuts and resumes."""
from __future__ import annotations

import io
import json
from dataclasses import replace

import fastavro
import pytest

from consumers.archive import ArchiveBounds, ChunkBuilder, resume_offset
from schemas import codec
from schemas.archive import (
    ArchivedEvent,
    ArchiveObject,
    archive_prefix,
    parse_archive_key,
    read_archive,
    sorted_objects,
    write_archive,
)
from schemas.errors import DecodeError
from schemas.keys import archive_key
from schemas.registry import AVRO_DIR
from tests.taps import episode

DAY_MS = 86_400_000
T0 = 1_700_000_000_000  # 2023-11-14T22:13:20Z


def records(n: int = 6, ts: int = T0, partition: int = 0) -> list[ArchivedEvent]:
    events = episode("ep-a", ts, turns=2)[:n]
    return [ArchivedEvent(topic="ns.rollout.events", partition=partition, offset=10 + i, timestamp=ts + i,
                          key=b"ep-a", value=codec.encode(e), headers=(("trace", b"x"),) if i == 0 else ())
            for i, e in enumerate(events)]


def test_records_round_trip_with_their_original_bytes() -> None:
    recs = records() + [ArchivedEvent("ns.rollout.events", 1, 0, T0, None, b"\x00garbage", (("h", None),))]
    assert read_archive(write_archive(recs, "k")) == recs


def test_archived_bytes_decode_to_the_same_events() -> None:
    recs = records()
    back = read_archive(write_archive(recs, "k"))
    assert [codec.decode(r.value) for r in back] == [codec.decode(r.value) for r in recs]


def test_bytes_are_deterministic_per_key() -> None:
    recs = records()
    assert write_archive(recs, "a/key") == write_archive(list(recs), "a/key")
    assert write_archive(recs, "a/key") != write_archive(recs, "b/key")  # the sync marker follows the key
    assert write_archive(recs, "k", "null") != write_archive(recs, "k")


def test_any_avro_reader_reads_an_object_with_the_avsc() -> None:
    schema = json.loads((AVRO_DIR / "ArchivedEvent.avsc").read_text())
    recs = records()
    rows = list(fastavro.reader(io.BytesIO(write_archive(recs, "k")), reader_schema=fastavro.parse_schema(schema)))
    assert [r["offset"] for r in rows] == [10, 11, 12, 13, 14, 15]
    assert [r["value"] for r in rows] == [r.value for r in recs]


def test_a_corrupt_object_is_a_decode_error() -> None:
    data = write_archive(records(), "k")
    with pytest.raises(DecodeError) as info:
        read_archive(b"nope" + data[4:])
    assert info.value.reason == "bad_magic"
    with pytest.raises(DecodeError):
        read_archive(data[: len(data) // 2])


def test_keys_parse_back_and_sort() -> None:
    key = archive_key("ns", "ns.rollout.events", "2025-01-31", 3, 100, 199)
    assert key.startswith(archive_prefix("ns", "ns.rollout.events"))
    assert parse_archive_key(key) == ArchiveObject(key, "ns.rollout.events", "2025-01-31", 3, 100, 199)
    other = archive_key("ns", "ns.rollout.events", "2025-01-30", 0, 0, 99)
    assert [o.key for o in sorted_objects([key, "archive/ns/README", other])] == [other, key]
    with pytest.raises(DecodeError):
        parse_archive_key("shards/ns/x/p0000/1-2.avro")


def test_chunks_cut_at_count_bytes_and_date() -> None:
    builder = ChunkBuilder(ArchiveBounds(max_events=4, max_bytes=10**9, max_age_s=60))
    closed = [c for r in records(6) for c in builder.add(r, now=0.0)]
    assert [(c.first, c.last) for c in closed] == [(10, 13)]
    late = ArchivedEvent("ns.rollout.events", 0, 16, T0 + DAY_MS, b"ep-a", b"v")  # next UTC day
    (day_one,) = builder.add(late, now=0.0)
    assert (day_one.first, day_one.last, day_one.date) == (14, 15, "2023-11-14")
    (day_two,) = builder.drain()
    assert day_two.date == "2023-11-15" and day_two.key("ns").endswith("/date=2023-11-15/p0000/"
                                                                     "00000000000000000016-00000000000000000016.avro")


def test_chunks_cut_by_size_and_age_per_partition() -> None:
    builder = ChunkBuilder(ArchiveBounds(max_events=100, max_bytes=1, max_age_s=5))
    assert len(builder.add(records(1)[0], now=0.0)) == 1  # one record already exceeds one byte
    builder = ChunkBuilder(ArchiveBounds(max_events=100, max_bytes=10**9, max_age_s=5))
    builder.add(records(1, partition=0)[0], now=0.0)
    builder.add(records(1, partition=1)[0], now=3.0)
    assert [c.partition for c in builder.due(now=5.0)] == [0]
    assert [c.partition for c in builder.due(now=8.0)] == [1]


def test_resume_skips_what_the_store_already_holds() -> None:
    objs = [ArchiveObject("a", "t", "d", 0, 0, 99), ArchiveObject("b", "t", "d", 0, 100, 149),
            ArchiveObject("c", "t", "d", 1, 0, 9)]
    assert resume_offset(objs, 0, 0) == 150  # committed offset lost: nothing archived twice
    assert resume_offset(objs, 0, 100) == 150  # crashed after writing, before committing
    assert resume_offset(objs, 0, 150) == 150
    assert resume_offset(objs, 1, 5) == 10
    assert resume_offset(objs, 2, 7) == 7


def test_an_object_written_without_headers_reads_with_the_default() -> None:
    old = json.loads((AVRO_DIR / "ArchivedEvent.avsc").read_text())
    old["fields"] = [f for f in old["fields"] if f["name"] != "headers"]
    old["fields"][3]["type"] = "long"
    buf, recs = io.BytesIO(), records()
    fastavro.writer(buf, fastavro.parse_schema(old), [{k: v for k, v in r.__dict__.items() if k != "headers"}
                                                       for r in recs])
    assert read_archive(buf.getvalue()) == [replace(r, headers=()) for r in recs]
