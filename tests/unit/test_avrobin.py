"""The C reader/writer of Avro bodies gives exactly what fastavro gives, and hands back what it does not handle."""
from __future__ import annotations

import dataclasses
import random
import struct

import pytest

from schemas import avrobin
from schemas.codec import HEADER_LEN, MAGIC, codec
from schemas.errors import DecodeError, EncodeError
from schemas.records import EpisodeStarted, PolicyTurn, RolloutEvent, SourcePosition, Trajectory
from streams import assembly, fastcodec
from streams.scoring import Scorer
from tests.streams_data import Episode, bodies, events_of
from tests.unit.test_codec import every_record, sample_trajectory


SCORER = Scorer.load("default", "1")


def test_the_c_reader_and_writer_are_built() -> None:
    assert avrobin.AVAILABLE, ("schemas/_avrobin.c was not compiled: install a C compiler and the Python headers "
                               "(gcc, python3-dev) and reinstall the package (pip install -e .)")


def structure(value: object) -> object:
    """The value with every container's and record's type kept, so a list never equals a tuple."""
    if dataclasses.is_dataclass(value):
        return (type(value).__name__, {k: structure(v) for k, v in value.__dict__.items()})
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [structure(v) for v in value])
    if isinstance(value, dict):
        return {k: structure(v) for k, v in value.items()}
    return (type(value).__name__, value)


def recorded_events(n_episodes: int = 120) -> list[RolloutEvent]:
    rng = random.Random(5)
    events: list[RolloutEvent] = []
    for i in range(n_episodes):
        domain = rng.choice(["code", "math", "table"])
        ep = Episode(f"ep-{i}", f"g-{i // 4}", domain, 4, rng.random() < 0.5, turns=1 + (i % 2) * (domain == "code"))
        events += events_of(ep, ts=1_700_000_000_000 + i)
    return events


def trajectory_of(events: list[RolloutEvent]) -> Trajectory:
    state = None
    for offset, event in enumerate(events):
        state = assembly.fold(state, event, SourcePosition(0, offset))
    assert state is not None
    return SCORER.score(assembly.to_trajectory(state, "t.rollout.events", "completed"))


@pytest.mark.parametrize("record", [*every_record(), *recorded_events(6)], ids=lambda r: type(r).__name__)
def test_bytes_and_values_equal_fastavros(record: object) -> None:
    entry = codec.current[type(record).SCHEMA]  # type: ignore[attr-defined]
    program = codec.programs[type(record)]
    fast = avrobin.write(program, record, MAGIC + entry.fingerprint)
    assert fast is not None and fast == codec.encode_with_fastavro(record, entry)
    found = avrobin.read(program, fast, HEADER_LEN)
    assert found is not None and found[1] == len(fast)
    assert structure(found[0]) == structure(codec.decode_with_fastavro(fast, entry, entry, type(record)))
    assert structure(found[0]) == structure(record)


def test_the_hot_reads_equal_their_fastavro_paths() -> None:
    events = recorded_events()
    by_episode: dict[str, list[RolloutEvent]] = {}
    for event in events:
        data = codec.encode(event)
        assert structure(fastcodec.decode_event(data)) == structure(fastcodec.decode_event_with_fastavro(data))
        by_episode.setdefault(event.episode_id, []).append(event)
    for episode in by_episode.values():
        data = codec.encode(trajectory_of(episode))
        assert fastcodec.read_summary(data) == fastcodec.summary_with_fastavro(data)


def outcome(read: object, data: bytes) -> object:
    try:
        return structure(read(data))  # type: ignore[operator]
    except DecodeError as exc:
        return ("DecodeError", exc.reason)


def test_corrupt_bodies_read_as_fastavro_reads_them() -> None:
    """Flipped bytes, truncations and appended bytes: the C path gives the same record or the same error."""
    rng = random.Random(11)
    event = recorded_events(1)[1]  # a PolicyTurn: strings, bytes, a union of records and of doubles
    originals = [codec.encode(event), codec.encode(sample_trajectory())]
    entry = {RolloutEvent: codec.current[RolloutEvent.SCHEMA], Trajectory: codec.current[Trajectory.SCHEMA]}

    def slow(data: bytes) -> object:
        cls = RolloutEvent if data[:HEADER_LEN] == MAGIC + entry[RolloutEvent].fingerprint else Trajectory
        return codec.decode_with_fastavro(data, entry[cls], entry[cls], cls)

    same = differ = 0
    for original in originals:
        for _ in range(1500):
            mutated = bytearray(original)
            for _ in range(rng.randint(1, 3)):
                mutated[rng.randrange(HEADER_LEN, len(mutated))] = rng.randrange(256)
            variants = [bytes(mutated), bytes(mutated[:rng.randrange(HEADER_LEN, len(mutated))]), bytes(mutated) + b"\x00"]
            for data in variants:
                expected = outcome(slow, data)
                assert outcome(codec.decode, data) == expected
                if data[:HEADER_LEN] == original[:HEADER_LEN] and original is originals[0]:
                    assert outcome(fastcodec.decode_event, data) == outcome(fastcodec.decode_event_with_fastavro, data)
                if avrobin.read(codec.programs[RolloutEvent if original is originals[0] else Trajectory],
                                data, HEADER_LEN) is None:
                    differ += 1
                else:
                    same += 1
    assert same > 100 and differ > 1000  # both paths were taken: some mutations still parse, most do not


def test_values_it_does_not_take_go_to_fastavro() -> None:
    event = recorded_events(1)[1]
    assert isinstance(event.body, PolicyTurn)
    entry = codec.current[RolloutEvent.SCHEMA]
    program = codec.programs[RolloutEvent]
    header = MAGIC + entry.fingerprint
    # an int where the union holds a double (written as the double), an "int" beyond 32 bits (fastavro writes
    # and reads it as a long): the C writer and reader hand both back, and the bytes and values are fastavro's
    for coerced in (dataclasses.replace(event, body=dataclasses.replace(event.body, temperature=1)),
                    dataclasses.replace(event, seq=2**40)):
        assert avrobin.write(program, coerced, header) is None
        data = codec.encode(coerced)
        assert data == codec.encode_with_fastavro(coerced, entry)
        assert avrobin.read(program, data, HEADER_LEN) is None or coerced.seq < 2**31
        assert structure(fastcodec.decode_event(data)) == structure(fastcodec.decode_event_with_fastavro(data))
        assert fastcodec.decode_event(data) == coerced
    # what neither takes: the codec's EncodeError names it
    for bad in (dataclasses.replace(event, body=dataclasses.replace(event.body, tokens="not bytes")),
                dataclasses.replace(event, ts=None)):
        assert avrobin.write(program, bad, header) is None
        with pytest.raises(EncodeError):
            codec.encode(bad)
    started = dataclasses.replace(event, body=EpisodeStarted("p", b"", "{}", 4, 1, 1e39, 8))  # beyond a float
    assert avrobin.write(program, started, header) is None


def test_lengths_and_counts_beyond_the_data_are_refused() -> None:
    program = avrobin.compile_schema({"type": "record", "name": "R", "fields": [
        {"name": "s", "type": "string"}, {"name": "xs", "type": {"type": "array", "items": "long"}},
        {"name": "m", "type": {"type": "map", "values": "double"}}]}, {})
    good = b"\x04hi" + b"\x04\x02\x04\x00" + b"\x02\x02k" + struct.pack("<d", 0.5) + b"\x00"
    assert avrobin.read(program, good, 0) == ({"s": "hi", "xs": [1, 2], "m": {"k": 0.5}}, len(good))
    blocks = b"\x04hi" + b"\x03\x04\x02\x04\x00" + b"\x00"  # an array block of count -2 with its byte size
    assert avrobin.read(program, blocks, 0) == ({"s": "hi", "xs": [1, 2], "m": {}}, len(blocks))
    for bad in (b"\x0ahi",  # a string longer than the data
                b"\x04hi\xfe\xff\xff\xff\x0f",  # an array of 2**31 items in a few bytes
                b"\x04hi\x00\x02\x02k",  # a map value cut short
                b"\x04\xff\xfe", b"\x04hi" + b"\x80" * 11):  # bad UTF-8; a varint of 11 bytes
        assert avrobin.read(program, bad, 0) is None
    assert avrobin.read(program, good, len(good) + 1) is None
