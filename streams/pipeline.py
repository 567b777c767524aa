"""The worker's stages over batches of messages: clean -> assemble -> score, then group; sweeper; metrics.

    pipeline = Pipeline(settings, topics, tables, outbox, scorer)
    await pipeline.on_events(messages)          # <ns>.rollout.events -> <ns>.trajectories | deadletter
    await pipeline.on_trajectories(messages)    # <ns>.trajectories  -> <ns>.trajectories.scored, task.stats
    await pipeline.sweep()                      # abandon idle episodes, emit timed-out groups, forget old markers
    await pipeline.flush_metrics()              # -> <ns>.pipeline.metrics

Every input event ends in exactly one place: folded into an episode (and so in its trajectory, or in the
dead letter of that trajectory), dead-lettered itself with a reason, or counted as a duplicate. Outputs
are keyed and derived from the log only (ids from episode ids, timestamps from events), so reprocessing
after a crash re-sends identical records: consumers dedupe by trajectory id. Trajectories and scored
trajectories are keyed by group_id, so a group's members share a partition (and sit together in shards).

The counters are per input partition and cumulative, stored in each stage's table (streams.counting): a
pass over positions counted before a crash re-sends its outputs without counting them again.
"""
from __future__ import annotations

import asyncio
import functools
import gc
import logging
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Optional, Protocol

from infra.claims import resolve
from infra.settings import Settings
from schemas.codec import codec
from schemas.errors import DecodeError, RewardError, ValidationError
from schemas.records import DeadLetter, PolicyTurn, RolloutEvent, SourcePosition, Trajectory
from schemas.topics import Topics
from streams import assembly, fastcodec, grouping
from streams.assembly import ABANDONED, ERROR, ClosedEpisode, EpisodeState
from streams import counting
from streams.counting import Tally
from streams.eventtime import EventTime
from streams.expiry import ClosedMarkers
from streams.grouping import ClosedGroup, GroupState, TaskCount
from infra.metrics import Metrics
from streams.metrics import SOURCE, observe_trajectory, streams_metrics, trajectory_counts
from streams.outbox import Outbox
from streams.runtime import PartitionedTable
from streams.scoring import Scorer
from streams.settings import StreamSettings
from streams.state import EpisodeLog, GroupValue, MemberRecord, member_key
from streams.validation import DEFAULT_LIMITS, Limits, decode_event, validate

log = logging.getLogger(__name__)
MAX_DETAIL = 2000
# Markers outlive episodes by the dedupe horizon: looking for expired ones every sweep would cost more
# than it frees.
PRUNE_EVERY = 30


class Message(Protocol):
    """The parts of a Kafka message the stages read (aiokafka's ConsumerRecord has them; streams.runtime.Record
    holds them for a message Faust made)."""

    topic: str
    partition: int
    offset: int
    key: Optional[bytes]
    value: Optional[bytes]
    timestamp: int  # milliseconds


@dataclass
class Tables:
    episodes: PartitionedTable[EpisodeLog]
    seen: PartitionedTable[ClosedEpisode]
    groups: PartitionedTable[GroupValue]  # groups by group id, their open members' records by member key
    taskstats: PartitionedTable[TaskCount]

    def items(self) -> list[tuple[str, PartitionedTable[Any]]]:
        return [("episodes", self.episodes), ("seen", self.seen), ("groups", self.groups),
                ("taskstats", self.taskstats)]


@dataclass
class Incoming:
    message: Message
    event: RolloutEvent
    rejected: bool = False

    @property
    def position(self) -> SourcePosition:
        return SourcePosition(self.message.partition, self.message.offset)


@dataclass
class EpisodeBatch:
    """Episodes touched by one batch: written to the changelog once each, at the end of the batch."""

    logs: dict[bytes, EpisodeLog] = field(default_factory=dict)
    opened: set[bytes] = field(default_factory=set)
    ended: list[bytes] = field(default_factory=list)
    accepted: Counter[int] = field(default_factory=Counter)  # events folded, by partition


class ClaimResolver:
    """Fetches claim-checked payloads from the object store, which is only opened when a claim appears."""

    def __init__(self, platform: Optional[Settings]) -> None:
        self.platform = platform
        self._store: Any = None

    def __call__(self, event: RolloutEvent) -> RolloutEvent:
        if self.platform is None:
            raise ValidationError("claim_unavailable", "this worker has no object store configured")
        if self._store is None:
            from infra.objectstore import ObjectStore

            self._store = ObjectStore(self.platform)
        return resolve(event, self._store)


class Pipeline:
    def __init__(self, settings: StreamSettings, topics: Topics, tables: Tables, outbox: Outbox, scorer: Scorer,
                 claims: Optional[Callable[[RolloutEvent], RolloutEvent]] = None, metrics: Optional[Metrics] = None,
                 limits: Limits = DEFAULT_LIMITS, ready: Callable[[], bool] = lambda: True) -> None:
        self.settings, self.topics, self.tables, self.outbox, self.scorer = settings, topics, tables, outbox, scorer
        self.claims = claims or ClaimResolver(None)
        self.metrics = metrics or streams_metrics()
        self.limits = limits
        self.ready = ready
        # The timers and the agents share tables; a batch holds its stage's lock across its awaits (claims,
        # flushes), while the other stage, which has its own tables, may run.
        self.episode_lock = asyncio.Lock()
        self.group_lock = asyncio.Lock()
        # Episodes age in their producer's event time (or wall time); groups, whose members do not say which
        # producer made them, in wall time since their first member came (streams.eventtime).
        self.event_time = EventTime(int(settings.clock_skew_s * 1000))
        self.trajectory_time = EventTime(int(settings.clock_skew_s * 1000))  # ended_ts: for closed groups
        self.max_record_bytes = settings.max_record_bytes
        self.logged_members: dict[bytes, int] = {}  # member keys this worker wrote to the groups changelog -> partition
        # Each stage's counters, per input partition, in its own table (streams.counting).
        self.episode_tally = Tally(tables.episodes, lambda value: value is not None)
        self.group_tally = Tally(tables.groups, lambda value: isinstance(value, GroupState))
        self.window_start = 0  # event time (ms) where the next window starts: the last window's end
        self.window_wall = _now_ms()
        self.sweeps = 0
        # What the sweeper acts on, kept beside the tables so it does not walk every entry: the keys of the open
        # groups, and the closed markers in the order they closed. Rebuilt from the tables whenever a recovery
        # may have filled them (`indexed` False: at start and after each rebalance).
        self.open_groups: dict[bytes, None] = {}
        self.closed_episodes, self.closed_groups = ClosedMarkers(), ClosedMarkers()
        self.indexed = False
        # Monotonic time from which this worker could read the log: its start, or when a sweep found it ready
        # again after recovering or rebalancing.
        self.ready_since: Optional[float] = time.monotonic()

    # ---- clean -> assemble -> score ----------------------------------------------------------
    async def on_events(self, messages: list[Message]) -> None:
        async with self.episode_lock:
            replayed, fresh = self.episode_tally.split(messages)
            if replayed:
                with self.episode_tally.muted():
                    await self._on_events(replayed)
            if fresh:
                await self._on_events(fresh)

    async def _on_events(self, messages: list[Message]) -> None:
        self._count_each(self.episode_tally, Counter(m.partition for m in messages), "streams/events")
        cleaned = [self._clean(m) for m in messages]
        await self._check_claims([c for c in cleaned if c is not None and _claimed(c.event)])
        batch = EpisodeBatch()
        for item in cleaned:
            if item is not None and not item.rejected:
                self._assemble(item, batch)
        self._count_each(self.episode_tally, batch.accepted, "streams/accepted")
        ended = [(key, batch.logs.pop(key), key not in batch.opened) for key in batch.ended]
        oversize = [(key, batch.logs.pop(key), key not in batch.opened) for key, episode in list(batch.logs.items())
                    if log_bytes(episode) > self.max_record_bytes]
        for key, episode, _ in ended:
            await self._publish_trajectory(episode.state, None)
        for key, episode, _ in oversize:  # its changelog value would not fit a record: it ends here
            self._reject_trajectory(assembly.to_trajectory(episode.state, self.topics.events, ERROR),
                                    episode.state, "oversize", f"the open episode's events take "
                                    f"{log_bytes(episode)} bytes, over --max-record-bytes "
                                    f"{self.max_record_bytes}", "assemble")
        self.episode_tally.advance(messages)
        self.episode_tally.write(self.outbox)  # ahead of the state it counts, in the same changelog partition
        for key, episode in batch.logs.items():
            self.tables.episodes.put(self.outbox, episode.state.partition, key, episode)
        await self._forget_episodes(ended)
        await self._forget_episodes(oversize, ERROR)

    def _count(self, tally: Tally, partition: int, name: str, n: int = 1, **labels: str) -> None:
        """Count into the window's rates and the partition's cumulative counters (not in a replayed pass)."""
        if not tally.is_muted:
            self.metrics.count(name, n, **labels)
            tally.count(partition, (name, tuple(sorted(labels.items()))), n)

    def _count_each(self, tally: Tally, by_partition: Mapping[int, int], name: str) -> None:
        """A batch's count of `name` in each partition, counted once per partition rather than once per record."""
        for partition, n in by_partition.items():
            self._count(tally, partition, name, n)

    def _clean(self, message: Message) -> Optional[Incoming]:
        try:
            event = decode_event(message.value)
            if not _claimed(event):  # a claimed turn is checked once its payload is fetched
                validate(event, self.limits)
        except DecodeError as exc:
            self._reject(message, exc.reason, exc.detail + (f" (at {exc.where})" if exc.where else ""), "clean")
            return None
        except ValidationError as exc:
            self._reject(message, exc.reason, exc.detail, "clean", event)
            return None
        except Exception as exc:  # a poison message must not stop the worker
            self._failed(message, exc, "clean")
            return None
        return Incoming(message, event)

    async def _check_claims(self, items: list[Incoming]) -> None:
        loop = asyncio.get_running_loop()
        for item in items:
            try:
                validate(await loop.run_in_executor(None, self.claims, item.event), self.limits)
            except ValidationError as exc:
                self._reject(item.message, exc.reason, exc.detail, "clean", item.event)
                item.rejected = True

    def _assemble(self, item: Incoming, batch: EpisodeBatch) -> None:
        event, key = item.event, item.event.episode_id.encode()
        partition = item.message.partition
        if self.event_time.observe((partition, event.producer_id), event.ts):
            self._count(self.episode_tally, partition, "streams/clock_skew_clamped")
        episode = batch.logs.get(key) or self.tables.episodes.get(key)
        try:
            if self._is_duplicate(key, episode, item):
                self._count(self.episode_tally, partition, "streams/duplicates")
                return
            state = assembly.fold(episode.state if episode else None, event, item.position)
        except ValidationError as exc:
            self._reject(item.message, exc.reason, exc.detail, "assemble", event)
            return
        except Exception as exc:
            self._failed(item.message, exc, "assemble", event)
            return
        batch.accepted[partition] += 1
        self.event_time.touch(key, (partition, item.event.producer_id))
        raw = item.message.value or b""
        if episode is None:
            batch.opened.add(key)
        batch.logs[key] = episode.extend(state, raw) if episode else EpisodeLog(state, (raw,))
        if state.ended is not None:
            batch.ended.append(key)

    def _is_duplicate(self, key: bytes, episode: Optional[EpisodeLog], item: Incoming) -> bool:
        """True for an event already taken; ValidationError for one that cannot join its episode any more."""
        if episode is None:
            closed = self.tables.seen.get(key)
        elif episode.state.ended is not None:  # ended earlier in this batch
            closed = assembly.close(episode.state, episode.state.ended.status)
        else:
            if item.message.partition != episode.state.partition:
                raise ValidationError("bad_step", f"episode {item.event.episode_id} came on partition "
                                                  f"{episode.state.partition}, this event on {item.message.partition}")
            return assembly.is_duplicate(episode.state, item.event)
        if closed is None:
            return False
        assembly.classify_late(closed, item.event)
        return True

    async def _publish_trajectory(self, state: EpisodeState, status: Optional[str]) -> None:
        """The episode's trajectory (or its dead letter) to the outbox."""
        trajectory = await self._trajectory(state, status or assembly.status_of(state) or ABANDONED)
        if trajectory is not None:
            self._score_and_publish(trajectory, state)

    async def _forget_episodes(self, closed: list[tuple[bytes, EpisodeLog, bool]], status: Optional[str] = None
                               ) -> None:
        """Once their trajectories are on the broker, remember the episodes as closed and drop their state.

        In this order a crash can re-send a trajectory (its events come again, or the sweeper finds the
        state again) but never lose one: no marker is written before the trajectory is acknowledged.
        """
        if not closed:
            return
        await self.outbox.flush()
        self.episode_tally.write(self.outbox)  # the sweeper's closings, counted ahead of their tombstones
        for key, episode, tombstone in closed:
            state = episode.state
            final = status or assembly.status_of(state) or ABANDONED
            marker = assembly.close(state, final)
            self.tables.seen.put(self.outbox, state.partition, key, marker)
            self.closed_episodes.add(state.partition, key, marker)
            self.tables.episodes.delete(self.outbox, state.partition, key, tombstone)
            self.event_time.forget(key)

    async def _trajectory(self, state: EpisodeState, status: str) -> Optional[Trajectory]:
        if state.claims:
            try:
                state = await self._with_payloads(state)
            except ValidationError as exc:
                unscored = assembly.to_trajectory(state, self.topics.events, status)
                self._reject_trajectory(unscored, state, exc.reason, exc.detail, "assemble")
                return None
        return assembly.to_trajectory(state, self.topics.events, status)

    async def _with_payloads(self, state: EpisodeState) -> EpisodeState:
        loop = asyncio.get_running_loop()
        resolved: dict[int, PolicyTurn] = {}
        for event in state.claims:
            body = (await loop.run_in_executor(None, self.claims, event)).body
            assert isinstance(body, PolicyTurn)
            resolved[body.turn] = body
        return assembly.with_payloads(state, resolved)

    def _score_and_publish(self, trajectory: Trajectory, state: EpisodeState) -> None:
        try:
            scored = self.scorer.score(trajectory)
            value = codec.encode(scored)
        except RewardError as exc:
            self._reject_trajectory(trajectory, state, "reward_error", str(exc), "score")
            return
        except Exception as exc:
            log.exception("scoring %s failed", trajectory.trajectory_id)
            self._reject_trajectory(trajectory, state, "processing_error", repr(exc), "score")
            return
        if len(value) > self.max_record_bytes:
            self._reject_trajectory(trajectory, state, "oversize", f"the trajectory takes {len(value)} bytes, over "
                                    f"--max-record-bytes {self.max_record_bytes}", "score")
            return
        self.outbox.send(self.topics.trajectories, scored.group_id.encode(), value)
        if not self.episode_tally.is_muted:
            observe_trajectory(self.metrics, scored)
            for name, labels, n in trajectory_counts(scored):
                self.episode_tally.count(state.partition, (name, labels), n)

    # ---- group -------------------------------------------------------------------------------
    async def on_trajectories(self, messages: list[Message]) -> None:
        async with self.group_lock:
            replayed, fresh = self.group_tally.split(messages)
            if replayed:
                with self.group_tally.muted():
                    await self._on_trajectories(replayed)
            if fresh:
                await self._on_trajectories(fresh)

    async def _on_trajectories(self, messages: list[Message]) -> None:
        touched: dict[bytes, GroupState] = {}
        joined: list[tuple[bytes, grouping.Member]] = []
        for message in messages:
            self._add_to_group(message, touched, joined)
        complete = [(key, group) for key, group in touched.items() if grouping.is_complete(group)]
        results = [self._finish(group, timed_out=False) for _, group in complete]
        self.group_tally.advance(messages)
        self.group_tally.write(self.outbox)  # ahead of the state it counts, in the same changelog partition
        for key, member in joined:  # a group still open keeps each new member's record under its own key
            group = touched[key]
            if not grouping.is_complete(group):
                mkey = member_key(key, member.trajectory_id)
                self.tables.groups.log(self.outbox, group.partition, mkey, MemberRecord(member.raw))
                self.logged_members[mkey] = group.partition
        for key, group in touched.items():
            if not grouping.is_complete(group):
                self.tables.groups.put(self.outbox, group.partition, key, group)
                self.open_groups[key] = None
        await self._emit_groups(complete, results, timed_out=False)

    def _add_to_group(self, message: Message, touched: dict[bytes, GroupState],
                      joined: list[tuple[bytes, grouping.Member]]) -> None:
        try:
            raw = fastcodec.current_bytes(message.value or b"")
            head = fastcodec.read_summary(raw)
        except DecodeError as exc:
            self._reject(message, exc.reason, exc.detail, "group")
            return
        except Exception as exc:
            self._failed(message, exc, "group")
            return
        key, partition = head.group_id.encode(), message.partition
        if self.trajectory_time.observe((partition, ""), head.ended_ts):
            self._count(self.group_tally, partition, "streams/clock_skew_clamped")
        found = touched.get(key) or self.tables.groups.get(key)
        current = None if isinstance(found, MemberRecord) else found  # (a group id never has a member's key)
        if isinstance(current, ClosedGroup) or (current is not None and grouping.is_complete(current)):
            ids = current.trajectory_ids
            self._count(self.group_tally, partition, "streams/duplicate_trajectories" if head.trajectory_id in ids
                        else "streams/late_stragglers")
            return
        member = grouping.Member(head, raw)
        group = grouping.add_member(current, member, partition)
        if group is current:
            self._count(self.group_tally, partition, "streams/duplicate_trajectories")
            return
        touched[key] = group
        joined.append((key, member))

    def _finish(self, group: GroupState, timed_out: bool) -> grouping.GroupResult:
        """The group's advantages, counted."""
        result = grouping.finalize(group, self.settings.advantage_eps, self.settings.drop_zero_variance)
        self._count_group(group, result, timed_out)
        return result

    async def _emit_groups(self, groups: list[tuple[bytes, GroupState]], results: list[grouping.GroupResult],
                           timed_out: bool) -> None:
        """Scored members out; once they are on the broker, the groups are closed and their tasks counted."""
        if not groups:
            return
        for (key, group), result in zip(groups, results):
            self._emit_scores(key, group, result)
        await self.outbox.flush()
        self.group_tally.write(self.outbox)  # the sweeper's closings, counted ahead of the groups' closing writes
        for (key, group), result in zip(groups, results):
            self._count_task(group, result)
            closed = grouping.close(group, timed_out)
            self.tables.groups.put(self.outbox, group.partition, key, closed)
            self.open_groups.pop(key, None)
            self.closed_groups.add(group.partition, key, closed)
            for member in group.members:
                mkey = member_key(key, member.trajectory_id)
                if mkey in self.logged_members or self.tables.groups.get(mkey) is not None:
                    self.logged_members.pop(mkey, None)
                    self.tables.groups.delete(self.outbox, group.partition, mkey)

    def _emit_scores(self, key: bytes, group: GroupState, result: grouping.GroupResult) -> None:
        for member, advantage in result.scored:
            raw = member.raw or self._member_record(key, group, member)  # empty: recovered from the changelog
            if not raw:
                continue
            value = fastcodec.with_advantage(raw, member.summary.advantage_at, advantage, result.mean,
                                             result.std)
            self.outbox.send(self.topics.scored, key, value)

    def _member_record(self, key: bytes, group: GroupState, member: grouping.Member) -> bytes:
        record = self.tables.groups.get(member_key(key, member.trajectory_id))
        if isinstance(record, MemberRecord):
            return record.raw
        log.error("group %r: no record of member %s in the changelog", key, member.trajectory_id)
        self._count(self.group_tally, group.partition, "streams/missing_member_records")
        return b""

    def _count_group(self, group: GroupState, result: grouping.GroupResult, timed_out: bool) -> None:
        count = functools.partial(self._count, self.group_tally, group.partition)
        count("streams/groups", outcome="timed_out" if timed_out else "complete")
        count("streams/scored", len(result.scored))
        count("streams/untrainable", len(group.members) - result.trainable)
        if result.zero_variance:
            count("streams/zero_variance_groups", dropped=str(result.dropped).lower())

    def _count_task(self, group: GroupState, result: grouping.GroupResult) -> None:
        """The task's counts of this group's partition, in the table and on the feed under the key
        "<partition>|<task id>": each partition's owner publishes its own, so the counts stay exact however many
        workers share the partitions, and a reader sums a task's partitions (producers.feeds)."""
        first = min((m.summary for m in group.members), key=lambda t: t.trajectory_id)
        key = grouping.task_key(group.partition, first.task_id)
        count = grouping.count_task(self.tables.taskstats.get(key), first.domain, result)
        self.tables.taskstats.put(self.outbox, group.partition, key, count)
        self.outbox.send(self.topics.task_stats, key, codec.encode(grouping.task_stats(first.task_id, [count])))

    async def keep_partitions(self, partitions: set[int]) -> None:
        """After a rebalance: let go of the state of partitions another worker now holds (it recovers them from
        the changelog), so this worker's sweeps, timers and table writes touch only partitions it owns."""
        async with self.episode_lock, self.group_lock:
            gone = {name: table.keep_partitions(partitions) for name, table in self.tables.items()}
            for key in gone["episodes"]:
                self.event_time.forget(key)
            self.logged_members = {key: p for key, p in self.logged_members.items() if p in partitions}
            self.episode_tally.keep_partitions(partitions)
            self.group_tally.keep_partitions(partitions)
            self.indexed = False  # the partitions it gained are recovered next: indexed once it is ready again
        log.info("holding partitions %s; let go of %s", sorted(partitions),
                 ", ".join(f"{len(keys)} {name}" for name, keys in gone.items() if keys) or "nothing")

    # ---- timers ------------------------------------------------------------------------------
    async def sweep(self) -> None:
        """Close idle episodes as abandoned, emit groups past their timeout, forget markers past the horizon."""
        if not self.ready() or not await self.outbox.reachable():
            self.ready_since = None
            return
        now = time.monotonic()
        # Wall time counts from when this worker could process the log again: after a restart, recovery
        # and a rebalance take seconds in which no event of a recovered episode or group can arrive, and
        # while no broker answers, producers hold their events back (delivered when it returns).
        if not self.indexed:  # started, or assigned partitions, and their recovery is done
            self.index()
        self.ready_since = since = self.ready_since or now
        async with self.episode_lock:
            idle = [(key, episode, True) for key, episode in self.tables.episodes.items()
                    if self.event_time.idle_ms(key, now - max(episode.touched, since))
                    > self.settings.episode_timeout_s * 1000]
            for key, episode, _ in idle:
                with self.episode_tally.closing(episode.state.partition, key):
                    await self._publish_trajectory(episode.state, ABANDONED)
                    self._count(self.episode_tally, episode.state.partition, "streams/abandoned")
            await self._forget_episodes(idle, ABANDONED)
        async with self.group_lock:
            late = [(key, group) for key, group in self._open_groups()
                    if now - max(group.since, since) > self.settings.group_timeout_s]
            results = []
            for key, group in late:
                with self.group_tally.closing(group.partition, key):
                    results.append(self._finish(group, timed_out=True))
            await self._emit_groups(late, results, timed_out=True)
        self.sweeps += 1
        if self.sweeps % PRUNE_EVERY == 0:
            async with self.episode_lock, self.group_lock:
                self.prune()

    def prune(self) -> None:
        """Forget the closed markers past the dedupe horizon (oldest first: streams.expiry), and the producer clocks
        no open episode uses."""
        self.event_time.forget_unused()
        horizon, now = self.settings.dedupe_horizon_s * 1000, time.monotonic()
        for markers, table, clock in ((self.closed_episodes, self.tables.seen, self.event_time),
                                      (self.closed_groups, self.tables.groups, self.trajectory_time)):
            def expired(closed: Any, clock: EventTime = clock) -> bool:
                return clock.age_ms(closed.partition, closed.closed_ts, now - closed.since) > horizon

            for partition, key in markers.due(expired, table.get):
                table.delete(self.outbox, partition, key)

    def index(self) -> None:
        """The open groups and the closed markers, from the tables as a recovery left them (one walk).

        The collector is paused meanwhile: the walk makes a tuple per entry, and with millions held each full
        collection it set off walked them all again (1M markers: 0.9 s paused, 3.8 s not)."""
        paused = gc.isenabled()
        gc.disable()
        try:
            groups = self.tables.groups.items()
            self.open_groups = {key: None for key, group in groups if type(group) is GroupState}
            self.closed_groups.rebuild([item for item in groups if type(item[1]) is ClosedGroup])
            self.closed_episodes.rebuild([item for item in self.tables.seen.items() if type(item[1]) is ClosedEpisode])
        finally:
            if paused:
                gc.enable()
        self.indexed = True

    def _open_groups(self) -> list[tuple[bytes, GroupState]]:
        """The open groups, by the index (a key whose group closed or was let go since leaves it)."""
        found = []
        for key in list(self.open_groups):
            group = self.tables.groups.get(key)
            if isinstance(group, GroupState):
                found.append((key, group))
            else:
                del self.open_groups[key]
        return found

    def watermark(self) -> int:
        """Event time of the newest event this worker read (its clock's time before any)."""
        return max(self.event_time.partitions.values(), default=0) or _now_ms()

    async def flush_metrics(self) -> None:
        """The window's figures, from the last window's event time to the newest event's, and every counter of
        the partitions this worker holds, cumulative."""
        end, wall = max(self.watermark(), self.window_start), _now_ms()
        self.metrics.gauge("streams/open_episodes", float(len(self.tables.episodes)))
        open_groups = len(self._open_groups()) if self.indexed else sum(
            isinstance(g, GroupState) for _, g in self.tables.groups.items())
        self.metrics.gauge("streams/open_groups", float(open_groups))
        window = self.metrics.flush(self.window_start or end, end, seconds=(wall - self.window_wall) / 1000)
        for metric in window + counting.records(SOURCE, (self.episode_tally, self.group_tally), end):
            self.outbox.send(self.topics.metrics, metric.name.encode(), codec.encode(metric))
        self.window_start, self.window_wall = end, wall
        log.info("streams totals: %s", self.metrics.summary())

    # ---- dead letters ------------------------------------------------------------------------
    def _reject(self, message: Message, reason: str, detail: str, stage: str,
                event: Optional[RolloutEvent] = None) -> None:
        ts = event.ts if event is not None else int(message.timestamp)
        self._dead_letter(DeadLetter(reason=reason, detail=detail[:MAX_DETAIL], stage=stage,
                                     source_topic=message.topic, partition=message.partition, offset=message.offset,
                                     key=message.key, original=message.value or b"", ts=ts))

    def _failed(self, message: Message, exc: Exception, stage: str, event: Optional[RolloutEvent] = None) -> None:
        log.exception("%s[%d]@%d failed in %s", message.topic, message.partition, message.offset, stage)
        self._reject(message, "processing_error", repr(exc), stage, event)

    def _reject_trajectory(self, trajectory: Trajectory, state: EpisodeState, reason: str, detail: str,
                           stage: str) -> None:
        """The whole trajectory, unscored, at the position of its last event: a replay can score it again."""
        last = max(state.positions, key=lambda p: p.offset)
        self._dead_letter(DeadLetter(reason=reason, detail=detail[:MAX_DETAIL], stage=stage,
                                     source_topic=self.topics.events, partition=last.partition, offset=last.offset,
                                     key=state.episode_id.encode(), original=_encode_or_empty(trajectory),
                                     ts=state.last_ts))

    def _dead_letter(self, record: DeadLetter) -> None:
        value = codec.encode(record)
        if len(value) > self.max_record_bytes:  # the dead letter itself must fit: keep the position, not the bytes
            record = replace(record, original=b"", detail=record.detail + f" (the original's {len(record.original)}"
                             f" bytes are not copied here: read them at {record.source_topic}"
                             f"[{record.partition}]@{record.offset})")
            value = codec.encode(record)
        tally = self.group_tally if record.stage == "group" else self.episode_tally
        self._count(tally, record.partition, "streams/deadletters", reason=record.reason, stage=record.stage)
        log.debug("dead letter %s at %s[%d]@%d: %s", record.reason, record.source_topic, record.partition,
                  record.offset, record.detail)
        self.outbox.send(self.topics.deadletter, record.key, value)


def log_bytes(episode: EpisodeLog) -> int:
    """About the size of the episode's changelog value (its events plus a small frame each)."""
    return sum(len(raw) for raw in episode.raw) + 16 * len(episode.raw)


def _encode_or_empty(record: Trajectory) -> bytes:
    try:
        return codec.encode(record)
    except Exception:  # the dead letter still says what failed, with the source position to find it
        return b""


def _claimed(event: RolloutEvent) -> bool:
    return isinstance(event.body, PolicyTurn) and event.body.claim is not None


def _now_ms() -> int:
    return int(time.time() * 1000)
