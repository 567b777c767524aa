"""The learner's batch reader: BatchManifests -> shards from the object store through a disk cache, prefetched.

    reader = BatchReader(settings, ns, group="demo.learner", cache=ShardCache(dir, 2 << 30))
    reader.seek(checkpoint.offsets); reader.mark_seen(checkpoint.batch_ids)    # resume
    while training:
        batch = reader.next_batch(timeout=1.0)          # None when no data came in time
        if batch is not None:
            update(batch.trajectories)                  # staleness is the learner's call
        if checkpoint_due:
            offsets = reader.positions()                # store them in the checkpoint, then
            reader.commit(offsets)                      # commit only after the checkpoint is stored
    reader.close()

A manifest republished after a shard-writer restart carries the same batch_id and is skipped; so is one
whose source range ends at or before what was already handed out for its source partition.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Iterable, Optional, Union

from confluent_kafka import KafkaException, Message, TopicPartition

from consumers.shard_cache import ShardCache
from consumers.shards import read_shard
from infra.kafka import commit_offsets, consumer, while_broker_away
from infra.objectstore import ObjectStore
from infra.settings import Settings
from schemas.codec import codec
from schemas.errors import ConfigError, DecodeError, IntegrityError, ObjectNotFound, ObjectStoreError
from schemas.records import BatchManifest, Trajectory
from schemas.topics import Topics

__all__ = ["BatchReader", "LoadedBatch", "ShardCache", "parse_batch_id", "policy_versions"]

log = logging.getLogger(__name__)
TOPIC_SETTLE_S = 15.0  # as infra.bootstrap.partition_count: a fresh broker's metadata may lag its topics
Source = tuple[str, int]  # (source topic, source partition)


def policy_versions(trajectory: Trajectory) -> tuple[int, ...]:
    """The policy version that generated each turn, in turn order."""
    return tuple(turn.policy_version for turn in trajectory.turns)


def parse_batch_id(batch_id: str) -> tuple[Source, int, int]:
    """((topic, partition), first, last) from an id made by schemas.keys.batch_id."""
    try:
        topic, partition, span = batch_id.rsplit(":", 2)
        first, last = span.split("-")
        return (topic, int(partition)), int(first), int(last)
    except ValueError as exc:
        raise ConfigError(f"{batch_id!r} is not a batch id (topic:partition:first-last)") from exc


@dataclass(frozen=True)
class LoadedBatch:
    manifest: BatchManifest
    trajectories: tuple[Trajectory, ...]
    offset: int  # of the manifest on the batches topic
    partition: int = 0
    # Not fetched: even its newest turn is more than max_policy_lag versions old (see set_policy_version).
    stale: bool = False
    # Why it has no trajectories though it should (its shard is missing, corrupt or undecodable): the learner
    # skips it with this reason, which its next checkpoint's manifest records.
    problem: str = ""
    wait_s: float = 0.0  # how long next_batch waited for it

    @property
    def policy_versions(self) -> list[tuple[int, ...]]:
        return [policy_versions(t) for t in self.trajectories]


@dataclass(frozen=True)
class _Skip:
    """A manifest position that yields no batch (a duplicate or an undecodable record)."""

    partition: int
    offset: int


class _Seen:
    """Batch ids handed out or marked, bounded; plus the highest source offset per source partition."""

    def __init__(self, max_ids: int) -> None:
        self.max_ids = max_ids
        self.ids: OrderedDict[str, None] = OrderedDict()
        self.high: dict[Source, int] = {}

    def add(self, batch_id: str) -> None:
        source, _first, last = parse_batch_id(batch_id)
        self.ids[batch_id] = None
        self.ids.move_to_end(batch_id)
        while len(self.ids) > self.max_ids:
            self.ids.popitem(last=False)
        self.high[source] = max(last, self.high.get(source, -1))

    def covers(self, m: BatchManifest) -> bool:
        # Offset ranges of one source partition never overlap, so a range ending at or before the highest
        # one handed out was handed out already, even after its id left the bounded set.
        return m.batch_id in self.ids or m.last_offset <= self.high.get((m.source_topic, m.partition), -1)


class BatchReader:
    """Manifests of `<ns>.trajectory.batches` in log order, each with its trajectories, never one twice."""

    def __init__(self, settings: Settings, ns: str, group: str, cache: ShardCache, prefetch: int = 2,
                 max_policy_lag: Optional[int] = None, store: Optional[ObjectStore] = None,
                 store_retry_for_s: float = 10.0, poll_timeout_s: float = 0.2, max_seen: int = 100_000) -> None:
        if prefetch < 1:
            raise ConfigError(f"prefetch must be >= 1, got {prefetch}")
        if max_policy_lag is not None and max_policy_lag < 0:
            raise ConfigError(f"max_policy_lag must be >= 0 or None, got {max_policy_lag}")
        self.topic = Topics(ns).batches
        self.cache = cache
        self.prefetch = prefetch
        self.max_policy_lag = max_policy_lag
        self.poll_timeout_s = poll_timeout_s
        self.store = store or ObjectStore(settings, retry_for_s=store_retry_for_s)
        self._consumer = consumer(settings, group)
        # A synchronous commit on the consumer that the prefetcher polls never returns (the poll takes
        # its result), so commits go through a second client of the same group; neither joins the group.
        self._committer = consumer(settings, group)
        self._lock = threading.Lock()
        self._seen = _Seen(max_seen)
        self._inflight: set[str] = set()
        self._policy_version: Optional[int] = None
        self._counts = {"time/wait_data_s": 0.0, "reader/batches": 0.0, "reader/trajectories": 0.0,
                        "reader/duplicates": 0.0, "reader/bad_manifests": 0.0, "reader/stale_batches": 0.0,
                        "reader/store_waits": 0.0, "reader/missing_shards": 0.0, "reader/corrupt_shards": 0.0,
                        "reader/undecodable_shards": 0.0}
        self._positions = self._committed_positions()
        self._reset_pipeline()
        self._consumer.assign([TopicPartition(self.topic, p, o) for p, o in self._positions.items()])

    # ---- the learner's side ---------------------------------------------------------------------
    def next_batch(self, timeout: float = 1.0) -> Optional[LoadedBatch]:
        """The next unseen batch, or None after `timeout` seconds without one."""
        start = time.monotonic()
        deadline = start + timeout
        self._ensure_started()
        while True:
            self._raise_if_failed()
            item = self._take(deadline)
            if item is None:
                self._counts["time/wait_data_s"] += time.monotonic() - start
                return None
            if isinstance(item, _Skip):
                self._advance(item.partition, item.offset)
                continue
            if self._hand_out(item):
                wait = time.monotonic() - start
                self._counts["time/wait_data_s"] += wait
                return replace(item, wait_s=wait)

    def positions(self) -> dict[int, int]:
        """{partition: next offset} after everything handed out so far: what a checkpoint records."""
        with self._lock:
            return dict(self._positions)

    def seek(self, offsets: dict[int, int]) -> None:
        """Resume from a checkpoint's recorded offsets; prefetched batches are discarded, handed-out ones stay seen."""
        self._stop_prefetcher()
        with self._lock:
            self._positions.update(offsets)
        self._reset_pipeline()
        self._consumer.assign([TopicPartition(self.topic, p, o) for p, o in self._positions.items()])

    def commit(self, offsets: Optional[dict[int, int]] = None) -> None:
        """Commit `offsets` (default: positions()) for the group; call it after the checkpoint is stored."""
        offsets = self.positions() if offsets is None else offsets
        commit_offsets(self._committer, [TopicPartition(self.topic, p, o) for p, o in offsets.items()])

    def mark_seen(self, batch_ids: Iterable[str]) -> None:
        """Batches already trained (from a checkpoint): never hand them out again."""
        with self._lock:
            for bid in batch_ids:
                self._seen.add(bid)

    def set_policy_version(self, version: int) -> None:
        """The learner's current version; with max_policy_lag, wholly stale shards are not downloaded."""
        self._policy_version = version

    def ready(self) -> int:
        """Batches prefetched and waiting."""
        return self._ready

    def metrics(self) -> dict[str, float]:
        stats = self.cache.stats
        return {**self._counts, "cache/hits": float(stats.hits), "cache/misses": float(stats.misses),
                "cache/corrupt": float(stats.corrupt), "cache/evictions": float(stats.evictions),
                "cache/bytes": float(self.cache.size_bytes), "reader/ready": float(self._ready)}

    def close(self) -> None:
        # Bounded: a prefetcher stuck in a store outage never touches the consumer again once stopped.
        self._stop_prefetcher(timeout=max(2.0, 10 * self.poll_timeout_s))
        self._consumer.close()
        self._committer.close()

    def __enter__(self) -> "BatchReader":
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # ---- handing out ----------------------------------------------------------------------------
    def _take(self, deadline: float) -> Union[LoadedBatch, _Skip, None]:
        while True:
            # Wake now and then so that a failed prefetcher surfaces instead of a silent wait.
            remaining = deadline - time.monotonic()
            try:
                item: Union[LoadedBatch, _Skip] = self._queue.get(timeout=max(0.0, min(remaining, 0.5)))
                return item
            except queue.Empty:
                self._raise_if_failed()
                if remaining <= 0:
                    return None

    def _hand_out(self, batch: LoadedBatch) -> bool:
        """Record a prefetched batch as handed out; False if it was marked seen meanwhile."""
        self._slots.release()
        bid = batch.manifest.batch_id
        with self._lock:
            self._ready -= 1
            self._inflight.discard(bid)
            duplicate = self._seen.covers(batch.manifest)
            if not duplicate:
                self._seen.add(bid)
        self._advance(batch.partition, batch.offset)
        if duplicate:
            self._counts["reader/duplicates"] += 1
            return False
        self._counts["reader/batches"] += 1
        self._counts["reader/trajectories"] += len(batch.trajectories)
        return True

    def _advance(self, partition: int, offset: int) -> None:
        with self._lock:
            self._positions[partition] = max(offset + 1, self._positions.get(partition, 0))

    # ---- the prefetcher -------------------------------------------------------------------------
    def _reset_pipeline(self) -> None:
        self._queue: queue.Queue[Union[LoadedBatch, _Skip]] = queue.Queue()
        self._slots = threading.Semaphore(self.prefetch)  # batches ready or being fetched
        self._ready = 0
        self._inflight.clear()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    def _ensure_started(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._prefetch_loop, name="batch-prefetch", daemon=True)
            self._thread.start()

    def _stop_prefetcher(self, timeout: Optional[float] = None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _prefetch_loop(self) -> None:
        try:
            while not self._stop.is_set():
                msg = self._consumer.poll(self.poll_timeout_s)
                if msg is None or self._consumer_error(msg):
                    continue
                item = self._prepare(msg)
                if item is None:
                    return  # stopped
                with self._lock:
                    self._ready += isinstance(item, LoadedBatch)
                self._queue.put(item)
        except BaseException as exc:  # surfaced by next_batch
            log.exception("batch prefetcher failed")
            self._error = exc

    def _consumer_error(self, msg: Message) -> bool:
        err = msg.error()
        if err is None:
            return False
        if err.fatal():
            raise KafkaException(err)
        log.warning("batch consumer: %s", err)
        return True

    def _prepare(self, msg: Message) -> Union[LoadedBatch, _Skip, None]:
        partition, offset = msg.partition() or 0, msg.offset() or 0
        try:
            manifest: BatchManifest = codec.decode(msg.value() or b"", expect=BatchManifest)
        except DecodeError as exc:
            log.error("%s[%d]@%d is not a BatchManifest (%s); skipped", self.topic, partition, offset, exc)
            self._counts["reader/bad_manifests"] += 1
            return _Skip(partition, offset)
        with self._lock:
            duplicate = self._seen.covers(manifest) or manifest.batch_id in self._inflight
        if duplicate:
            self._counts["reader/duplicates"] += 1
            return _Skip(partition, offset)
        if not self._acquire_slot():
            return None
        with self._lock:
            self._inflight.add(manifest.batch_id)
        return self._load(manifest, partition, offset)

    def _acquire_slot(self) -> bool:
        while not self._stop.is_set():
            if self._slots.acquire(timeout=0.2):
                return True
        return False

    def _load(self, manifest: BatchManifest, partition: int, offset: int) -> Optional[LoadedBatch]:
        if self._is_stale(manifest):
            self._counts["reader/stale_batches"] += 1
            return LoadedBatch(manifest, (), offset, partition, stale=True)
        try:
            data = self._fetch(manifest)
            if data is None:
                return None
            return LoadedBatch(manifest, tuple(read_shard(data)), offset, partition)
        except (ObjectNotFound, IntegrityError, DecodeError) as exc:
            kind = ("missing_shards" if isinstance(exc, ObjectNotFound) else
                    "corrupt_shards" if isinstance(exc, IntegrityError) else "undecodable_shards")
            self._counts[f"reader/{kind}"] += 1
            problem = f"shard {manifest.key} of batch {manifest.batch_id}: {kind.replace('_', ' ')[:-1]} ({exc})"
            log.error("%s; the batch is skipped, and recorded as skipped in the next checkpoint", problem)
            return LoadedBatch(manifest, (), offset, partition, problem=problem[:500])

    def _is_stale(self, m: BatchManifest) -> bool:
        current, lag = self._policy_version, self.max_policy_lag
        return current is not None and lag is not None and m.policy_version_max < current - lag

    def _fetch(self, m: BatchManifest) -> Optional[bytes]:
        """The shard's bytes, waiting out store outages; None if stopped meanwhile."""
        while not self._stop.is_set():
            try:
                return self.cache.fetch(m.sha256, lambda: self.store.get(m.key, sha256=m.sha256))
            except ObjectNotFound:
                raise  # gone for good, not an outage: skipped loudly by the caller
            except ObjectStoreError as exc:
                self._counts["reader/store_waits"] += 1
                log.warning("waiting for the object store to fetch %s: %s", m.key, exc)
        return None

    # ---- start ----------------------------------------------------------------------------------
    def _committed_positions(self) -> dict[int, int]:
        """The group's committed offsets; the start of the log where it has none."""
        return while_broker_away(f"committed offsets on {self.topic}", self._read_committed)

    def _read_committed(self) -> dict[int, int]:
        # A broker that has just started can deny a topic bootstrap created seconds earlier (its metadata
        # still loading): asked again for up to TOPIC_SETTLE_S before the topic is called missing.
        deadline = time.monotonic() + TOPIC_SETTLE_S
        while True:
            meta = self._consumer.list_topics(self.topic, timeout=10)
            if meta.topics[self.topic].error is None:
                break
            if time.monotonic() >= deadline:
                raise ConfigError(f"topic {self.topic} does not exist; run `python -m infra bootstrap --ns NAME`")
            time.sleep(1.0)
        parts = sorted(meta.topics[self.topic].partitions)
        committed = self._consumer.committed([TopicPartition(self.topic, p) for p in parts], timeout=10)
        out = {}
        for tp in committed:
            low, _high = self._consumer.get_watermark_offsets(tp, timeout=10)
            out[tp.partition] = tp.offset if tp.offset >= 0 else low
        return out
