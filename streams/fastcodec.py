"""Hot-path reads of the codec's records: the same records as `schemas.codec`, cheaper (the C reader of
`schemas.avrobin` where it is built and the bytes are well-formed, fastavro's reader otherwise).

    event = decode_event(data)             # a RolloutEvent, as codec.decode gives it
    head = read_summary(data)              # what grouping needs of a Trajectory, without its turns
    scored = with_advantage(data, head.advantage_at, advantage, mean, std)
"""
from __future__ import annotations

import io
import struct
from dataclasses import dataclass
from typing import Any, Optional

from fastavro import parse_schema
from fastavro._read import schemaless_reader

from schemas import avrobin
from schemas.codec import CLASSES, HEADER_LEN, MAGIC, codec
from schemas.errors import DecodeError
from schemas.records import ClaimCheck, PolicyTurn, RolloutEvent, Trajectory

_EVENT = codec.current[RolloutEvent.SCHEMA]
_EVENT_HEADER = MAGIC + _EVENT.fingerprint
_TRAJECTORY = codec.current[Trajectory.SCHEMA]
_TRAJECTORY_HEADER = MAGIC + _TRAJECTORY.fingerprint
SCORE_FIELDS = ("advantage", "group_reward_mean", "group_reward_std")
_SCORES = struct.Struct("<ddd")
HEAD_FIELDS = ("trajectory_id", "group_id", "task_id", "domain", "status", "reward", "reward_components")
TAIL_FIELDS = ("ended_ts", "group_size")


def decode_event(data: bytes) -> RolloutEvent:
    """codec.decode(data, expect=RolloutEvent), faster for the current schema: no schema resolution, and the
    records built without their constructors (the schema reader has typed every field). Anything else,
    bad bytes included, goes through the codec, which names the error."""
    if data[:HEADER_LEN] != _EVENT_HEADER:
        return codec.decode(data, expect=RolloutEvent)  # type: ignore[no-any-return]
    found = avrobin.read(codec.programs[RolloutEvent], data, HEADER_LEN)
    if found is not None and found[1] == len(data):
        return found[0]  # type: ignore[no-any-return]
    return decode_event_with_fastavro(data)


def decode_event_with_fastavro(data: bytes) -> RolloutEvent:
    """decode_event without the C reader: what it must equal, and the codec's DecodeError for bad bytes."""
    buf = io.BytesIO(data)
    buf.seek(HEADER_LEN)
    try:
        fields = schemaless_reader(buf, _EVENT.parsed, None, return_record_name=True,
                                   return_record_name_override=True)
    except Exception:  # bad bytes: let the codec raise the DecodeError with its reason
        return codec.decode(data, expect=RolloutEvent)  # type: ignore[no-any-return]
    if buf.tell() != len(data) or not isinstance(fields, dict):
        return codec.decode(data, expect=RolloutEvent)  # type: ignore[no-any-return]
    return _event(fields)


def _new(cls: type, fields: dict[str, Any]) -> Any:
    # The frozen dataclass without its __init__: every field is present and typed by the schema reader.
    obj: Any = object.__new__(cls)
    obj.__dict__.update(fields)
    return obj


def _event(fields: dict[str, Any]) -> RolloutEvent:
    name, body = fields["body"]
    cls = CLASSES[name]
    if cls is PolicyTurn and body["claim"] is not None:
        body["claim"] = _new(ClaimCheck, body["claim"])
    fields["body"] = _new(cls, body)
    return _new(RolloutEvent, fields)  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Summary:
    """The fields of a Trajectory that grouping reads, and where its advantage is in the bytes."""

    trajectory_id: str
    group_id: str
    task_id: str
    domain: str
    status: str
    reward: float
    reward_components: dict[str, float]
    ended_ts: int
    group_size: int
    advantage_at: int


def _split_fields() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The Trajectory's fields before advantage (Head) and from it on (Tail).

    An Avro record is its fields' encodings back to back, so a Trajectory read as Head stops exactly where
    advantage starts; the fields left out of the summary (turns, prompt, task_spec) are skipped, never built.
    advantage, group_reward_mean and group_reward_std are consecutive doubles (8 bytes each), so the scored
    record is the trajectory with those 24 bytes replaced.
    """
    fields = _TRAJECTORY.expanded["fields"]
    names = [f["name"] for f in fields]
    at = names.index(SCORE_FIELDS[0])
    assert tuple(names[at:at + 3]) == SCORE_FIELDS and all(f["type"] == "double" for f in fields[at:at + 3]), \
        "advantage, group_reward_mean, group_reward_std must be consecutive doubles"
    return fields[:at], fields[at:]


def _part(name: str, fields: list[dict[str, Any]], keep: Optional[tuple[str, ...]] = None) -> Any:
    """fastavro's schema of a part: its writer schema, or with `keep` a reader schema of those fields."""
    chosen = [f for f in fields if keep is None or f["name"] in keep]
    return parse_schema({"type": "record", "name": name, "namespace": "trajpipe.fastcodec", "fields": chosen})


_HEAD, _TAIL = _split_fields()
_HEAD_WRITER, _HEAD_READER = _part("Head", _HEAD), _part("Head", _HEAD, HEAD_FIELDS)
_TAIL_WRITER, _TAIL_READER = _part("Tail", _TAIL), _part("Tail", _TAIL, TAIL_FIELDS)
# The C reader's programs of the same parts: the summary's fields read, the rest skipped.
_HEAD_PROGRAM = avrobin.compile_schema({**_TRAJECTORY.expanded, "fields": _HEAD}, {}, keep=frozenset(HEAD_FIELDS))
_TAIL_PROGRAM = avrobin.compile_schema({**_TRAJECTORY.expanded, "fields": _TAIL}, {}, keep=frozenset(TAIL_FIELDS))


def read_summary(data: bytes) -> Summary:
    """The summary of a Trajectory written with the current schema; DecodeError if it is not one."""
    if data[:HEADER_LEN] != _TRAJECTORY_HEADER:
        codec.decode(data, expect=Trajectory)  # raises for bad bytes
        raise DecodeError("unknown_schema", "a Trajectory of an earlier schema version; re-encode it first")
    head = avrobin.read(_HEAD_PROGRAM, data, HEADER_LEN)
    tail = avrobin.read(_TAIL_PROGRAM, data, head[1]) if head is not None else None
    if head is not None and tail is not None and tail[1] == len(data):
        return Summary(advantage_at=head[1], **head[0], **tail[0])
    return summary_with_fastavro(data)


def summary_with_fastavro(data: bytes) -> Summary:
    """read_summary without the C reader, for a current-schema Trajectory's bytes."""
    buf = io.BytesIO(data)
    buf.seek(HEADER_LEN)
    try:
        head = schemaless_reader(buf, _HEAD_WRITER, _HEAD_READER)
        at = buf.tell()
        tail = schemaless_reader(buf, _TAIL_WRITER, _TAIL_READER)
    except Exception:
        codec.decode(data, expect=Trajectory)  # raises the codec's DecodeError
        raise
    if buf.tell() != len(data) or not isinstance(head, dict) or not isinstance(tail, dict):
        raise DecodeError("schema_mismatch", f"{len(data) - buf.tell()} bytes left after a Trajectory")
    return Summary(advantage_at=at, **head, **tail)


def current_bytes(data: bytes) -> bytes:
    """The Trajectory in `data` encoded with the current schema (it may have been written by an older one)."""
    if data[:HEADER_LEN] == _TRAJECTORY_HEADER:
        return data
    return codec.encode(codec.decode(data, expect=Trajectory))


def with_advantage(data: bytes, at: int, advantage: float, mean: float, std: float) -> bytes:
    """The trajectory bytes with advantage, group_reward_mean and group_reward_std set."""
    return data[:at] + _SCORES.pack(advantage, mean, std) + data[at + _SCORES.size:]
