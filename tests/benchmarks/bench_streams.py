"""Streams benchmark: events/s through clean + assemble + score + group on one worker, against the ceiling.

    python tests/benchmarks/bench_streams.py [--events 200000] [--partitions 2] [--tokens 64] [--rate 4000]

1. Throughput: N events of concurrent episodes (code: 2 turns with sandbox results; math and table: 1 turn)
   are loaded into a fresh namespace, then one `python -m streams` worker drains them. Events/s is N over
   the time from its first trajectory to its last scored trajectory (broker timestamps), so start-up and
   the consumer-group join are not counted. The worker's CPU seconds give events per CPU-second too: the
   machine is shared, and CPU time is what the code costs.
2. Ceiling: a plain confluent-kafka consume + decode loop over the same topic.
3. Latency: events produced live at --rate into a second namespace; from the group's last EpisodeEnded
   (event ts, wall clock) to each scored member (broker timestamp), p50 / p99 -- and from each episode's
   own EpisodeEnded, which adds the wait for the rest of its group.
4. Where a worker's CPU goes: the same stages in this process, without a broker (an in-memory outbox), in
   CPU microseconds an event: decoding and validating alone, the events stage (clean, assemble, score,
   encode), the group stage. What the worker spends beyond them goes to consuming (aiokafka, Faust's
   consumer and acks) and producing. One core moves 20k events/s at 50 microseconds an event.
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import time
import uuid
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator, Optional

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from confluent_kafka import Consumer, TopicPartition  # noqa: E402

from infra.bootstrap import bootstrap  # noqa: E402
from infra.kafka import Publisher, consumer_config, end_offsets, read_topic  # noqa: E402
from infra.settings import Settings  # noqa: E402
from schemas.codec import codec  # noqa: E402
from schemas.packing import pack_floats, pack_ids  # noqa: E402
from schemas.records import Body, EpisodeEnded, PolicyTurn, RolloutEvent  # noqa: E402
from schemas.topics import Topics  # noqa: E402
from streams.__main__ import tune_gc  # noqa: E402
from streams.app import build_app  # noqa: E402
from streams.fastcodec import decode_event  # noqa: E402
from streams.outbox import MemoryOutbox  # noqa: E402
from streams.settings import StreamSettings  # noqa: E402
from streams.validation import DEFAULT_LIMITS, validate  # noqa: E402
from tests.streams_data import Episode, bodies  # noqa: E402
from tests.benchmarks.report import Figure, process_cpu_seconds, record, scratch  # noqa: E402

DOMAINS = ("code", "math", "table")


def episodes(n_groups: int, group_size: int, seed: int) -> Iterator[Episode]:
    rng = random.Random(seed)
    for g in range(n_groups):
        domain = DOMAINS[g % 3]
        for i in range(group_size):
            yield Episode(f"ep-{g}-{i}", f"g-{g}", domain, group_size, right=rng.random() < 0.5,
                          turns=2 if domain == "code" else 1)


def with_tokens(ep: Episode, tokens: int) -> list[Body]:
    """The episode's bodies with `tokens` generated tokens a turn."""
    out = []
    for body in bodies(ep):
        if isinstance(body, PolicyTurn):
            body = replace(body, tokens=pack_ids(range(3, 3 + tokens)), logprobs=pack_floats([-0.5] * tokens))
        out.append(body)
    return out


def interleaved(n_events: int, tokens: int, concurrent: int, seed: int, now: Optional[float] = None
                ) -> Iterator[RolloutEvent]:
    """Events of up to `concurrent` open episodes, picked at random: how many rollout workers write."""
    rng = random.Random(seed)
    source = episodes(n_events, 4, seed)
    open_: list[list[RolloutEvent]] = []
    emitted = 0
    while emitted < n_events:
        while len(open_) < concurrent:
            ep = next(source)
            ts = int((now or 1_760_000_000) * 1000)
            open_.append([RolloutEvent(event_id=f"{ep.episode_id}-{i}", run="bench", episode_id=ep.episode_id,
                                       group_id=ep.group_id, task_id=f"{ep.domain}/{ep.group_id}", domain=ep.domain,
                                       policy_version=0, producer_id="bench", ts=ts + i, seq=i, body=b)
                          for i, b in enumerate(with_tokens(ep, tokens))])
        i = rng.randrange(len(open_))
        event = open_[i].pop(0)
        if not open_[i]:
            open_.pop(i)
        if now is not None:  # live: the event happens now
            event = replace(event, ts=int(time.time() * 1000))
        yield event
        emitted += 1


def start_worker(settings: Settings, ns: str, log: Path) -> subprocess.Popen:  # type: ignore[type-arg]
    env = {**os.environ, **settings.as_env()}
    return subprocess.Popen([sys.executable, "-m", "streams", "--ns", ns, "--log-level", "warn"], cwd=ROOT,
                            env=env, stderr=log.open("w"))


def count(settings: Settings, topic: str) -> int:
    return sum(hi - lo for lo, hi in end_offsets(settings, topic).values())


def wait_for(settings: Settings, topic: str, n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while count(settings, topic) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{topic}: {count(settings, topic)} of {n} records after {timeout}s")
        time.sleep(0.5)


def expected_scored(events: list[RolloutEvent]) -> int:
    return sum(isinstance(e.body, EpisodeEnded) for e in events)


def throughput(settings: Settings, args: argparse.Namespace, workers: int = 1,
               settle_s: float = 0.0) -> dict[str, float]:
    """Events/s through `workers` stream workers. With `settle_s`, the workers start first and have that
    long to share the partitions before the events are loaded (a scaling figure without the rebalance);
    without it, the events are loaded first and one worker starts on them."""
    ns = scratch("bench")
    bootstrap(settings, ns, args.partitions)
    topics = Topics(ns, args.partitions)
    events = list(interleaved(args.events, args.tokens, args.concurrent, seed=1))
    started: list[subprocess.Popen] = []  # type: ignore[type-arg]

    def start() -> None:
        started.extend(start_worker(settings, ns, Path(args.log_dir) / f"{ns}-{w}.log") for w in range(workers))
        time.sleep(settle_s)

    if settle_s:
        start()
    publisher = Publisher(settings)
    for event in events:
        publisher.send(topics.events, event.episode_id.encode(), codec.encode(event))
    publisher.close()
    trajectories = expected_scored(events)
    if not settle_s:
        start()
    try:
        wait_for(settings, topics.trajectories, 1, args.timeout)
        cpu_started = sum(process_cpu_seconds(worker.pid) for worker in started)  # start-up and a first batch
        wait_for(settings, topics.trajectories, trajectories, args.timeout)
        time.sleep(2 * args.partitions)  # the last groups
        cpu = sum(process_cpu_seconds(worker.pid) for worker in started)
    finally:
        for worker in started:
            worker.send_signal(signal.SIGTERM)
        for worker in started:
            try:
                worker.wait(60)
            except subprocess.TimeoutExpired:
                worker.kill()
    first = min(m.timestamp()[1] for m in read_topic(settings, topics.trajectories))
    scored = [m.timestamp()[1] for m in read_topic(settings, topics.scored)]
    seconds = (max(scored) - first) / 1000
    return {"events": len(events), "trajectories": trajectories, "scored": len(scored), "seconds": seconds,
            "events_per_s": len(events) / seconds, "cpu_s": cpu, "events_per_cpu_s": len(events) / cpu,
            # CPU from its first trajectory on, over every event: no start-up, a little of the work left out
            "us_per_event": 1e6 * (cpu - cpu_started) / len(events), "ns": ns}  # type: ignore[dict-item]


def ceiling(settings: Settings, topic: str, n: int) -> float:
    c = Consumer(consumer_config(settings, f"ceiling-{uuid.uuid4().hex[:6]}"))
    c.assign([TopicPartition(topic, p, 0) for p in end_offsets(settings, topic)])
    done, started = 0, time.perf_counter()
    while done < n:
        for msg in c.consume(10_000, 1.0):
            if not msg.error():
                codec.decode(msg.value())
                done += 1
    c.close()
    return n / (time.perf_counter() - started)


@dataclass
class InMemory:
    """A Kafka message as the stages read it."""

    topic: str
    partition: int
    offset: int
    key: Optional[bytes]
    value: Optional[bytes]
    timestamp: int = 1_700_000_000_000  # ms


def as_messages(topic: str, records: list[tuple[bytes, bytes]], partitions: int) -> list[InMemory]:
    """The records as a topic of `partitions` partitions holds them (partition by the key's crc32)."""
    offsets = [0] * partitions
    out = []
    for key, value in records:
        p = zlib.crc32(key) % partitions
        out.append(InMemory(topic, p, offsets[p], key, value))
        offsets[p] += 1
    return out


def stage_costs(args: argparse.Namespace) -> dict[str, float]:
    """CPU microseconds an event for decoding and validating alone, and for each stage of the pipeline as the
    worker runs it (its batch size, its collector settings), over the same events without a broker."""
    import asyncio

    streams = StreamSettings(ns="stagecost", partitions=args.partitions)
    outbox = MemoryOutbox()
    pipeline = build_app(streams, outbox=outbox).pipeline  # type: ignore[attr-defined]
    topics = Topics("stagecost", args.partitions)
    events = as_messages(topics.events, [(e.episode_id.encode(), codec.encode(e)) for e in
                                         interleaved(args.stage_events, args.tokens, args.concurrent, seed=3)],
                         args.partitions)
    tune_gc()
    started = time.process_time()
    for m in events:
        validate(decode_event(m.value or b""), DEFAULT_LIMITS)
    decoding = time.process_time() - started

    async def stages() -> tuple[float, float]:
        size = streams.batch_max
        started = time.process_time()
        for i in range(0, len(events), size):
            await pipeline.on_events(events[i:i + size])
        trajectories = as_messages(topics.trajectories, [(s.key or b"", s.value or b"")
                                                         for s in outbox.to(topics.trajectories)], args.partitions)
        middle = time.process_time()
        for i in range(0, len(trajectories), size):
            await pipeline.on_trajectories(trajectories[i:i + size])
        return middle - started, time.process_time() - middle

    assemble, group = asyncio.run(stages())
    n = len(events)
    return {"events": n, "trajectories": len(outbox.to(topics.trajectories)),
            "scored": len(outbox.to(topics.scored)), "decode_us": 1e6 * decoding / n,
            "events_stage_us": 1e6 * assemble / n, "group_stage_us": 1e6 * group / n}


def latency(settings: Settings, args: argparse.Namespace) -> dict[str, float]:
    ns = scratch("benchlat", 6)
    bootstrap(settings, ns, args.partitions)
    topics = Topics(ns, args.partitions)
    worker = start_worker(settings, ns, Path(args.log_dir) / f"{ns}.log")
    try:
        return _live(settings, topics, worker, args)
    finally:
        if worker.poll() is None:
            worker.kill()


def _live(settings: Settings, topics: Topics, worker: subprocess.Popen, args: argparse.Namespace  # type: ignore[type-arg]
          ) -> dict[str, float]:
    time.sleep(args.warmup)
    publisher = Publisher(settings, **{"linger.ms": 1})
    n = int(args.rate * args.live_seconds)
    started = time.monotonic()
    for i, event in enumerate(interleaved(n, args.tokens, args.concurrent, seed=2, now=time.time())):
        publisher.send(topics.events, event.episode_id.encode(), codec.encode(event))
        ahead = i / args.rate - (time.monotonic() - started)
        if ahead > 0.005:
            time.sleep(ahead)
    publisher.close()
    time.sleep(5)
    worker.send_signal(signal.SIGTERM)
    worker.wait(60)
    scored = [(m.timestamp()[1], codec.decode(m.value())) for m in read_topic(settings, topics.scored)]
    if not scored:
        raise RuntimeError(f"no scored trajectories in {topics.scored}; see {args.log_dir}/{topics.ns}.log")
    last_end: dict[str, int] = {}
    for _, t in scored:
        last_end[t.group_id] = max(last_end.get(t.group_id, 0), t.ended_ts)
    own = sorted(at - t.ended_ts for at, t in scored)
    group = sorted(at - last_end[t.group_id] for at, t in scored)
    return {"n": len(own), "rate": args.rate, "p50_ms": own[len(own) // 2], "p99_ms": own[int(len(own) * 0.99)],
            "group_p50_ms": group[len(group) // 2], "group_p99_ms": group[int(len(group) * 0.99)]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--events", type=int, default=200_000)
    p.add_argument("--partitions", type=int, default=2)
    p.add_argument("--tokens", type=int, default=64, help="generated tokens per turn")
    p.add_argument("--concurrent", type=int, default=512, help="episodes open at once")
    p.add_argument("--rate", type=float, default=4000, help="events/s for the latency run")
    p.add_argument("--live-seconds", type=float, default=20)
    p.add_argument("--warmup", type=float, default=10, help="seconds for the worker to join before the live run")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--log-dir", default="/tmp")
    p.add_argument("--skip-latency", action="store_true")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--stage-events", type=int, default=60_000, help="events for the in-memory stage costs")
    args = p.parse_args()
    started = time.monotonic()
    figures: list[Figure] = []
    settings = Settings.from_env()
    if not args.skip_throughput:
        run = throughput(settings, args)
        print(f"worker : {run['events']} events -> {run['scored']} scored in {run['seconds']:.1f}s = "
              f"{run['events_per_s']:,.0f} events/s ({run['events_per_cpu_s']:,.0f} per CPU-second, "
              f"{run['cpu_s']:.1f} CPU-s incl. start-up)", flush=True)
        top = ceiling(settings, Topics(str(run["ns"])).events, int(run["events"]))
        print(f"ceiling: confluent-kafka consume + decode {top:,.0f} events/s; worker/ceiling = "
              f"{run['events_per_s'] / top:.2f}", flush=True)
        figures += [Figure("one worker: clean + assemble + score + group", run["events_per_s"], "events/s",
                           run["events_per_s"] / top, "consume + decode loop", "≥ 20k/s and ≥ 0.5",
                           run["events_per_s"] >= 20_000 and run["events_per_s"] / top >= 0.5),
                    Figure("one worker, per CPU-second", run["events_per_cpu_s"], "events/CPU-s"),
                    Figure("plain confluent-kafka consume + decode", top, "events/s")]
        stages = stage_costs(args)
        worker_us = run["us_per_event"]
        rest = worker_us - stages["events_stage_us"] - stages["group_stage_us"]
        print(f"stages : in memory, {stages['events']} events -> {stages['scored']} scored: events stage "
              f"{stages['events_stage_us']:.1f} CPU-us/event (of which decode + validate "
              f"{stages['decode_us']:.1f}), group stage {stages['group_stage_us']:.1f}; the worker's "
              f"{worker_us:.1f} CPU-us/event from its first trajectory on leave {rest:.1f} for consuming, Faust and producing "
              f"(20k events/s on one core: 50)", flush=True)
        figures += [Figure("in memory: events stage (clean, assemble, score, encode)", stages["events_stage_us"],
                           "CPU-µs/event"),
                    Figure("in memory: decode + validate alone", stages["decode_us"], "CPU-µs/event",
                           stages["decode_us"] / stages["events_stage_us"], "events stage"),
                    Figure("in memory: group stage", stages["group_stage_us"], "CPU-µs/event"),
                    Figure("worker from its first trajectory on (no start-up)", worker_us, "CPU-µs/event"),
                    Figure("worker beyond the stages: consuming (aiokafka, Faust), producing", rest, "CPU-µs/event",
                           rest / worker_us, "the worker's")]
    if not args.skip_latency:
        lat = latency(settings, args)
        print(f"latency at {lat['rate']:.0f} events/s ({lat['n']} scored trajectories): "
              f"last EpisodeEnded of the group -> scored p50 {lat['group_p50_ms']:.0f} ms, "
              f"p99 {lat['group_p99_ms']:.0f} ms; own EpisodeEnded -> scored (includes waiting for the rest "
              f"of the group) p50 {lat['p50_ms']:.0f} ms, p99 {lat['p99_ms']:.0f} ms")
        figures += [Figure(f"group complete -> scored at {lat['rate']:,.0f} events/s, p50", lat["group_p50_ms"], "ms"),
                    Figure("group complete -> scored, p99", lat["group_p99_ms"], "ms")]
    record("bench_streams", f"{args.events:,} rollout events of the realistic mix (code, math, table), "
           f"{args.partitions} partitions, {args.tokens} tokens per turn", figures, started)


if __name__ == "__main__":
    main()
