"""The shard writer: scored trajectories -> verified Avro shards in the object store -> BatchManifests.

    python -m consumers.shard_writer --ns demo --max-trajectories 64 --max-age-s 5

Per partition of `<ns>.trajectories.scored`: batch, write the shard under a key derived from its offset
range, read it back and compare, publish its manifest to `<ns>.trajectory.batches`, then commit. A restart
re-reads from the last commit and cuts the same batches again (shards already stored fix the cut), keeps
or rewrites the shard under the same key and republishes an identical manifest; the learner dedupes by
batch_id. Shard bytes are deterministic, so a rewrite is byte-identical.
"""
from __future__ import annotations

import argparse
import hashlib
import logging
import math
import signal
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from types import FrameType
from typing import Callable, Optional, Sequence, TypeVar

from confluent_kafka import KafkaException, Message, TopicPartition

from consumers.batching import BatchBounds, Batcher, OpenBatch
from consumers.shards import CODECS, read_shard, shard_range, write_shard
from infra.kafka import Publisher, consumer, read_past, watermarks
from infra.metrics import Metrics, process_id, publish
from infra.objectstore import ObjectStore
from infra.settings import Settings, add_ns_argument
from schemas.codec import codec
from schemas.errors import ConfigError, DecodeError, IntegrityError, ObjectNotFound, ObjectStoreError
from schemas.keys import batch_id, shard_key
from schemas.records import BatchManifest, DeadLetter, Trajectory
from schemas.topics import Topics

log = logging.getLogger("consumers.shard_writer")
STAGE = "shard_writer"
TOKEN_BYTES = 4  # packed int32 token ids
T = TypeVar("T")


@dataclass(frozen=True)
class WriterSettings:
    ns: str
    group: str = ""  # default "<ns>.shard-writer"
    bounds: BatchBounds = field(default_factory=BatchBounds)
    compression: str = "deflate"
    # One attempt window of the store; the writer then tries again (and again) until it succeeds.
    store_retry_for_s: float = 10.0
    poll_timeout_s: float = 0.2
    progress_every_s: float = 5.0
    exit_when_idle_s: float = 0.0  # 0: run until SIGTERM

    def __post_init__(self) -> None:
        Topics(self.ns)  # validates the namespace
        if self.compression not in CODECS:
            raise ConfigError(f"compression {self.compression!r}: use one of {', '.join(CODECS)}")
        if not self.store_retry_for_s > 0 or not self.poll_timeout_s > 0:
            raise ConfigError("store_retry_for_s and poll_timeout_s must be > 0")
        if self.exit_when_idle_s < 0 or self.progress_every_s < 0:
            raise ConfigError("exit_when_idle_s and progress_every_s must be >= 0")

    @property
    def consumer_group(self) -> str:
        return self.group or f"{self.ns}.shard-writer"


def num_tokens(t: Trajectory) -> int:
    """Prompt, observation and generated tokens: what one forward pass over the trajectory sees."""
    packed = len(t.prompt_tokens) + sum(len(turn.obs_tokens) + len(turn.tokens) for turn in t.turns)
    return packed // TOKEN_BYTES


def _mean_std(values: list[float]) -> tuple[float, float]:
    mean = math.fsum(values) / len(values)
    return mean, math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))


def build_manifest(trajectories: Sequence[Trajectory], *, key: str, sha256: str, size: int, bucket: str,
                   topic: str, partition: int, first: int, last: int) -> BatchManifest:
    """Everything derived from the shard's content, so a rewrite republishes the identical manifest."""
    versions = [turn.policy_version for t in trajectories for turn in t.turns] or [0]
    reward_mean, reward_std = _mean_std([t.reward for t in trajectories])
    runs = sorted({t.run for t in trajectories})
    return BatchManifest(
        batch_id=batch_id(topic, partition, first, last), run=",".join(runs), bucket=bucket, key=key,
        sha256=sha256, size=size, num_trajectories=len(trajectories),
        num_tokens=sum(num_tokens(t) for t in trajectories), source_topic=topic, partition=partition,
        first_offset=first, last_offset=last, policy_version_min=min(versions), policy_version_max=max(versions),
        reward_mean=reward_mean, reward_std=reward_std,
        trajectory_ids=tuple(t.trajectory_id for t in trajectories), ts=max(t.ended_ts for t in trajectories),
    )


def dead_letter(msg: Message, exc: DecodeError) -> DeadLetter:
    ts_type, ts = msg.timestamp()
    return DeadLetter(reason=exc.reason, detail=str(exc)[:2000], stage=STAGE, source_topic=msg.topic() or "",
                      partition=msg.partition() or 0, offset=msg.offset() or 0, key=msg.key(),
                      original=msg.value() or b"", ts=max(ts, 0))


@dataclass
class Progress:
    batches: int = 0
    trajectories: int = 0
    bytes: int = 0
    consumed: int = 0
    deadletters: int = 0
    replayed: int = 0  # batches cut by shards already stored (a restart's replay)
    duplicates: int = 0  # trajectories already in a published batch (re-emitted upstream)

    def line(self, ns: str, pending: int) -> str:
        return (f"shard_writer {ns}: batches={self.batches} trajectories={self.trajectories} "
                f"mb={self.bytes / 1e6:.2f} consumed={self.consumed} open={pending} "
                f"deadletters={self.deadletters} replayed={self.replayed} duplicates={self.duplicates}")


class WrittenIds:
    """Trajectory ids already in a published batch (bounded), from the manifests on the batches topic: read at start,
    and again from where it was left each time this writer takes over partitions (another writer may have
    published their batches since; a copy of one of those trajectories the streams stage sends again must be
    dropped here, not trained twice)."""

    def __init__(self, limit: int = 1_000_000) -> None:
        self.limit = limit
        self.ids: OrderedDict[str, None] = OrderedDict()
        self.read_to: dict[int, int] = {}  # batches partition -> the next offset to read

    def refresh(self, settings: Settings, topics: Topics, timeout_s: float = 60.0) -> int:
        """Read the manifests published since the last read; returns how many."""
        c = consumer(settings, f"{topics.batches}-written", **{"enable.partition.eof": True})
        try:
            n = 0
            for msg in read_past(c, topics.batches, watermarks(c, topics.batches, timeout_s), self.read_to, timeout_s):
                n += 1
                try:
                    self.add(codec.decode(msg.value() or b"", expect=BatchManifest).trajectory_ids)
                except DecodeError:
                    continue
            return n
        finally:
            c.close()

    def add(self, ids: Sequence[str]) -> None:
        for tid in ids:
            self.ids[tid] = None
        while len(self.ids) > self.limit:
            self.ids.popitem(last=False)

    def __contains__(self, tid: str) -> bool:
        return tid in self.ids


class ShardWriter:
    """Consumes `<ns>.trajectories.scored` in its own group and turns it into shards and manifests."""

    def __init__(self, settings: Settings, config: WriterSettings, store: Optional[ObjectStore] = None) -> None:
        self.config, self.settings = config, settings
        self.topics = Topics(config.ns)
        self.store = store or ObjectStore(settings, retry_for_s=config.store_retry_for_s)
        self.publisher = Publisher(settings)
        # Generous poll interval: a store outage blocks the loop; if the group still drops us, the next
        # owner rewrites the same shards, so nothing is lost or doubled. A short session lets a restart
        # after kill -9 take over the partitions in seconds instead of the default 45.
        self.consumer = consumer(settings, config.consumer_group,
                                 **{"max.poll.interval.ms": 1_800_000, "session.timeout.ms": 10_000})
        self.batcher = Batcher(config.bounds)
        self.progress = Progress()
        self._needs_plan: set[int] = set()
        self._stopping = False
        self._abandoned = False  # a batch was given up at stop: nothing after it may be committed
        self._last_line = ""
        self._last_report = 0.0
        self._last_message: Optional[float] = None  # None until partitions are assigned
        self.written = WrittenIds()
        self._refresh_written()  # every batch published so far (the broker may be restarting: it waits)
        # windows labelled with the writer (host-pid): several writers' figures add up, none overwrites another's
        self.metrics, self._window_start = Metrics("shards", labels={"writer": process_id()}), int(time.time() * 1000)
        self._published: dict[str, int] = {}  # progress counters already published

    # ---- lifecycle ------------------------------------------------------------------------------
    def stop(self, *_: object) -> None:
        self._stopping = True

    def run(self) -> int:
        self.consumer.subscribe([self.topics.scored], on_assign=self._on_assign, on_revoke=self._on_revoke,
                                on_lost=self._on_revoke)
        try:
            while not self._stopping and not self._idle_done():
                self._step()
            self._finish()
        finally:
            self._report(force=True)
            self.consumer.close()
            self.publisher.flush()
        return 0

    def _step(self) -> None:
        for msg in self.consumer.consume(500, self.config.poll_timeout_s):
            self._handle(msg)
        for batch in self.batcher.due(time.monotonic()):
            if not self._write(batch):
                return
        self._report()

    def _finish(self) -> None:
        """On stop: write what is open; a batch that must match an existing shard is left uncommitted."""
        writable, unfinished = self.batcher.drain()
        for batch in writable:
            if not self._write(batch):
                break
        if unfinished:
            log.info("leaving %d unfinished planned batch(es) uncommitted", len(unfinished))

    def _idle_done(self) -> bool:
        idle, since = self.config.exit_when_idle_s, self._last_message
        return idle > 0 and since is not None and time.monotonic() - since >= idle

    # ---- partitions -----------------------------------------------------------------------------
    def _on_assign(self, _consumer: object, parts: list[TopicPartition]) -> None:
        # The plan is read lazily, outside the callback, so a store outage does not stall the rebalance.
        self._needs_plan.update(tp.partition for tp in parts)
        self._last_message = time.monotonic()  # idleness counts from the assignment, not the join

    def _on_revoke(self, _consumer: object, parts: list[TopicPartition]) -> None:
        partitions = [tp.partition for tp in parts]
        self._needs_plan.difference_update(partitions)
        dropped = self.batcher.revoke(partitions)
        if dropped:
            log.info("partitions %s revoked: dropped %d open batch(es) uncommitted", partitions, len(dropped))

    def _load_plan(self, partition: int, offset: int) -> None:
        """Shards already stored from `offset` on: a crash between write and commit left them there; and the
        batches other writers published before this one took the partition over."""
        self._refresh_written()
        prefix = shard_key(self.config.ns, self.topics.scored, partition, 0, 0).rsplit("/", 1)[0] + "/"
        keys = self._with_store(f"list {prefix}", lambda: self.store.list(prefix))
        ranges = [shard_range(k) for k in keys or []]
        plan = {first: last for first, last in ranges if first >= offset}
        self.batcher.set_plan(partition, plan)
        self._needs_plan.discard(partition)
        if plan:
            log.info("partition %d: %d shard(s) from offset %d already stored; cutting the same batches",
                     partition, len(plan), offset)

    # ---- records --------------------------------------------------------------------------------
    def _handle(self, msg: Message) -> None:
        if self._stopping:
            return  # left uncommitted: the open batches end before it
        err = msg.error()
        if err is not None:
            if err.fatal():
                raise KafkaException(err)
            log.warning("consumer error: %s", err)
            return
        self._last_message = time.monotonic()
        self.progress.consumed += 1
        partition, offset = msg.partition() or 0, msg.offset() or 0
        if partition in self._needs_plan:
            self._load_plan(partition, offset)
        value = msg.value() or b""
        try:
            trajectory = codec.decode(value, expect=Trajectory)
        except DecodeError as exc:
            self._dead_letter(msg, exc)
            return
        seen = trajectory.trajectory_id in self.written or self.batcher.holds(partition, trajectory.trajectory_id)
        if seen and not self.batcher.planned(partition, offset):
            self._duplicate(partition, offset)
            return
        for batch in self.batcher.add(partition, offset, trajectory, len(value), time.monotonic()):
            if not self._write(batch):
                return

    def _duplicate(self, partition: int, offset: int) -> None:
        """A trajectory re-emitted upstream (at-least-once) is already in a batch, written or open: counted,
        never written twice."""
        self.progress.duplicates += 1
        commit_to = self.batcher.skip(partition, offset)
        if commit_to is not None:
            self._commit(partition, commit_to)

    def _dead_letter(self, msg: Message, exc: DecodeError) -> None:
        log.warning("dead-lettering %s[%s]@%s: %s", msg.topic(), msg.partition(), msg.offset(), exc)
        self.publisher.send(self.topics.deadletter, msg.key(), codec.encode(dead_letter(msg, exc)))
        self.publisher.flush()  # delivered before its offset can be committed
        self.progress.deadletters += 1
        commit_to = self.batcher.skip(msg.partition() or 0, msg.offset() or 0)
        if commit_to is not None:
            self._commit(msg.partition() or 0, commit_to)

    # ---- one batch: write, verify, publish, commit ------------------------------------------------
    def _write(self, batch: OpenBatch) -> bool:
        """True when the batch is stored, announced and committed; False when stopped during an outage."""
        if self._abandoned:
            return False
        topic, p = self.topics.scored, batch.partition
        key = shard_key(self.config.ns, topic, p, batch.first, batch.last)
        started = time.monotonic()
        stored = self._store(batch, key)
        if stored is None:
            return False
        sha256, size = stored
        manifest = build_manifest(batch.trajectories, key=key, sha256=sha256, size=size,
                                  bucket=self.store.bucket, topic=topic, partition=p,
                                  first=batch.first, last=batch.last)
        # Keyed by source partition: its manifests stay in offset order on any batches partition.
        self.publisher.send(self.topics.batches, f"{topic}:{p}".encode(), codec.encode(manifest))
        self.publisher.flush()
        self.written.add(manifest.trajectory_ids)
        self._commit(p, batch.end + 1)
        self._count(batch, size, time.monotonic() - started)
        return True

    def _store(self, batch: OpenBatch, key: str) -> Optional[tuple[str, int]]:
        """(sha256, size) of the verified shard under `key`; None when stopped during an outage."""
        if batch.planned_last is not None:
            # Keep a stored copy with the same trajectories even if its bytes differ (another codec or
            # library version): a manifest already published for it must keep matching its sha256.
            kept = self._with_store(f"get {key}", lambda: self._stored_copy(key, batch.trajectories))
            if kept is not None or self._abandoned:
                return kept
        data = write_shard(batch.trajectories, key, self.config.compression)
        sha256 = self._with_store(f"put {key}", lambda: self.store.put_verified(key, data))
        return None if sha256 is None else (sha256, len(data))

    def _stored_copy(self, key: str, trajectories: list[Trajectory]) -> Optional[tuple[str, int]]:
        try:
            data = self.store.get(key)
            same = read_shard(data) == trajectories
        except (ObjectNotFound, DecodeError):
            return None
        return (hashlib.sha256(data).hexdigest(), len(data)) if same else None

    def _refresh_written(self) -> None:
        """The batches published since the last read (by any writer), until the broker answers or the writer
        stops."""
        while True:
            try:
                self.written.refresh(self.settings, self.topics)
                return
            except (KafkaException, TimeoutError) as exc:
                if self._stopping:
                    return  # nothing more is written
                log.warning("reading the batches topic: %s; still trying", exc)
                time.sleep(1.0)

    def _with_store(self, what: str, call: Callable[[], T]) -> Optional[T]:
        """`call()` until it succeeds; None if the writer is stopped while the store is unreachable."""
        while True:
            try:
                return call()
            except ObjectNotFound:
                raise  # a missing bucket is a setup error, not an outage
            except (ObjectStoreError, IntegrityError) as exc:
                if self._stopping:
                    log.warning("%s abandoned at stop (%s); its offsets stay uncommitted", what, exc)
                    self._abandoned = True
                    return None
                log.warning("%s: %s; still trying", what, exc)

    def _commit(self, partition: int, offset: int) -> None:
        try:
            self.consumer.commit(offsets=[TopicPartition(self.topics.scored, partition, offset)], asynchronous=False)
        except KafkaException as exc:
            # Lost the partition meanwhile: its next owner rewrites the same shard, which is harmless.
            log.warning("commit %s[%d]@%d failed: %s", self.topics.scored, partition, offset, exc)

    def _count(self, batch: OpenBatch, size: int, write_s: float) -> None:
        self.progress.batches += 1
        self.progress.trajectories += len(batch.trajectories)
        self.progress.bytes += size
        self.progress.replayed += batch.planned_last is not None
        m = self.metrics
        m.count("shards/batches")
        m.count("shards/trajectories", len(batch.trajectories))
        m.count("shards/bytes", size)
        m.count("shards/replayed", int(batch.planned_last is not None))
        m.observe("shards/write_s", write_s)

    def _publish_metrics(self) -> None:
        """The window's figures on <ns>.pipeline.metrics (source "shards"), with the manifests' next flush."""
        m = self.metrics
        for name in ("duplicates", "deadletters"):
            m.count(f"shards/{name}", getattr(self.progress, name) - self._published.get(name, 0))
            self._published[name] = getattr(self.progress, name)
        m.gauge("shards/open_trajectories", float(self.batcher.pending))
        now = int(time.time() * 1000)
        publish(self.publisher, self.topics.metrics, m.flush(self._window_start, now))
        self._window_start = now

    def _report(self, force: bool = False) -> None:
        now, line = time.monotonic(), self.progress.line(self.config.ns, self.batcher.pending)
        if force or (line != self._last_line and now - self._last_report >= self.config.progress_every_s):
            self._last_report, self._last_line = now, line
            print(line, file=sys.stderr, flush=True)
            self._publish_metrics()


# ---- command line -------------------------------------------------------------------------------
def parse_args(argv: Optional[Sequence[str]] = None) -> WriterSettings:
    ap = argparse.ArgumentParser(prog="python -m consumers.shard_writer", description=__doc__.splitlines()[0])
    add_ns_argument(ap)
    ap.add_argument("--group", default="", help="consumer group (default <ns>.shard-writer)")
    ap.add_argument("--max-trajectories", type=int, default=256, help="trajectories per shard at most")
    ap.add_argument("--max-bytes", type=int, default=16 * 1024 * 1024, help="encoded bytes per shard at most")
    ap.add_argument("--max-age-s", type=float, default=5.0, help="seconds a batch may stay open")
    ap.add_argument("--codec", choices=CODECS, default="deflate")
    ap.add_argument("--store-retry-s", type=float, default=10.0, help="seconds per store attempt window")
    ap.add_argument("--progress-every-s", type=float, default=5.0)
    ap.add_argument("--exit-when-idle-s", type=float, default=0.0, help="exit after this long without input")
    a = ap.parse_args(argv)
    return WriterSettings(
        ns=a.ns, group=a.group, compression=a.codec, store_retry_for_s=a.store_retry_s,
        bounds=BatchBounds(max_trajectories=a.max_trajectories, max_bytes=a.max_bytes, max_age_s=a.max_age_s),
        progress_every_s=a.progress_every_s, exit_when_idle_s=a.exit_when_idle_s,
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = parse_args(argv)
        writer = ShardWriter(Settings.from_env(), config)
    except ConfigError as exc:
        print(f"shard_writer: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _stopper(writer))
    signal.signal(signal.SIGINT, _stopper(writer))
    return writer.run()


def _stopper(writer: ShardWriter) -> Callable[[int, Optional[FrameType]], None]:
    def handler(signum: int, _frame: Optional[FrameType]) -> None:
        log.info("signal %d: finishing the open batches, then exiting", signum)
        writer.stop()
    return handler


if __name__ == "__main__":
    sys.exit(main())
