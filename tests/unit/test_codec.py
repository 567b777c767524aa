"""Codec: round trips of every record, byte-exact framing, schema evolution, typed decode errors."""
from __future__ import annotations

import io
import json
import math
import random
import struct

import pytest
from fastavro import parse_schema, schemaless_writer
from fastavro.schema import to_parsing_canonical_form

from schemas import codec, decode, encode
from schemas.errors import DecodeError, EncodeError, IntegrityError
from schemas.examples import example_events
from schemas.packing import (
    join_payload,
    pack_floats,
    pack_ids,
    split_payload,
    unpack_floats,
    unpack_ids,
)
from schemas.records import (
    BatchManifest,
    CheckpointPublished,
    DeadLetter,
    EpisodeEnded,
    PipelineMetric,
    PolicyTurn,
    RolloutEvent,
    SourcePosition,
    TaskStats,
    Trajectory,
    TrajectoryTurn,
)
from schemas.registry import AVRO_DIR


def crc64_avro(data: bytes) -> int:
    """CRC-64-AVRO exactly as the Avro specification writes it out (independent of fastavro)."""
    empty = 0xC15D213AA4D7A795
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (empty & -(fp & 1))
        table.append(fp)
    fp = empty
    for b in data:
        fp = (fp >> 8) ^ table[(fp ^ b) & 0xFF]
    return fp


def zigzag(n: int) -> bytes:
    """Avro's variable-length zig-zag long, written out from the spec."""
    n = (n << 1) ^ (n >> 63)
    out = bytearray()
    while n & ~0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def avro_string(s: str) -> bytes:
    raw = s.encode()
    return zigzag(len(raw)) + raw


def sample_trajectory() -> Trajectory:
    turn = TrajectoryTurn(turn=0, policy_version=3, obs_text="", obs_tokens=b"", text="7",
                          tokens=pack_ids([58, 1]), logprobs=pack_floats([-0.5, -0.1]), finish_reason="stop",
                          outcome="", tests_passed=0, tests_total=0, stderr="")
    return Trajectory(trajectory_id="traj-1", episode_id="ep", group_id="g", task_id="math/1", domain="math",
                      run="r", status="completed", task_spec="{}", prompt_text="3+4=", prompt_tokens=pack_ids([1, 2]),
                      turns=(turn,), reward=1.0, reward_components={"outcome/correct": 1.0}, reward_fn="default",
                      reward_version="1", advantage=0.5, group_reward_mean=0.5, group_reward_std=0.5,
                      source_topic="r.rollout.events", source_offsets=(SourcePosition(0, 1), SourcePosition(0, 2)),
                      started_ts=1, ended_ts=2)


def every_record() -> list[object]:
    return [
        *example_events(),
        sample_trajectory(),
        BatchManifest(batch_id="b", run="r", bucket="trajpipe", key="k", sha256="0" * 64, size=10,
                      num_trajectories=2, num_tokens=30, source_topic="t", partition=0, first_offset=0,
                      last_offset=1, policy_version_min=0, policy_version_max=1, reward_mean=0.5, reward_std=0.1,
                      trajectory_ids=("a", "b"), ts=5),
        CheckpointPublished(run="r", version=2, step=20, bucket="trajpipe", prefix="checkpoints/r/v2/",
                            manifest_key="checkpoints/r/v2/manifest.json", manifest_sha256="a" * 64,
                            algorithm="grpo", batch_ids=("b1",), ts=9),
        DeadLetter(reason="bad_magic", detail="x", stage="clean", source_topic="t", partition=1, offset=7,
                   key=b"k", original=b"\x00\x01", ts=3),
        PipelineMetric(source="streams", name="rollout/reward_mean", value=0.25, labels={"domain": "math"},
                       window_start=0, window_end=10),
        TaskStats(task_id="t", domain="code", attempts=4, passes=1, ts=1),
    ]


@pytest.mark.parametrize("record", every_record(), ids=lambda r: type(r).__name__)
def test_every_record_round_trips(record: object) -> None:
    data = encode(record)
    assert data[:2] == b"\xc3\x01"
    assert decode(data) == record


def test_framing_and_fingerprint_are_byte_exact() -> None:
    ended = example_events()[-1]
    assert isinstance(ended.body, EpisodeEnded)
    data = encode(ended)
    canonical = to_parsing_canonical_form(codec.entry(RolloutEvent).expanded)
    assert canonical.startswith('{"name":"trajpipe.RolloutEvent","type":"record","fields":[')
    fingerprint = struct.pack("<Q", crc64_avro(canonical.encode()))
    body = b"".join([
        avro_string(ended.event_id), avro_string(ended.run), avro_string(ended.episode_id),
        avro_string(ended.group_id), avro_string(ended.task_id), avro_string(ended.domain),
        zigzag(ended.policy_version), avro_string(ended.producer_id), zigzag(ended.ts), zigzag(ended.seq),
        zigzag(3),  # union branch 3: EpisodeEnded
        avro_string("completed"), zigzag(1), avro_string(""),
    ])
    assert data == b"\xc3\x01" + fingerprint + body


def test_previous_envelope_version_reads_with_current_schema() -> None:
    v1 = json.loads((AVRO_DIR / "history" / "RolloutEvent.v1.avsc").read_text())
    assert "seq" not in [f["name"] for f in v1["fields"]]
    old_entry = next(e for e in codec.by_fingerprint.values() if e.name == "trajpipe.RolloutEvent" and e.version == 1)
    ev = example_events()[1]
    record = {k: v for k, v in ev.__dict__.items() if k != "seq"}
    record["body"] = ("trajpipe.PolicyTurn", {**ev.body.__dict__, "claim": None})
    buf = io.BytesIO()
    schemaless_writer(buf, parse_schema(old_entry.expanded), record)
    data = b"\xc3\x01" + struct.pack("<Q", crc64_avro(to_parsing_canonical_form(old_entry.expanded).encode()))
    back = decode(data + buf.getvalue())
    assert back.seq == 0  # the default of the field added in the current version
    assert back.body == ev.body and back.event_id == ev.event_id


@pytest.mark.parametrize(
    "mangle,reason",
    [
        (lambda d: d[:5], "truncated"),
        (lambda d: d[:-4], "truncated"),
        (lambda d: b"\x00\x01" + d[2:], "bad_magic"),
        (lambda d: d[:2] + b"\xff" * 8 + d[10:], "unknown_schema"),
        (lambda d: d + b"\x00", "schema_mismatch"),
        (lambda d: b"", "truncated"),
    ],
)
def test_bad_bytes_raise_typed_decode_error(mangle, reason: str) -> None:  # type: ignore[no-untyped-def]
    data = encode(example_events()[1])
    with pytest.raises(DecodeError) as info:
        decode(mangle(data))
    assert info.value.reason == reason
    assert info.value.detail


def test_wrong_expected_type_is_schema_mismatch() -> None:
    with pytest.raises(DecodeError) as info:
        decode(encode(sample_trajectory()), expect=RolloutEvent)
    assert info.value.reason == "schema_mismatch"


def test_random_corruption_only_ever_raises_decode_error() -> None:
    rng = random.Random(7)
    data = bytearray(encode(sample_trajectory()))
    for _ in range(2000):
        mutated = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            mutated[rng.randrange(10, len(mutated))] = rng.randrange(256)
        try:
            decode(bytes(mutated))
        except DecodeError:
            pass


def test_encode_rejects_records_that_do_not_fit() -> None:
    with pytest.raises(EncodeError):
        encode(EpisodeEnded(status="completed", num_turns=1))  # a body, not a top-level record
    bad = sample_trajectory().__class__(**{**sample_trajectory().__dict__, "prompt_tokens": "not bytes"})
    with pytest.raises(EncodeError):
        encode(bad)


def test_packing_is_little_endian_and_round_trips() -> None:
    assert pack_ids([1, 256]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"
    assert pack_floats([1.0]) == struct.pack("<f", 1.0)
    assert unpack_ids(pack_ids(range(-5, 300))) == list(range(-5, 300))
    vals = unpack_floats(pack_floats([-0.25, -math.inf]))
    assert vals[0] == -0.25 and math.isinf(vals[1])


def test_claim_check_split_and_join() -> None:
    turn = example_events()[1].body
    assert isinstance(turn, PolicyTurn)
    slim, payload = split_payload(turn, "claims/x")
    assert slim.tokens == b"" and slim.claim is not None and slim.claim.size == len(payload)
    assert join_payload(slim, payload) == turn
    with pytest.raises(IntegrityError):
        join_payload(slim, payload[:-1] + b"\x00")
