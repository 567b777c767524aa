"""Each Faust agent and timer of the streams worker through `agent.test_context()`: no broker, an in-memory outbox."""
from __future__ import annotations

import asyncio
import zlib
from collections import Counter
from dataclasses import replace
from typing import Any, Optional

import pytest

from schemas.codec import codec
from schemas.errors import ValidationError
from schemas.packing import join_payload, split_payload
from schemas.records import DeadLetter, PipelineMetric, RolloutEvent, TaskStats, Trajectory
from streams.app import build_app
from streams.outbox import MemoryOutbox
from streams.rewards import RewardResult
from streams.runtime import StreamsApp
from streams.scoring import Scorer
from streams.settings import StreamSettings
from streams.state import load_closed_episode, load_episode
from tests.streams_data import Episode, events_of, recorded_stream

NS = "unit"
P = 2


def make_app(scorer: Optional[Scorer] = None, **overrides: Any) -> tuple[StreamsApp, MemoryOutbox]:
    outbox = MemoryOutbox()
    settings = StreamSettings(ns=NS, partitions=P, **{"batch_wait_s": 0.0, **overrides})
    return build_app(settings, outbox=outbox, scorer=scorer), outbox


def partition(key: bytes) -> int:
    return zlib.crc32(key) % P


async def put_events(app: StreamsApp, messages: list[tuple[bytes, bytes]]) -> None:
    async with app.stage_agents["assemble"].test_context() as agent:  # type: ignore[attr-defined]
        for key, value in messages:
            await agent.put(value, key=key, partition=partition(key), timestamp=1_700_000_000.0)


async def put_trajectories(app: StreamsApp, outbox: MemoryOutbox) -> None:
    async with app.stage_agents["group"].test_context() as agent:  # type: ignore[attr-defined]
        for sent in outbox.to(f"{NS}.trajectories"):
            assert sent.key is not None
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
    writes = outbox.to(f"{NS}.streams-episodes-changelog")
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


def test_late_duplicates_after_close_are_counted_and_late_events_dead_lettered() -> None:
    ep = Episode("ep-c", "g", "math", 2, True)
    messages = episode_messages(ep)
    late = replace(events_of(ep, 1_000)[1], event_id="ep-c-late")
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


def test_the_metrics_timer_publishes_a_window() -> None:
    app, outbox = make_app()
    asyncio.run(put_events(app, episode_messages(Episode("ep-i", "g", "table", 2, True))))
    asyncio.run(app.pipeline.flush_metrics())  # type: ignore[attr-defined]
    metrics = decoded(outbox, "pipeline.metrics")
    assert all(isinstance(m, PipelineMetric) and m.source == "streams" for m in metrics)
    names = {(m.name, m.labels.get("domain", "")) for m in metrics}
    assert {("rollout/reward_mean", "table"), ("rollout/reward_std", "table"), ("streams/events", ""),
            ("streams/events_per_s", ""), ("streams/open_episodes", "")} <= names


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
