"""How the worker's table values are stored in their changelog topics, and the Faust codecs that read them back.

An open episode is stored as the events that built it, byte for byte as they came, with their source
positions; recovery folds them again. So a changelog write is a concatenation, never a re-encoding, and
the format follows the event schemas (a newer worker reads what an older one wrote through the codec).
An open group is stored as its members' summaries (a few hundred bytes each), and each member's Trajectory
record under its own key, `member_key(group, trajectory)`, written once when it joins: a batch never
rewrites a group's records, and no value grows with the group (16 members of 32k tokens each would be
a 6 MB value, over any broker's record limit). A closed episode and a task count are small JSON objects;
the binary values (open episodes, open and closed groups, members) start with a 4-byte tag naming their
format. The episodes and groups tables also hold their stage's counters of each partition (`PartitionCounts`
under `counts_key(partition)`, tag CNT1, a key no id can take: streams.counting).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Union

from faust.serializers import codecs

from schemas.records import SourcePosition
from streams.assembly import ClosedEpisode, EpisodeState, fold
from streams.fastcodec import Summary, decode_event, read_summary
from streams.grouping import ClosedGroup, GroupState, Member, TaskCount, add_member

_FRAME = struct.Struct("<iqI")  # partition, offset, length
_LEN = struct.Struct("<I")
EPISODE_TAG = b"EPL1"
GROUP_TAG = b"GRP1"  # an open group with its members' records inline (written by earlier workers; still read)
GROUP_SUMMARY_TAG = b"GRP2"  # an open group: its members' summaries, their records under member keys
CLOSED_GROUP_TAG = b"GRC1"
MEMBER_TAG = b"GRM1"
MEMBER_SEPARATOR = b"\x00"  # group ids never hold it: keys of members sort after their group's
COUNTS_TAG = b"CNT1"
COUNTS_PREFIX = b"\x00counts\x00"  # + the partition: a stage's counts, in its own table (ids never hold NUL)


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


def dump_episode(log: Union[EpisodeLog, PartitionCounts]) -> bytes:
    if isinstance(log, PartitionCounts):
        return dump_counts(log)
    parts = [EPISODE_TAG]
    for position, raw in zip(log.state.positions, log.raw):
        parts.append(_FRAME.pack(position.partition, position.offset, len(raw)))
        parts.append(raw)
    return b"".join(parts)


def load_episode(data: bytes) -> Union[EpisodeLog, PartitionCounts]:
    """Fold the logged events again; they were validated when they first came."""
    if data[:len(COUNTS_TAG)] == COUNTS_TAG:
        return load_counts(data)
    _expect(data, EPISODE_TAG)
    state: Optional[EpisodeState] = None
    raws: list[bytes] = []
    for partition, offset, raw in _frames(data, len(EPISODE_TAG)):
        state = fold(state, decode_event(raw), SourcePosition(partition, offset))
        raws.append(raw)
    if state is None:
        raise StateFormatError("an episode log without events")
    return EpisodeLog(state, tuple(raws))


@dataclass(frozen=True)
class MemberRecord:
    """One member's Trajectory record, as it came, under `member_key(group key, trajectory id)`."""

    raw: bytes


GroupValue = Union[GroupState, ClosedGroup, MemberRecord]


@dataclass(frozen=True)
class PartitionCounts:
    """A stage's counters of one input partition since the start of the log (streams.counting).

    `offset`: the last input offset they count; `pending`: keys the sweeper closed and counted whose closing
    writes (after this value in the same changelog partition) may not have landed: closing one again is not
    counted again.
    """

    offset: int = -1
    counts: tuple[tuple[str, tuple[tuple[str, str], ...], int], ...] = ()
    pending: frozenset[bytes] = frozenset()


def counts_key(partition: int) -> bytes:
    return COUNTS_PREFIX + str(partition).encode()


def dump_counts(value: PartitionCounts) -> bytes:
    return COUNTS_TAG + _json({"offset": value.offset, "counts": [[n, [list(kv) for kv in labels], v]
                                                                 for n, labels, v in value.counts],
                               "pending": sorted(k.hex() for k in value.pending)})


def load_counts(data: bytes) -> PartitionCounts:
    doc = json.loads(data[len(COUNTS_TAG):])
    return PartitionCounts(doc["offset"], tuple((n, tuple((k, v) for k, v in labels), int(c))
                                                for n, labels, c in doc["counts"]),
                           frozenset(bytes.fromhex(k) for k in doc["pending"]))


def member_key(group_key: bytes, trajectory_id: str) -> bytes:
    return group_key + MEMBER_SEPARATOR + trajectory_id.encode()


def dump_group(group: Union[GroupValue, PartitionCounts]) -> bytes:
    if isinstance(group, PartitionCounts):
        return dump_counts(group)
    if isinstance(group, ClosedGroup):
        return CLOSED_GROUP_TAG + _json({"closed_ts": group.closed_ts, "ids": list(group.trajectory_ids),
                                         "timed_out": group.timed_out, "partition": group.partition})
    if isinstance(group, MemberRecord):
        return MEMBER_TAG + group.raw
    return GROUP_SUMMARY_TAG + _json({"group_id": group.group_id, "size": group.size, "first_ts": group.first_ts,
                                      "partition": group.partition,
                                      "members": [_summary_fields(m.summary) for m in group.members]})


SUMMARY_FIELDS = tuple(f.name for f in dataclasses.fields(Summary))


def _summary_fields(summary: Summary) -> dict[str, Any]:
    """A member's summary as `dataclasses.asdict` gives it (its fields are flat), at a tenth of the cost: every
    write of an open group dumps all of its members again."""
    return {name: getattr(summary, name) for name in SUMMARY_FIELDS}


def load_group(data: bytes) -> Union[GroupValue, PartitionCounts]:
    """A group value; an open group's members come back without their records (`raw` empty): those are
    the MemberRecords under their own keys."""
    tag = data[:4]
    if tag == COUNTS_TAG:
        return load_counts(data)
    if tag == CLOSED_GROUP_TAG:
        doc = json.loads(data[4:])
        return ClosedGroup(doc["closed_ts"], tuple(doc["ids"]), doc["timed_out"], doc["partition"])
    if tag == MEMBER_TAG:
        return MemberRecord(data[4:])
    if tag == GROUP_SUMMARY_TAG:
        doc = json.loads(data[4:])
        state = GroupState(doc["group_id"], doc["size"], doc["first_ts"], doc["partition"])
        for fields in doc["members"]:
            state = add_member(state, Member(Summary(**fields), b""), state.partition)
        return state
    _expect(data, GROUP_TAG)
    (n,) = _LEN.unpack_from(data, 4)
    header = json.loads(data[8:8 + n])
    state = GroupState(header["group_id"], header["size"], header["first_ts"], header["partition"])
    for _, _, raw in _frames(data, 8 + n):
        state = add_member(state, Member(read_summary(raw), raw), state.partition)
    return state


def dump_closed_episode(closed: ClosedEpisode) -> bytes:
    if not closed.missing and type(closed.closed_ts) is int and type(closed.last_seq) is int \
            and type(closed.partition) is int:  # the usual marker, written as _json writes it, without its walk
        return b'{"closed_ts":%d,"last_seq":%d,"partition":%d,"status":%s}' % (
            closed.closed_ts, closed.last_seq, closed.partition, _json_string(closed.status))
    doc: dict[str, Any] = {"status": closed.status, "closed_ts": closed.closed_ts, "last_seq": closed.last_seq,
                           "partition": closed.partition}
    if closed.missing:
        doc["missing"] = list(closed.missing)
    return _json(doc)


def load_closed_episode(data: bytes) -> ClosedEpisode:
    doc = json.loads(data)
    if "ids" in doc:  # written by an earlier worker, with every event id: seqs 0..n-1 were taken
        return ClosedEpisode(doc["status"], doc["closed_ts"], len(doc["ids"]) - 1, (), doc["partition"])
    return ClosedEpisode(doc["status"], doc["closed_ts"], doc["last_seq"], tuple(doc.get("missing", ())),
                         doc["partition"])


def dump_task_count(count: TaskCount) -> bytes:
    return _json({"domain": count.domain, "attempts": count.attempts, "passes": count.passes, "ts": count.ts})


def load_task_count(data: bytes) -> TaskCount:
    doc = json.loads(data)
    return TaskCount(doc["domain"], doc["attempts"], doc["passes"], doc["ts"])


@functools.lru_cache(maxsize=64)
def _json_string(text: str) -> bytes:
    return json.dumps(text).encode()


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
