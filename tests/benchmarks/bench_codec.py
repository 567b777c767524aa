"""Codec benchmark: a PolicyTurn with 256 tokens as packed bytes vs Avro arrays vs JSON; then through the broker.

    python tests/benchmarks/bench_codec.py [--events 100000]
"""
from __future__ import annotations

import argparse
import io
import json
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fastavro import parse_schema, schemaless_reader, schemaless_writer  # noqa: E402

from schemas import avrobin  # noqa: E402
from schemas.codec import codec  # noqa: E402
from schemas.examples import example_events  # noqa: E402
from schemas.packing import pack_floats, pack_ids, unpack_floats, unpack_ids  # noqa: E402
from schemas.records import PolicyTurn, RolloutEvent  # noqa: E402
from tests.benchmarks.report import Figure, record, scratch  # noqa: E402

N_TOKENS = 256


def policy_turn_event(rng: random.Random) -> RolloutEvent:
    ids = [rng.randrange(3, 259) for _ in range(N_TOKENS)]
    lps = [-rng.random() * 3 for _ in range(N_TOKENS)]
    base = example_events()[1]
    body = PolicyTurn(turn=0, obs_text="", obs_tokens=b"", text=bytes(i - 3 for i in ids).decode("latin-1"),
                      tokens=pack_ids(ids), logprobs=pack_floats(lps), finish_reason="length")
    return RolloutEvent(**{**base.__dict__, "body": body})


def array_schema() -> Any:
    """The same envelope with token ids and log-probs as Avro arrays (the baseline)."""
    expanded = json.loads(json.dumps(codec.entry(RolloutEvent).expanded))
    for branch in expanded["fields"][-1]["type"]:
        if branch["name"] in ("PolicyTurn", "trajpipe.PolicyTurn"):
            for f in branch["fields"]:
                if f["name"] in ("tokens", "obs_tokens"):
                    f["type"] = {"type": "array", "items": "int"}
                elif f["name"] == "logprobs":
                    f["type"] = {"type": "array", "items": "float"}
    return parse_schema(expanded)


def as_arrays(ev: RolloutEvent) -> dict[str, Any]:
    body = dict(ev.body.__dict__)
    body.update(tokens=unpack_ids(body["tokens"]), obs_tokens=[], logprobs=unpack_floats(body["logprobs"]))
    return {**ev.__dict__, "body": ("trajpipe.PolicyTurn", body)}


def as_json(ev: RolloutEvent) -> bytes:
    body = dict(ev.body.__dict__)
    body.update(tokens=unpack_ids(body["tokens"]), obs_tokens=[], logprobs=unpack_floats(body["logprobs"]))
    return json.dumps({**ev.__dict__, "body": body}).encode()


def rate(fn: Callable[[], Any], n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return n / (time.perf_counter() - start)


def bench_formats(n: int) -> list[Figure]:
    ev = policy_turn_event(random.Random(0))
    schema = array_schema()

    def arr_encode() -> bytes:
        buf = io.BytesIO()
        schemaless_writer(buf, schema, as_arrays(ev))
        return buf.getvalue()

    arr_bytes = arr_encode()
    ours = codec.encode(ev)
    js = as_json(ev)
    entry = codec.current[RolloutEvent.SCHEMA]
    rows = [
        ("codec (packed bytes)", len(ours), rate(lambda: codec.encode(ev), n), rate(lambda: codec.decode(ours), n)),
        ("codec, fastavro path", len(codec.encode_with_fastavro(ev, entry)),  # what runs without the C module
         rate(lambda: codec.encode_with_fastavro(ev, entry), n),
         rate(lambda: codec.decode_with_fastavro(ours, entry, entry, RolloutEvent), n)),
        ("avro arrays", len(arr_bytes), rate(arr_encode, n),
         rate(lambda: schemaless_reader(io.BytesIO(arr_bytes), schema, return_record_name=True), n)),
        ("json", len(js), rate(lambda: as_json(ev), n), rate(lambda: json.loads(js), n)),
    ]
    print(f"PolicyTurn event with {N_TOKENS} generated tokens, {n} records each")
    print(f"{'format':<22}{'bytes/record':>14}{'encode rec/s':>16}{'decode rec/s':>16}")
    for name, size, enc, dec in rows:
        print(f"{name:<22}{size:>14}{enc:>16,.0f}{dec:>16,.0f}")
    codec_row, fastavro_row, arrays, json_row = rows
    print(f"codec vs avro arrays: encode x{codec_row[2] / arrays[2]:.1f}, decode x{codec_row[3] / arrays[3]:.1f}, "
          f"bytes x{codec_row[1] / arrays[1]:.2f} (fixed 4-byte ids vs varints)")
    print(f"codec's C reader/writer (schemas/_avrobin.c{'' if avrobin.AVAILABLE else ', NOT BUILT'}) vs its fastavro "
          f"path: encode x{codec_row[2] / fastavro_row[2]:.1f}, decode x{codec_row[3] / fastavro_row[3]:.1f}")
    return [Figure("bytes per event, packed codec", codec_row[1], "B", codec_row[1] / arrays[1], "Avro arrays"),
            Figure("encodes/s, packed codec", codec_row[2], "/s", codec_row[2] / arrays[2], "Avro arrays"),
            Figure("decodes/s, packed codec", codec_row[3], "/s", codec_row[3] / arrays[3], "Avro arrays"),
            Figure("encodes/s, codec's C writer", codec_row[2], "/s", codec_row[2] / fastavro_row[2],
                   "the codec's fastavro path"),
            Figure("decodes/s, codec's C reader", codec_row[3], "/s", codec_row[3] / fastavro_row[3],
                   "the codec's fastavro path"),
            Figure("decodes/s, JSON", json_row[3], "/s", json_row[3] / arrays[3], "Avro arrays")]


def through_broker(settings: Any, topic: str, n: int) -> tuple[float, float, int]:
    """(produced events/s with delivery confirmed, consumed+decoded events/s, bytes) for n PolicyTurn events."""
    from infra.kafka import Publisher, consumer

    rng = random.Random(1)
    events = [codec.encode(policy_turn_event(rng)) for _ in range(200)]
    pub = Publisher(settings)
    start = time.perf_counter()
    for i in range(n):
        pub.send(topic, f"ep-{i % 512}".encode(), events[i % len(events)])
    pub.close()
    produce_s = time.perf_counter() - start
    c = consumer(settings, f"{topic}-bench")
    c.subscribe([topic])
    got, nbytes = 0, 0
    start = time.perf_counter()
    while got < n:
        for msg in c.consume(1000, 1.0):
            if not msg.error():
                codec.decode(msg.value())
                got += 1
                nbytes += len(msg.value())
    consume_s = time.perf_counter() - start
    c.close()
    return n / produce_s, n / consume_s, nbytes


def bench_broker(n: int) -> list[Figure]:
    from infra.bootstrap import bootstrap
    from infra.launcher import Launcher

    launcher = Launcher()
    launcher.up()
    settings = launcher.settings()
    ns = scratch("bench-")
    bootstrap(settings, ns)
    produce, consume, nbytes = through_broker(settings, f"{ns}.rollout.events", n)
    mb = nbytes / 1e6
    print(f"\nreal broker, {n} encoded PolicyTurn events ({nbytes / n:.0f} B each), idempotent producer, acks=all")
    print(f"produce (delivery confirmed): {produce:,.0f} events/s, {mb * produce / n:.1f} MB/s")
    print(f"consume + decode:             {consume:,.0f} events/s, {mb * consume / n:.1f} MB/s")
    return [Figure("events/s produced, delivery confirmed (acks=all, idempotent)", produce, "events/s"),
            Figure("events/s consumed and decoded", consume, "events/s", consume / produce, "produce")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--events", type=int, default=100_000)
    args = parser.parse_args()
    started = time.monotonic()
    figures = bench_formats(args.records) + bench_broker(args.events)
    record("bench_codec", f"PolicyTurn with {N_TOKENS} generated tokens; {args.events:,} through one broker",
           figures, started)


if __name__ == "__main__":
    main()
