"""How the worker's table values are stored in their changelog topics, and the Faust codecs that read them back.

An open episode is stored as the events that built it, byte for byte as they came, with their source
positions; recovery folds them again. So a changelog write is a concatenation, never a re-encoding, and
the format follows the event schemas (a newer worker reads what an older one wrote through the codec).
An open group is stored likewise as its members' Trajectory records. A closed episode and a task count
are small JSON objects; the binary values (open episodes, open and closed groups) start with a 4-byte tag
naming their format.
"""
from __future__ import annotations

import json
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Union

from faust.serializers import codecs

from schemas.records import SourcePosition
from streams.assembly import ClosedEpisode, EpisodeState, fold
from streams.fastcodec import decode_event, read_summary
from streams.grouping import ClosedGroup, GroupState, Member, TaskCount, add_member

_FRAME = struct.Struct("<iqI")  # partition, offset, length
_LEN = struct.Struct("<I")
EPISODE_TAG = b"EPL1"
GROUP_TAG = b"GRP1"
CLOSED_GROUP_TAG = b"GRC1"


class StateFormatError(ValueError):
    """A changelog value this worker cannot read (a newer format, or damage)."""


@dataclass(frozen=True)
class EpisodeLog:
    """An open episode: its folded state and the raw events it was folded from (the changelog value)."""

    state: EpisodeState
    raw: tuple[bytes, ...]
    # Wall time (monotonic) the worker last touched it; not stored, so a recovered episode starts fresh.
    touched: float = field(default_factory=time.monotonic, compare=False)

    def extend(self, state: EpisodeState, raw: bytes) -> "EpisodeLog":
        return EpisodeLog(state, self.raw + (raw,))


def dump_episode(log: EpisodeLog) -> bytes:
    parts = [EPISODE_TAG]
    for position, raw in zip(log.state.positions, log.raw):
        parts.append(_FRAME.pack(position.partition, position.offset, len(raw)))
        parts.append(raw)
    return b"".join(parts)


def load_episode(data: bytes) -> EpisodeLog:
    """Fold the logged events again; they were validated when they first came."""
    _expect(data, EPISODE_TAG)
    state: Optional[EpisodeState] = None
    raws: list[bytes] = []
    for partition, offset, raw in _frames(data, len(EPISODE_TAG)):
        state = fold(state, decode_event(raw), SourcePosition(partition, offset))
        raws.append(raw)
    if state is None:
        raise StateFormatError("an episode log without events")
    return EpisodeLog(state, tuple(raws))


def dump_group(group: Union[GroupState, ClosedGroup]) -> bytes:
    if isinstance(group, ClosedGroup):
        return CLOSED_GROUP_TAG + _json({"closed_ts": group.closed_ts, "ids": list(group.trajectory_ids),
                                         "timed_out": group.timed_out, "partition": group.partition})
    header = _json({"group_id": group.group_id, "size": group.size, "first_ts": group.first_ts,
                    "partition": group.partition})
    parts = [GROUP_TAG, _LEN.pack(len(header)), header]
    for member in group.members:
        parts += [_FRAME.pack(0, 0, len(member.raw)), member.raw]
    return b"".join(parts)


def load_group(data: bytes) -> Union[GroupState, ClosedGroup]:
    if data[:4] == CLOSED_GROUP_TAG:
        doc = json.loads(data[4:])
        return ClosedGroup(doc["closed_ts"], tuple(doc["ids"]), doc["timed_out"], doc["partition"])
    _expect(data, GROUP_TAG)
    (n,) = _LEN.unpack_from(data, 4)
    header = json.loads(data[8:8 + n])
    state = GroupState(header["group_id"], header["size"], header["first_ts"], header["partition"])
    for _, _, raw in _frames(data, 8 + n):
        state = add_member(state, Member(read_summary(raw), raw), state.partition)
    return state


def dump_closed_episode(closed: ClosedEpisode) -> bytes:
    return _json({"status": closed.status, "closed_ts": closed.closed_ts, "ids": list(closed.event_ids),
                  "partition": closed.partition})


def load_closed_episode(data: bytes) -> ClosedEpisode:
    doc = json.loads(data)
    return ClosedEpisode(doc["status"], doc["closed_ts"], tuple(doc["ids"]), doc["partition"])


def dump_task_count(count: TaskCount) -> bytes:
    return _json({"domain": count.domain, "attempts": count.attempts, "passes": count.passes, "ts": count.ts})


def load_task_count(data: bytes) -> TaskCount:
    doc = json.loads(data)
    return TaskCount(doc["domain"], doc["attempts"], doc["passes"], doc["ts"])


def _json(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()


def _expect(data: bytes, tag: bytes) -> None:
    if data[:len(tag)] != tag:
        raise StateFormatError(f"changelog value starts with {data[:4]!r}, expected {tag!r}")


def _frames(data: bytes, at: int) -> Iterator[tuple[int, int, bytes]]:
    view = memoryview(data)
    while at < len(data):
        if at + _FRAME.size > len(data):
            raise StateFormatError(f"a frame header is cut at byte {at}")
        partition, offset, n = _FRAME.unpack_from(data, at)
        at += _FRAME.size
        if at + n > len(data):
            raise StateFormatError(f"a frame of {n} bytes is cut at byte {at}")
        yield partition, offset, bytes(view[at:at + n])
        at += n


class _Codec(codecs.Codec):
    """A Faust codec over a dump/load pair, so table recovery reads the changelog into these objects."""

    dump: Any = None
    load: Any = None

    def _dumps(self, obj: Any) -> bytes:
        return self.dump(obj)  # type: ignore[no-any-return]

    def _loads(self, s: bytes) -> Any:
        return self.load(s)


def _codec(name: str, dump: Any, load: Any) -> str:
    cls = type(f"{name}Codec", (_Codec,), {"dump": staticmethod(dump), "load": staticmethod(load)})
    codecs.register(name, cls())
    return name


EPISODE_CODEC = _codec("trajpipe-episode", dump_episode, load_episode)
CLOSED_EPISODE_CODEC = _codec("trajpipe-closed-episode", dump_closed_episode, load_closed_episode)
GROUP_CODEC = _codec("trajpipe-group", dump_group, load_group)
TASK_COUNT_CODEC = _codec("trajpipe-task-count", dump_task_count, load_task_count)
