"""Each Faust agent and timer of the streams worker through `agent.test_context()`: no broker, an in-memory outbox."""
from __future__ import annotations

import asyncio
import random
import time
import zlib
from types import SimpleNamespace
from collections import Counter
from dataclasses import replace
from typing import Any, Callable, Optional

import pytest

from schemas.codec import codec
from schemas.errors import ValidationError
from schemas.packing import join_payload, pack_floats, pack_ids, split_payload
from schemas.records import DeadLetter, PipelineMetric, PolicyTurn, RolloutEvent, TaskStats, Trajectory
from streams import counting
from streams.app import build_app
from streams.outbox import MemoryOutbox
from streams.rewards import RewardResult
from streams.runtime import Budget, Chunk, Record, StreamsApp, batches
from streams.scoring import Scorer
from streams.settings import StreamSettings
from streams.state import counts_key, load_closed_episode, load_episode, load_group, load_task_count
from tests.streams_data import Episode, events_of, recorded_stream

NS = "unit"
P = 2


def make_app(scorer: Optional[Scorer] = None, **overrides: Any) -> tuple[StreamsApp, MemoryOutbox]:
    outbox = MemoryOutbox()
    settings = StreamSettings(ns=NS, partitions=P, **{"batch_wait_s": 0.0, **overrides})
    return build_app(settings, outbox=outbox, scorer=scorer), outbox


def partition(key: bytes) -> int:
    return zlib.crc32(key) % P


def next_offset(app: StreamsApp, agent: Any, stage: str, p: int) -> None:
    """Offsets as a broker gives them: each partition's go on from the last message put to it in this app
    (a test context alone would start at 0 again, which the worker takes for a replay after a crash)."""
    offsets = app.__dict__.setdefault("test_offsets", Counter())
    agent.sent_offset = offsets[(stage, p)]
    offsets[(stage, p)] += 1


async def put_events(app: StreamsApp, messages: list[tuple[bytes, bytes]]) -> None:
    async with app.stage_agents["assemble"].test_context() as agent:  # type: ignore[attr-defined]
        for key, value in messages:
            next_offset(app, agent, "assemble", partition(key))
            await agent.put(value, key=key, partition=partition(key), timestamp=1_700_000_000.0)


async def put_trajectories(app: StreamsApp, outbox: MemoryOutbox) -> None:
    async with app.stage_agents["group"].test_context() as agent:  # type: ignore[attr-defined]
        for sent in outbox.to(f"{NS}.trajectories"):
            assert sent.key is not None
            next_offset(app, agent, "group", partition(sent.key))
            await agent.put(sent.value, key=sent.key, partition=partition(sent.key))


def decoded(outbox: MemoryOutbox, topic: str) -> list[Any]:
    return [codec.decode(s.value) for s in outbox.to(f"{NS}.{topic}")]


def episode_messages(*episodes: Episode, ts: int = 1_000) -> list[tuple[bytes, bytes]]:
    return [(e.episode_id.encode(), codec.encode(e)) for ep in episodes for e in events_of(ep, ts)]


def test_assemble_cleans_dedupes_and_publishes_every_ended_episode() -> None:
    stream = recorded_stream()
    app, outbox = make_app()
    asyncio.run(put_events(app, stream.messages))
    trajectories = decoded(outbox, "trajectories")
    ended = {e.trajectory_id for e in stream.episodes if e.status is not None}
    assert sorted(t.trajectory_id for t in trajectories) == sorted(ended)
    assert all(s.key == codec.decode(s.value).group_id.encode() for s in outbox.to(f"{NS}.trajectories"))
    assert all(t.reward_fn == "default" and t.reward_components for t in trajectories)
    letters = decoded(outbox, "rollout.deadletter")
    assert Counter(d.reason for d in letters) == stream.expect_reasons
    metrics = app.pipeline.metrics  # type: ignore[attr-defined]
    assert metrics.total("streams/duplicates") == stream.duplicates
    # every input event is accounted for: folded into an episode, dead-lettered, or a counted duplicate
    assert metrics.total("streams/events") == stream.events == (
        metrics.total("streams/accepted") + len(letters) + metrics.total("streams/duplicates"))


def test_dead_letters_carry_the_source_position_and_the_original_bytes() -> None:
    stream = recorded_stream()
    app, outbox = make_app()
    asyncio.run(put_events(app, stream.messages))
    originals = {value for _, value in stream.messages}
    for letter in decoded(outbox, "rollout.deadletter"):
        assert isinstance(letter, DeadLetter) and letter.source_topic == f"{NS}.rollout.events"
        assert letter.original in originals and letter.partition == partition(letter.key)
        assert letter.stage in ("clean", "assemble") and letter.detail


def test_table_writes_go_to_the_changelog_partition_of_the_episode() -> None:
    app, outbox = make_app()
    messages = episode_messages(Episode("ep-a", "g", "math", 2, True), Episode("ep-b", "g", "math", 2, False))
    asyncio.run(put_events(app, messages[:2]))  # ep-a half sent
    writes = [w for w in outbox.to(f"{NS}.streams-episodes-changelog") if w.key != counts_key(partition(b"ep-a"))]
    assert {(w.key, w.partition) for w in writes} == {(b"ep-a", partition(b"ep-a"))}
    assert load_episode(writes[-1].value).state.turns[0].text.endswith("7")  # type: ignore[arg-type]
    asyncio.run(put_events(app, messages[2:]))
    seen = {w.key: load_closed_episode(w.value) for w in outbox.to(f"{NS}.streams-seen-changelog")}  # type: ignore
    assert set(seen) == {b"ep-a", b"ep-b"} and seen[b"ep-a"].status == "completed"
    assert outbox.to(f"{NS}.streams-episodes-changelog")[-1].value is None  # ep-a's tombstone


def test_a_restarted_worker_recovers_a_half_sent_episode_from_the_changelog() -> None:
    ep = Episode("ep-half", "g", "code", 2, True, turns=2)
    messages = episode_messages(ep)
    first, outbox = make_app()
    asyncio.run(put_events(first, messages[:3]))
    second, outbox2 = make_app()
    for write in outbox.to(f"{NS}.streams-episodes-changelog"):  # what Faust replays on start
        second.pipeline.tables.episodes.table.data[write.key] = load_episode(write.value)  # type: ignore
    asyncio.run(put_events(second, messages[3:]))
    (traj,) = decoded(outbox2, "trajectories")
    assert traj.trajectory_id == ep.trajectory_id and len(traj.turns) == 2 and len(traj.source_offsets) == 6


def test_a_restarted_worker_completes_a_half_received_group_from_the_changelog() -> None:
    members = [Episode(f"ep-h{i}", "g-h", "math", 4, i % 2 == 0) for i in range(4)]
    first, outbox = make_app()
    asyncio.run(put_events(first, episode_messages(*members)))
    trajectories = outbox.to(f"{NS}.trajectories")
    outbox.sent = [s for s in outbox.sent if s.topic != f"{NS}.trajectories"]
    outbox.sent += trajectories[:3]
    asyncio.run(put_trajectories(first, outbox))
    assert decoded(outbox, "trajectories.scored") == []  # 3 of 4: the group waits
    writes = outbox.to(f"{NS}.streams-groups-changelog")
    # one value per member record, each written once, and the group's value holds no record
    records = [w for w in writes if w.value is not None and w.value.startswith(b"GRM1")]
    groups = [w.value for w in writes if w.key == b"g-h" and w.value is not None]
    assert len(records) == 3 and groups and all(r.value[4:] not in g for r in records for g in groups)  # type: ignore

    second, outbox2 = make_app()
    for write in writes:  # what Faust replays on start
        second.pipeline.tables.groups.table.data[write.key] = load_group(write.value)  # type: ignore
    outbox2.sent = [trajectories[3]]
    asyncio.run(put_trajectories(second, outbox2))
    scored = outbox2.to(f"{NS}.trajectories.scored")
    assert len(scored) == 4
    by_id = {codec.decode(t.value).trajectory_id: codec.decode(t.value) for t in scored}
    assert set(by_id) == {m.trajectory_id for m in members}
    assert abs(sum(t.advantage for t in by_id.values())) < 1e-9
    assert all(t.turns for t in by_id.values())  # recovered members' records are whole
    tombstones = {w.key for w in outbox2.to(f"{NS}.streams-groups-changelog") if w.value is None}
    assert tombstones == {r.key for r in records}  # the closed group's member records are forgotten


def big_turn(ep: Episode, tokens: int, ts: int = 1_000) -> list[tuple[bytes, bytes]]:
    out = []
    for event in events_of(ep, ts):
        if isinstance(event.body, PolicyTurn):
            event = replace(event, body=replace(event.body, tokens=pack_ids([7] * tokens),
                                                logprobs=pack_floats([-0.5] * tokens)))
        out.append((ep.episode_id.encode(), codec.encode(event)))
    return out


def test_what_would_not_fit_a_record_is_dead_lettered_as_oversize_and_the_worker_goes_on() -> None:
    app, outbox = make_app(max_record_bytes=65_536)
    big = Episode("ep-big", "g-big", "math", 2, False, status=None, turns=3)
    fine = Episode("ep-small", "g-small", "math", 2, True)
    messages = big_turn(big, 3_000)  # three turns of 24 KB: its changelog value outgrows a record
    asyncio.run(put_events(app, messages[:-1]))  # started and two turns in: it fits
    assert decoded(outbox, "rollout.deadletter") == []
    asyncio.run(put_events(app, messages[-1:] + episode_messages(fine)))
    (letter,) = decoded(outbox, "rollout.deadletter")
    assert (letter.key, letter.reason, letter.stage) == (b"ep-big", "oversize", "assemble")
    assert letter.original == b"" and "not copied here" in letter.detail  # the dead letter fits a record too
    assert all(len(s.value or b"") <= 65_536 for s in outbox.sent)
    assert [t.episode_id for t in decoded(outbox, "trajectories")] == ["ep-small"]
    asyncio.run(put_events(app, big_turn(replace(big, status="completed"), 10)[-1:]))  # its end comes later
    assert decoded(outbox, "rollout.deadletter")[-1].reason == "unknown_episode"  # late, not a new episode


def test_late_duplicates_after_close_are_counted_and_late_events_dead_lettered() -> None:
    ep = Episode("ep-c", "g", "math", 2, True)
    messages = episode_messages(ep)
    late = replace(events_of(ep, 1_000)[1], event_id="ep-c-late", seq=9)
    app, outbox = make_app()
    asyncio.run(put_events(app, messages + [messages[-1], messages[0], (b"ep-c", codec.encode(late))]))
    assert app.pipeline.metrics.total("streams/duplicates") == 2  # type: ignore[attr-defined]
    (letter,) = decoded(outbox, "rollout.deadletter")
    assert letter.reason == "unknown_episode" and "closed as completed" in letter.detail
    assert len(decoded(outbox, "trajectories")) == 1


def test_the_sweeper_abandons_idle_episodes_and_times_out_groups() -> None:
    app, outbox = make_app(episode_timeout_s=0.05, group_timeout_s=0.05, sweep_interval_s=0.05)
    ended = Episode("ep-d0", "g-d", "math", 3, True)
    idle = Episode("ep-d1", "g-d", "math", 3, False, status=None)

    async def scenario() -> None:
        await put_events(app, episode_messages(ended, idle))
        await asyncio.sleep(0.1)
        await app.pipeline.sweep()  # type: ignore[attr-defined]
        await put_trajectories(app, outbox)
        await asyncio.sleep(0.1)
        await app.pipeline.sweep()  # type: ignore[attr-defined]

    asyncio.run(scenario())
    by_status = {t.status: t for t in decoded(outbox, "trajectories")}
    assert set(by_status) == {"completed", "abandoned"} and by_status["abandoned"].trajectory_id == idle.trajectory_id
    assert len(by_status["abandoned"].turns) == 1
    metrics = app.pipeline.metrics  # type: ignore[attr-defined]
    assert metrics.total("streams/abandoned") == 1
    assert metrics.total("streams/groups", outcome="timed_out") == 1
    assert decoded(outbox, "trajectories.scored") == []  # one trainable member: no variance, dropped
    assert [s.attempts for s in decoded(outbox, "task.stats")] == [1]


def test_idle_time_counts_from_when_the_worker_is_ready_again_not_through_its_recovery() -> None:
    app, outbox = make_app(episode_timeout_s=0.3, group_timeout_s=0.3, sweep_interval_s=0.05)
    pipeline = app.pipeline  # type: ignore[attr-defined]
    waiting = Episode("ep-r0", "g-r", "math", 2, False, status=None)  # its next events are still in the log

    async def scenario() -> list[str]:
        await put_events(app, episode_messages(waiting))
        pipeline.ready = lambda: False  # a restart: recovering tables, rebalancing
        await asyncio.sleep(0.5)  # longer than the timeout
        await pipeline.sweep()
        pipeline.ready = lambda: True
        await pipeline.sweep()  # ready again: the episode has been idle 0 s for this worker
        kept = [t.status for t in decoded(outbox, "trajectories")]
        await asyncio.sleep(0.4)
        await pipeline.sweep()  # now idle past the timeout while the worker could read the log
        return kept

    assert asyncio.run(scenario()) == []
    assert [t.status for t in decoded(outbox, "trajectories")] == ["abandoned"]


def test_idle_time_stops_while_no_broker_answers_and_counts_again_from_its_return() -> None:
    """A broker outage longer than the timeout: producers hold their events back until it returns, so an
    episode open across it is not abandoned (its late events would be dead-lettered as unknown_episode)."""
    app, outbox = make_app(episode_timeout_s=0.3, group_timeout_s=0.3, sweep_interval_s=0.05)
    pipeline = app.pipeline  # type: ignore[attr-defined]
    waiting = Episode("ep-o0", "g-o", "math", 2, False, status=None)

    async def scenario() -> list[str]:
        await put_events(app, episode_messages(waiting))
        outbox.up = False  # the broker is away
        await asyncio.sleep(0.5)  # longer than the timeout
        await pipeline.sweep()
        outbox.up = True
        await pipeline.sweep()  # it answers again: idle 0 s since
        kept = [t.status for t in decoded(outbox, "trajectories")]
        await asyncio.sleep(0.4)
        await pipeline.sweep()  # idle past the timeout with a broker answering
        return kept

    assert asyncio.run(scenario()) == []
    assert [t.status for t in decoded(outbox, "trajectories")] == ["abandoned"]


def same_partition_episodes(prefix: str, n: int) -> list[Episode]:
    """n never-ending episodes whose events share one partition (idleness is per partition)."""
    eps = [Episode(f"{prefix}-{i}", f"g-{prefix}-{i}", "math", 2, False, status=None) for i in range(200)]
    target = partition(eps[0].episode_id.encode())
    return [ep for ep in eps if partition(ep.episode_id.encode()) == target][:n]


def sweep_after(app: StreamsApp, batches: list[list[tuple[bytes, bytes]]]) -> None:
    async def scenario() -> None:
        for messages in batches:
            await put_events(app, messages)
        await app.pipeline.sweep()  # type: ignore[attr-defined]

    asyncio.run(scenario())


def test_one_timestamp_from_the_future_abandons_no_open_episode() -> None:
    now = int(time.time() * 1000)
    app, outbox = make_app(episode_timeout_s=20, group_timeout_s=20)
    first, second, liar = same_partition_episodes("skew", 3)
    sweep_after(app, [episode_messages(first, second, ts=now), episode_messages(liar, ts=now + 3_600_000)])
    assert decoded(outbox, "trajectories") == []  # an hour "later" is capped at the worker's clock + 2 s
    assert app.pipeline.metrics.total("streams/clock_skew_clamped") == 2  # type: ignore[attr-defined]


def test_producers_ten_minutes_apart_share_a_partition_without_abandoning_each_other() -> None:
    now = int(time.time() * 1000)
    behind, on_time = same_partition_episodes("apart", 2)
    first = from_producer("behind", behind, ts=now - 600_000)
    app, outbox = make_app(episode_timeout_s=20, group_timeout_s=20)
    sweep_after(app, [first, from_producer("on-time", on_time, ts=now)])
    assert decoded(outbox, "trajectories") == []
    # ...while event time still ages episodes at the log's pace: 30 s later in its producer's clock (a
    # replay: no wall time passes), the one that got no more events is abandoned, the other one is not
    (later,) = same_partition_episodes("later", 1)
    app, outbox = make_app(episode_timeout_s=20, group_timeout_s=20)
    sweep_after(app, [first, from_producer("on-time", on_time, ts=now),
                      from_producer("behind", later, ts=now - 570_000)])
    abandoned = {t.episode_id for t in decoded(outbox, "trajectories") if t.status == "abandoned"}
    assert abandoned == {behind.episode_id}


def from_producer(producer: str, episode: Episode, ts: int) -> list[tuple[bytes, bytes]]:
    return [(e.episode_id.encode(), codec.encode(replace(e, producer_id=producer))) for e in events_of(episode, ts)]


def test_group_emits_advantages_for_exactly_the_expected_members() -> None:
    stream = recorded_stream()
    app, outbox = make_app(episode_timeout_s=0.05, group_timeout_s=0.05, sweep_interval_s=0.05)

    async def scenario() -> None:
        await put_events(app, stream.messages)
        await asyncio.sleep(0.1)
        await app.pipeline.sweep()  # type: ignore[attr-defined]
        await put_trajectories(app, outbox)
        await asyncio.sleep(0.1)
        await app.pipeline.sweep()  # type: ignore[attr-defined]

    asyncio.run(scenario())
    scored = decoded(outbox, "trajectories.scored")
    assert sorted(t.trajectory_id for t in scored) == sorted(stream.expect_scored)
    by_group: dict[str, list[Trajectory]] = {}
    for t in scored:
        by_group.setdefault(t.group_id, []).append(t)
    for members in by_group.values():
        assert abs(sum(t.advantage for t in members)) < 1e-6
        assert all((t.advantage > 0) == (t.reward > members[0].group_reward_mean) for t in members)
    metrics = app.pipeline.metrics  # type: ignore[attr-defined]
    assert metrics.total("streams/zero_variance_groups") == stream.zero_variance_groups
    assert metrics.total("streams/groups", outcome="timed_out") == stream.timed_out_groups
    stats = {s.task_id: s for s in decoded(outbox, "task.stats")}
    assert isinstance(stats["math/g-math-allright"], TaskStats)
    assert (stats["math/g-math-allright"].attempts, stats["math/g-math-allright"].passes) == (4, 4)


def test_a_group_agent_ignores_duplicate_and_late_trajectories() -> None:
    app, outbox = make_app()
    asyncio.run(put_events(app, episode_messages(Episode("ep-e0", "g-e", "math", 2, True),
                                                 Episode("ep-e1", "g-e", "math", 2, False))))
    outbox.sent += outbox.to(f"{NS}.trajectories")  # every trajectory arrives twice (a re-emit after a crash)
    asyncio.run(put_trajectories(app, outbox))
    assert len(decoded(outbox, "trajectories.scored")) == 2
    assert app.pipeline.metrics.total("streams/duplicate_trajectories") == 2  # type: ignore[attr-defined]


def test_a_reward_function_that_raises_dead_letters_the_trajectory_and_the_worker_goes_on() -> None:
    def picky(t: Trajectory) -> RewardResult:
        if t.episode_id == "ep-f0":
            raise KeyError("answer")
        return RewardResult(1.0, {"outcome/correct": 1.0})

    app, outbox = make_app(scorer=Scorer("picky", "1", picky))
    asyncio.run(put_events(app, episode_messages(Episode("ep-f0", "g", "math", 2, True),
                                                 Episode("ep-f1", "g", "math", 2, True))))
    (letter,) = decoded(outbox, "rollout.deadletter")
    assert letter.reason == "reward_error" and letter.stage == "score" and "KeyError" in letter.detail
    unscored = codec.decode(letter.original)
    assert isinstance(unscored, Trajectory) and unscored.episode_id == "ep-f0" and unscored.reward_fn == ""
    assert [t.episode_id for t in decoded(outbox, "trajectories")] == ["ep-f1"]


def test_a_poison_message_is_set_aside_and_the_worker_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    import streams.assembly

    real_fold = streams.assembly.fold

    def fold(state, event, position):  # type: ignore[no-untyped-def]
        if event.event_id.endswith("e001") and event.episode_id == "ep-g0":
            raise RuntimeError("a bug")
        return real_fold(state, event, position)

    monkeypatch.setattr(streams.assembly, "fold", fold)
    app, outbox = make_app()
    asyncio.run(put_events(app, episode_messages(Episode("ep-g0", "g", "math", 2, True),
                                                 Episode("ep-g1", "g", "math", 2, True))))
    reasons = [d.reason for d in decoded(outbox, "rollout.deadletter")]
    assert reasons[0] == "processing_error" and "a bug" in decoded(outbox, "rollout.deadletter")[0].detail
    assert "ep-g1" in [t.episode_id for t in decoded(outbox, "trajectories")]


def test_claim_checked_turns_are_resolved_or_dead_lettered() -> None:
    ep = Episode("ep-h", "g", "math", 2, True)
    events = events_of(ep, 1_000)
    slim, payload = split_payload(events[1].body, "claims/unit/ep-h/1")
    store = {"claims/unit/ep-h/1": payload}

    def resolve(event: RolloutEvent) -> RolloutEvent:
        if event.body.claim.key not in store:  # type: ignore[union-attr]
            raise ValidationError("claim_unavailable", "gone")
        return replace(event, body=join_payload(event.body, store[event.body.claim.key]))  # type: ignore

    messages = [(b"ep-h", codec.encode(e)) for e in [events[0], replace(events[1], body=slim), *events[2:]]]
    app, outbox = make_app()
    app.pipeline.claims = resolve  # type: ignore[attr-defined]
    asyncio.run(put_events(app, messages))
    (traj,) = decoded(outbox, "trajectories")
    assert traj.turns[0].tokens == events[1].body.tokens
    store.clear()
    app2, outbox2 = make_app()
    app2.pipeline.claims = resolve  # type: ignore[attr-defined]
    asyncio.run(put_events(app2, messages))
    # the turn is set aside, so its EpisodeEnded no longer adds up: the episode waits to be abandoned
    assert [d.reason for d in decoded(outbox2, "rollout.deadletter")] == ["claim_unavailable", "bad_step"]
    assert decoded(outbox2, "trajectories") == []


def test_the_metrics_timer_publishes_a_window_in_event_time_and_the_cumulative_counters() -> None:
    app, outbox = make_app()
    ts = 1_500_000_000_000  # events from 2017: a replay of history
    messages = episode_messages(Episode("ep-i", "g", "table", 2, True), ts=ts)
    asyncio.run(put_events(app, messages))
    asyncio.run(app.pipeline.flush_metrics())  # type: ignore[attr-defined]
    metrics = decoded(outbox, "pipeline.metrics")
    assert all(isinstance(m, PipelineMetric) and m.source == "streams" for m in metrics)
    window = [m for m in metrics if not m.total]
    names = {(m.name, m.labels.get("domain", "")) for m in window}
    assert {("rollout/reward_mean", "table"), ("rollout/reward_std", "table"), ("streams/events_per_s", ""),
            ("streams/open_episodes", "")} <= names
    newest = max(codec.decode(v).ts for _, v in messages)
    assert {m.window_end for m in metrics} == {newest}  # the newest event's time, not the worker's clock
    totals = {(m.name, m.labels["partition"]): m.value for m in metrics if m.total}
    assert totals == {("streams/events", str(partition(b"ep-i"))): len(messages),
                      ("streams/accepted", str(partition(b"ep-i"))): len(messages),
                      ("streams/trajectories", str(partition(b"ep-i"))): 1}
    asyncio.run(put_events(app, episode_messages(Episode("ep-j", "g", "table", 2, True), ts=ts + 60_000)))
    asyncio.run(app.pipeline.flush_metrics())  # type: ignore[attr-defined]
    later = [m for m in decoded(outbox, "pipeline.metrics")[len(metrics):] if not m.total]
    assert {(m.window_start, m.window_end) for m in later} == {(newest, newest + 60_000)}


def test_each_table_reads_its_changelog_back_as_recovery_does() -> None:
    from faust.types import Message

    from streams.assembly import close
    from streams.state import dump_closed_episode, dump_episode

    app, outbox = make_app()
    ep = Episode("ep-j", "g", "math", 2, True)
    asyncio.run(put_events(app, episode_messages(ep)[:2]))
    written = outbox.to(f"{NS}.streams-episodes-changelog")[-1]
    tables = app.pipeline.tables  # type: ignore[attr-defined]

    async def read_back(table: Any, value: bytes) -> Any:
        topic = table.table.changelog_topic
        message = Message(topic.get_topic_name(), 0, 0, 0.0, 0, None, b"ep-j", value, None)
        return (await topic.decode(message)).value

    log = asyncio.run(read_back(tables.episodes, written.value))
    assert log == load_episode(written.value) and dump_episode(log) == written.value
    marker = close(log.state, "completed")
    assert asyncio.run(read_back(tables.seen, dump_closed_episode(marker))) == marker


def test_no_episode_or_group_is_marked_closed_before_its_output_is_flushed() -> None:
    app, outbox = make_app()
    episodes = [Episode("ep-k0", "g-k", "math", 2, True), Episode("ep-k1", "g-k", "math", 2, False)]
    asyncio.run(put_events(app, episode_messages(*episodes)))
    asyncio.run(put_trajectories(app, outbox))

    def first(topic: str, key: Optional[bytes] = None) -> int:
        return next(i for i, s in enumerate(outbox.sent) if s.topic == f"{NS}.{topic}" and key in (None, s.key))

    for ep in episodes:
        published = next(i for i, s in enumerate(outbox.sent) if s.topic == f"{NS}.trajectories"
                         and codec.decode(s.value).episode_id == ep.episode_id)
        marked = first("streams-seen-changelog", ep.episode_id.encode())
        assert any(published < f <= marked for f in outbox.flushed_at)
    closed = next(i for i, s in enumerate(outbox.sent) if s.topic == f"{NS}.streams-groups-changelog"
                  and s.value.startswith(b"GRC1"))  # type: ignore[union-attr]
    assert any(first("trajectories.scored") < f <= closed for f in outbox.flushed_at)


def test_after_a_rebalance_a_worker_sweeps_only_the_partitions_it_still_holds() -> None:
    """Two workers share the partitions: the one that lost partition 1 never abandons an episode of it (its
    new owner, which recovered it from the changelog, completes it: one trajectory id, one record)."""
    app, outbox = make_app(episode_timeout_s=0.05, group_timeout_s=0.05, sweep_interval_s=0.05)
    pipeline = app.pipeline  # type: ignore[attr-defined]
    kept, moved = same_partition_episodes("kept", 2), []
    for i in range(200):
        ep = Episode(f"moved-{i}", f"g-moved-{i}", "math", 2, False, status=None)
        if partition(ep.episode_id.encode()) != partition(kept[0].episode_id.encode()):
            moved.append(ep)
    moved = moved[:2]
    held = partition(kept[0].episode_id.encode())

    async def scenario() -> None:
        await put_events(app, episode_messages(*kept, *moved))
        assert len(pipeline.tables.episodes) == 4
        await pipeline.keep_partitions({held})
        await asyncio.sleep(0.1)
        await pipeline.sweep()

    asyncio.run(scenario())
    abandoned = {t.episode_id for t in decoded(outbox, "trajectories")}
    assert abandoned == {ep.episode_id for ep in kept}
    assert {p for p in pipeline.tables.episodes.partition_of.values()} <= {held}


def test_task_stats_are_published_per_partition_and_a_follower_sums_them() -> None:
    from producers.feeds import TaskStatsFollower

    app, outbox = make_app()
    # the same task in two groups whose trajectories land on different partitions
    groups, seen_partitions = [], set()
    for i in range(50):
        group = f"g-task-{i}"
        p = partition(group.encode())  # trajectories are keyed by group
        if p not in seen_partitions:
            seen_partitions.add(p)
            groups.append(group)
    eps = [Episode(f"{g}-e{j}", g, "math", 2, j == 0, task="math/shared") for g in groups for j in range(2)]

    async def scenario() -> None:
        await put_events(app, episode_messages(*eps))
        await put_trajectories(app, outbox)

    asyncio.run(scenario())
    sent = outbox.to(f"{NS}.task.stats")
    keys = {s.key for s in sent}
    assert len(keys) == len(groups) == P, keys  # one record per partition that counted the task
    stats: dict[str, tuple[int, int]] = {}
    follower = TaskStatsFollower.__new__(TaskStatsFollower)
    follower.stats, follower.parts = stats, {}
    for s in sent:
        assert s.key is not None
        follower.fold(s.key, codec.decode(s.value, TaskStats))
    assert stats == {"math/shared": (4, 2)}
    follower.fold(b"math/shared", TaskStats("math/shared", "math", 99, 99, 1))  # an earlier version's record
    assert stats == {"math/shared": (4, 2)}


class _Stopped:
    def __init__(self) -> None:
        self.loops = 0

    def is_set(self) -> bool:
        self.loops += 1
        return self.loops > 1  # one pass of the drain loop


def drain_once(app: Any, monkeypatch: pytest.MonkeyPatch, fetch: Callable[[], dict[Any, list[Any]]]
               ) -> tuple[list[tuple[Any, int]], list[tuple[int, int]], list[dict[Any, int]]]:
    """One pass of the worker's fetch loop over what `fetch` returns: (delivered, gaps, rewinds)."""
    consumer = app.consumer
    delivered: list[tuple[Any, int]] = []
    gaps: list[tuple[int, int]] = []
    rewinds: list[dict[Any, int]] = []

    async def callback(message: Any) -> None:
        delivered.append((message.tp, message.offset))

    async def add_gap(tp: Any, start: int, end: int) -> None:
        gaps.append((start, end))

    async def fetch_records(timeout: float) -> Any:
        records = fetch()
        return records, {tp: rs[-1].offset + 1 for tp, rs in records.items()}

    async def rewind(undelivered: dict[Any, int], positions: dict[Any, Optional[int]]) -> None:
        assert all(positions[tp] is not None for tp in undelivered)
        rewinds.append(undelivered)

    monkeypatch.setattr(consumer, "_fetch", fetch_records)
    monkeypatch.setattr(consumer, "_rewind", rewind)
    monkeypatch.setattr(consumer, "_add_gap", add_gap)
    monkeypatch.setattr(consumer, "callback", callback)
    monkeypatch.setattr(consumer, "_to_message", lambda tp, r: SimpleNamespace(tp=tp, offset=r.offset, topic=tp.topic))
    monkeypatch.setattr(consumer, "highwater", lambda tp: 1000)
    asyncio.run(consumer._drain_messages(SimpleNamespace(_stopped=_Stopped())))
    return delivered, gaps, rewinds


def test_records_fetched_before_a_rebalance_are_rewound_not_delivered_over_the_committed_offset(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A fetch that spans a rebalance returns records from their old positions (offset 50 on) while the
    rebalance sought the partition back to its committed offset (10). Delivered, offset 50 would make 11..49
    look acked (a gap) and the records fetched again from 10 would be dropped as already read: lost events,
    committed. They are left for the next fetch instead: the partition goes back to the first of them unless
    the seek moved it (which _rewind checks against the position the fetch left)."""
    from faust.types import TP

    app, _ = make_app()
    consumer = app.consumer
    tp = TP(f"{NS}.rollout.events", 0)
    consumer._read_offset[tp] = 49  # read up to 49 before the rebalance
    consumer._set_active_tps({tp})

    def fetch() -> dict[Any, list[Any]]:
        app.consumer_generation_id += 1  # the rebalance completes while the fetch is in flight
        consumer._read_offset[tp] = 10  # and seeks to the committed offset, as Faust's perform_seek does
        return {tp: [SimpleNamespace(offset=o) for o in (50, 51, 52)]}

    delivered, gaps, rewinds = drain_once(app, monkeypatch, fetch)
    assert delivered == [] and gaps == []
    assert rewinds == [{tp: 50}]


def test_records_of_a_partition_paused_since_the_fetch_are_rewound_and_the_others_delivered(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Recovery pauses the stream partitions while a fetch is in flight. Faust's loop dropped their records
    and relied on a seek to the committed offsets to fetch them again, which moves no partition without a
    committed offset: a worker that took over such a partition (its last owner killed before committing)
    never saw its events. They go back to the first undelivered record; the active partition is delivered."""
    from faust.types import TP

    app, _ = make_app()
    consumer = app.consumer
    events, trajectories = TP(f"{NS}.rollout.events", 0), TP(f"{NS}.trajectories", 1)
    consumer._set_active_tps({events, trajectories})

    def fetch() -> dict[Any, list[Any]]:
        consumer.pause_partitions({events})
        return {events: [SimpleNamespace(offset=o) for o in range(3)],
                trajectories: [SimpleNamespace(offset=o) for o in (7, 8)]}

    delivered, gaps, rewinds = drain_once(app, monkeypatch, fetch)
    assert delivered == [(trajectories, 7), (trajectories, 8)] and gaps == []
    assert rewinds == [{events: 0}]


# ---- counters across a crash ------------------------------------------------------------------------------

LOADERS = {"episodes": load_episode, "seen": load_closed_episode, "groups": load_group, "taskstats": load_task_count}


def landed(outbox: MemoryOutbox, rng: random.Random) -> list[Any]:
    """What a kill -9 can leave on the broker: everything sent before some flush returned, then of what was
    sent after it (until the next flush), a prefix of each topic partition (an idempotent producer keeps
    each partition's order and never leaves a gap)."""
    barriers = [0, *outbox.flushed_at]
    cut = rng.randrange(len(barriers))
    start, end = barriers[cut], (barriers[cut + 1] if cut + 1 < len(barriers) else len(outbox.sent))
    tail = outbox.sent[start:end]
    keep = {(s.topic, s.partition): rng.randint(0, sum(1 for t in tail if (t.topic, t.partition) == (s.topic,
                                                                                                   s.partition)))
            for s in tail}
    out = list(outbox.sent[:start])
    for sent in tail:
        if keep[(sent.topic, sent.partition)] > 0:
            keep[(sent.topic, sent.partition)] -= 1
            out.append(sent)
    return out


def recover(app: StreamsApp, writes: list[Any]) -> None:
    """The tables as Faust recovers them from these changelog records."""
    for name, load in LOADERS.items():
        data = getattr(app.pipeline.tables, name).table.data  # type: ignore[attr-defined]
        for write in writes:
            if write.topic == f"{NS}.streams-{name}-changelog":
                if write.value is None:
                    data.pop(write.key, None)
                else:
                    data[write.key] = load(write.value)


def totals(app: StreamsApp) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for record in counting.records("streams", (app.pipeline.episode_tally,), 0):  # type: ignore[attr-defined]
        key = (record.name, tuple(sorted(record.labels.items())))
        out[key] = out.get(key, 0.0) + record.value
    return out


@pytest.mark.parametrize("seed", range(6))
def test_counters_after_a_crash_anywhere_and_a_replay_from_the_start_equal_one_clean_pass(seed: int) -> None:
    stream = recorded_stream(seed=seed)
    rng = random.Random(seed)
    clean, _ = make_app()
    asyncio.run(put_events(clean, stream.messages))
    crashed, outbox = make_app()
    asyncio.run(put_events(crashed, stream.messages[:rng.randrange(len(stream.messages))]))
    restarted, _ = make_app()
    recover(restarted, landed(outbox, rng))
    asyncio.run(put_events(restarted, stream.messages))  # nothing was committed: the whole log again
    want = totals(clean)
    assert want[("streams/events", (("partition", "0"),))] > 0
    assert totals(restarted) == want


def markers(app: StreamsApp) -> tuple[set[bytes], set[bytes]]:
    """The keys of the closed-episode and closed-group markers the worker holds."""
    from streams.grouping import ClosedGroup

    tables = app.pipeline.tables  # type: ignore[attr-defined]
    return ({key for key, _ in tables.seen.items()},
            {key for key, value in tables.groups.items() if isinstance(value, ClosedGroup)})


def test_markers_past_the_dedupe_horizon_are_forgotten_recovered_ones_too_and_not_a_moment_before() -> None:
    """Closed markers are forgotten from an index kept in closing order: a restarted worker indexes the markers
    it recovered (their horizon starts anew), forgets them once past it, keeps its own newer ones until theirs
    ends, and writes a tombstone for each one it forgets."""
    horizon = dict(episode_timeout_s=0.2, group_timeout_s=0.2, sweep_interval_s=0.05, dedupe_horizon_s=1.0)
    first, outbox = make_app(**horizon)
    old = [Episode(f"ep-m{i}", "g-m", "math", 4, i % 2 == 0) for i in range(4)]
    asyncio.run(put_events(first, episode_messages(*old)))
    asyncio.run(put_trajectories(first, outbox))
    old_markers = markers(first)
    assert old_markers == ({ep.episode_id.encode() for ep in old}, {b"g-m"})

    second, outbox2 = make_app(**horizon)
    recover(second, outbox.sent)
    pipeline = second.pipeline  # type: ignore[attr-defined]
    new = [Episode(f"ep-n{i}", "g-n", "math", 2, i == 0) for i in range(2)]

    async def scenario() -> list[tuple[set[bytes], set[bytes]]]:
        await pipeline.sweep()  # ready: indexes what it recovered
        pipeline.prune()
        seen = [markers(second)]  # nothing is past the horizon yet
        await asyncio.sleep(0.6)
        await put_events(second, episode_messages(*new))
        await put_trajectories(second, outbox2)
        assert pipeline.event_time.clocks  # the new episodes' producer clock
        await asyncio.sleep(0.6)  # the recovered markers are 1.2 s old, the new ones 0.6 s
        pipeline.prune()
        assert pipeline.event_time.clocks == {}  # no open episode uses it any more
        seen.append(markers(second))
        await asyncio.sleep(0.6)
        pipeline.prune()
        seen.append(markers(second))
        return seen

    before, after_old, after_new = asyncio.run(scenario())
    new_markers = ({ep.episode_id.encode() for ep in new}, {b"g-n"})
    assert before == old_markers
    assert after_old == new_markers
    assert after_new == (set(), set())
    tombstones = {(s.topic.rsplit(".", 1)[1], s.key) for s in outbox2.sent if s.value is None  # (not members')
                  and s.topic.endswith(("seen-changelog", "groups-changelog")) and b"\x00" not in s.key}
    assert tombstones == {("streams-seen-changelog", key) for key in old_markers[0] | new_markers[0]} | \
        {("streams-groups-changelog", key) for key in old_markers[1] | new_markers[1]}


def test_a_restarted_worker_times_out_an_open_group_it_recovered() -> None:
    members = [Episode(f"ep-q{i}", "g-q", "math", 4, i % 2 == 0) for i in range(4)]
    first, outbox = make_app()
    asyncio.run(put_events(first, episode_messages(*members)))
    trajectories = outbox.to(f"{NS}.trajectories")
    outbox.sent = [s for s in outbox.sent if s.topic != f"{NS}.trajectories"] + trajectories[:3]
    asyncio.run(put_trajectories(first, outbox))  # 3 of 4 members: the group stays open

    second, outbox2 = make_app(episode_timeout_s=0.1, group_timeout_s=0.1, sweep_interval_s=0.05)
    recover(second, outbox.sent)
    pipeline = second.pipeline  # type: ignore[attr-defined]

    async def scenario() -> None:
        await pipeline.sweep()
        await asyncio.sleep(0.2)
        await pipeline.sweep()

    asyncio.run(scenario())
    assert pipeline.metrics.total("streams/groups", outcome="timed_out") == 1
    assert len(decoded(outbox2, "trajectories.scored")) == 3
    assert markers(second)[1] == {b"g-q"} and pipeline.open_groups == {}


def test_a_stream_stopped_while_a_small_batch_waits_to_fill_ends_its_agent_quietly() -> None:
    """Faust stops an agent by throwing StopAsyncIteration into its channel's queue. Thrown while a
    small batch waited to fill, it used to escape the batch's drain as RuntimeError('async generator
    raised StopAsyncIteration'): the agent crashed, its supervisor restarted it mid-stop and the worker
    never exited. The unfinished batch is not handed on: its events were not acked, so they come again."""
    app, _ = make_app(batch_wait_s=0.5)
    app.flow_control.resume()

    async def stop_while_waiting() -> list[list[Any]]:
        stream = app.stream(aiter(app.channel()))
        queue = aiter(stream.channel).queue  # type: ignore[attr-defined]
        budget = Budget(10)
        await queue.put(Chunk(None, ("events", 0), [Record("events", 0, 0, b"k", b"v", 0)], budget))
        handed: list[list[Any]] = []

        async def agent() -> None:
            async for batch in batches(stream, max_size=10, wait_s=0.5):
                handed.append(batch)

        running = asyncio.ensure_future(agent())
        await asyncio.sleep(0.1)  # the agent holds a batch of one and waits for more
        await queue.throw(StopAsyncIteration())
        await asyncio.wait_for(running, 5)
        return handed

    assert asyncio.run(stop_while_waiting()) == []


def test_a_batch_takes_whole_chunks_and_the_one_that_would_overfill_it_starts_the_next() -> None:
    """The consumer hands a partition's records to its agent in chunks (streams.runtime.Chunk): a batch never
    splits one and never grows past its maximum; each chunk leaves the channel's budget once, when taken."""
    app, _ = make_app()
    app.flow_control.resume()
    budget = Budget(100)

    def chunk(first: int, n: int) -> Chunk:
        return Chunk(None, ("events", 0), [Record("events", 0, o, b"k", b"v", 0) for o in range(first, first + n)],
                     budget)

    async def scenario() -> list[list[int]]:
        stream = app.stream(aiter(app.channel()))
        queue = aiter(stream.channel).queue  # type: ignore[attr-defined]
        for first in (0, 3, 6, 9):
            queue.put_nowait(chunk(first, 3))
        budget.pending = 12
        taken: list[list[int]] = []
        async for batch in batches(stream, max_size=5, wait_s=0.0):
            taken.append([m.offset for m in batch.messages])
            if sum(map(len, taken)) == 12:
                break
        return taken

    assert asyncio.run(scenario()) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert budget.pending == 0 and budget.drained.is_set()


def test_acking_chunks_makes_their_offsets_committable_up_to_the_first_gap() -> None:
    """`BatchConsumer.ack_offsets` is Faust's ack bookkeeping for a chunk's offsets: a chunk acked out of order
    leaves the gap before it uncommitted until the chunk in between is acked too; an offset acked twice counts
    once, and offsets below the committed one are ignored."""
    from faust.types import TP

    app, _ = make_app()
    consumer = app.consumer
    topic = f"{NS}.rollout.events"
    app.topics._acking_topics.add(topic)  # as the conductor indexes an agent's topic once the worker starts
    tp = TP(topic, 0)
    consumer._committed_offset[tp] = 2
    consumer.ack_offsets(tp, topic, [0, 1, 2, 3])
    consumer.ack_offsets(tp, topic, [7, 8])
    assert consumer._new_offset(tp) == 4  # 2, 3 acked; 4..6 not yet
    consumer._committed_offset[tp] = 4  # as the commit of that offset leaves it
    consumer.ack_offsets(tp, topic, [4, 5, 6, 7])
    assert consumer._n_acked == 7  # 2, 3, 7, 8, 4, 5, 6: the second 7 is not counted again
    assert consumer._new_offset(tp) == 9


def test_the_figures_of_two_workers_add_up_in_the_monitor() -> None:
    """Stream workers share the partitions: each one's windows (open episodes, events/s) are its own series, so
    the monitor sums them instead of showing whichever worker published last."""
    from consumers.monitoring import PipelineStats
    from schemas.topics import Topics

    stats = PipelineStats(Topics(NS, P))
    published: dict[str, dict[str, float]] = {}
    for worker, episodes in (("w1", [Episode("ep-w1", "g-w1", "math", 2, True)]),
                             ("w2", [Episode(f"ep-w2-{i}", "g-w2", "math", 2, True) for i in range(2)])):
        outbox = MemoryOutbox()
        app = build_app(StreamSettings(ns=NS, partitions=P, batch_wait_s=0.0), outbox=outbox, worker=worker)
        opened = [m for ep in episodes for m in episode_messages(ep)[:2]]  # started, one turn: still open
        asyncio.run(put_events(app, opened))
        asyncio.run(app.pipeline.flush_metrics())  # type: ignore[attr-defined]
        for sent in outbox.to(f"{NS}.pipeline.metrics"):
            metric = codec.decode(sent.value)
            if not metric.total:
                assert metric.labels["worker"] == worker
                published.setdefault(metric.name, {})[worker] = metric.value
            stats.observe(f"{NS}.pipeline.metrics", 1_700_000_000_000, sent.value)
    assert published["streams/open_episodes"] == {"w1": 1.0, "w2": 2.0}
    headline = stats.headline()
    assert headline["streams/open_episodes"] == 3.0
    assert headline["streams/events_per_s"] == sum(published["streams/events_per_s"].values()) > 0
