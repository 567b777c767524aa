"""Replay selection: offsets and times, whole-episode filters, the copy loop, and the re-scoring summary."""
from __future__ import annotations

from dataclasses import replace
from typing import Iterator, Optional

import pytest

from consumers.replay import replay
from consumers.rescore import parse_reward, settled, summarise
from consumers.selection import EpisodeSelector, EventFilter, Window, parse_offsets, parse_time
from schemas import codec
from schemas.archive import ArchivedEvent
from schemas.errors import ConfigError
from schemas.records import RolloutEvent
from tests.taps import episode, trajectory

T0 = 1_700_000_000_000


def as_records(events: list[RolloutEvent], partition: int = 0, first_offset: int = 0,
               timestamps: Optional[list[int]] = None) -> list[ArchivedEvent]:
    return [ArchivedEvent("src.rollout.events", partition, first_offset + i,
                          timestamps[i] if timestamps else e.ts, e.episode_id.encode(), codec.encode(e))
            for i, e in enumerate(events)]


class FakeHistory:
    def __init__(self, recs: list[ArchivedEvent]) -> None:
        self.recs = recs
        self.stopped: set[int] = set()
        self.read = 0

    def records(self) -> Iterator[ArchivedEvent]:
        for rec in self.recs:
            if rec.partition not in self.stopped:
                self.read += 1
                yield rec

    def stop(self, partition: int) -> None:
        self.stopped.add(partition)


class ListSink:
    def __init__(self) -> None:
        self.sent: list[ArchivedEvent] = []
        self.closed = False

    def send(self, rec: ArchivedEvent) -> None:
        self.sent.append(rec)

    def close(self) -> None:
        self.closed = True


def run(recs: list[ArchivedEvent], window: Window = Window(),
        flt: EventFilter = EventFilter()) -> tuple[list[str], EpisodeSelector, FakeHistory]:
    selector, history, sink = EpisodeSelector(window, flt), FakeHistory(recs), ListSink()
    replay(history, selector, sink)  # type: ignore[arg-type]
    assert sink.closed
    return [r.key.decode() if r.key else "" for r in sink.sent], selector, history


def interleaved(*episodes: list[RolloutEvent]) -> list[RolloutEvent]:
    """Round-robin the events of several episodes, as concurrent rollouts land on one partition."""
    out: list[RolloutEvent] = []
    for i in range(max(len(e) for e in episodes)):
        out += [e[i] for e in episodes if i < len(e)]
    return out


def test_parse_offsets_and_times() -> None:
    assert parse_offsets("0:120, 1:80") == {0: 120, 1: 80}
    assert parse_offsets(None) == {}
    for bad in ("0-1", "a:1", "0:-1"):
        with pytest.raises(ConfigError):
            parse_offsets(bad)
    assert parse_time("1700000000000") == T0
    assert parse_time("2023-11-14T22:13:20Z") == T0
    assert parse_time("2023-11-14T22:13:20") == T0  # no zone means UTC
    assert parse_time("2023-11-15T00:13:20+02:00") == T0
    with pytest.raises(ConfigError):
        parse_time("yesterday")


def test_window_rejects_inverted_ranges_and_reads_half_open() -> None:
    with pytest.raises(ConfigError):
        Window(start={0: 10}, end={0: 5})
    with pytest.raises(ConfigError):
        Window(since=2, until=1)
    w = Window(start={0: 10}, end={0: 20}, since=100, until=200)
    assert w.contains(0, 10, 100) and w.contains(0, 19, 199)
    assert not w.contains(0, 9, 150) and not w.contains(0, 20, 150) and not w.contains(0, 15, 200)
    assert not w.contains(0, 15, 99) and w.contains(1, 0, 150)  # partition 1 has no offset bounds
    assert w.past(0, 20, 0) and w.past(1, 0, 200) and not w.past(1, 10**9, 199)


def test_an_unbounded_unfiltered_replay_is_a_verbatim_copy() -> None:
    recs = as_records(episode("a", T0)) + [ArchivedEvent("src.rollout.events", 0, 4, T0, None, b"garbage")]
    keys, selector, _ = run(recs)
    assert len(keys) == len(recs) and selector.stats.copied == len(recs) and not selector.needs_decoding


def test_time_window_selects_episodes_by_their_start_and_keeps_them_whole() -> None:
    before = episode("before", T0 - 2)  # starts before the window, ends inside it
    inside = episode("inside", T0 + 100)
    straddle = episode("straddle", T0 + 998)  # starts inside, ends after `until`
    after = episode("after", T0 + 1000)
    recs = as_records(before + inside + interleaved(straddle, after))
    keys, selector, _ = run(recs, Window(since=T0, until=T0 + 1000))
    assert keys == ["inside"] * 4 + ["straddle"] * 4
    assert selector.stats.episodes == 2 and selector.stats.partial == 2  # "before": its 2 events in the window


def test_offset_window_stops_each_partition_once_its_episodes_are_done() -> None:
    p0 = as_records(episode("x", T0) + episode("y", T0 + 10) + episode("z", T0 + 20), partition=0)
    p1 = as_records(episode("w", T0), partition=1)
    _, selector, history = run(p0 + p1, Window(start={0: 0}, end={0: 5}))
    assert selector.stats.episodes == 3  # x and y start below offset 5; w has no bounds on partition 1
    assert history.read == 8 + 4  # partition 0 stops where y ends: past the window, nothing open; z is never read


def test_filters_apply_to_whole_episodes_judged_on_their_first_event() -> None:
    math = episode("m", T0, domain="math", task_id="t-1", policy_version=3)
    code = episode("c", T0, domain="code", task_id="t-2", policy_version=3)
    # policy version 2 at the start, 9 later: the episode counts as version 2 and is kept whole
    drift = episode("d", T0, domain="math", task_id="t-3", versions=[2, 9, 9, 9])
    recs = as_records(interleaved(math, code, drift))
    assert set(run(recs, flt=EventFilter(domains=frozenset({"math"})))[0]) == {"m", "d"}
    assert set(run(recs, flt=EventFilter(task_ids=frozenset({"t-2"})))[0]) == {"c"}
    keys, selector, _ = run(recs, flt=EventFilter(policy_min=1, policy_max=2))
    assert keys == ["d"] * 4 and selector.stats.filtered == 8


def test_events_keep_partition_order_and_undecodable_ones_are_counted() -> None:
    recs = as_records(episode("a", T0))
    recs.insert(2, ArchivedEvent("src.rollout.events", 0, 99, T0, b"zzz", b"\xc3\x01broken"))
    keys, selector, _ = run(recs, flt=EventFilter(domains=frozenset({"math"})))
    assert keys == ["a"] * 4 and selector.stats.undecodable == 1


def test_an_episode_of_the_selected_key_keeps_its_undecodable_records() -> None:
    recs = as_records(episode("a", T0))
    recs.insert(2, ArchivedEvent("src.rollout.events", 0, 99, T0, b"a", b"\xc3\x01broken"))
    keys, _, _ = run(recs, flt=EventFilter(domains=frozenset({"math"})))
    assert keys == ["a"] * 5  # the streams stage dead-letters it again, as it did the first time


def test_rescore_summary_compares_with_the_source() -> None:
    old = {t.trajectory_id: t for t in (trajectory("a", 1.0), trajectory("b", 0.5, domain="code"))}
    new = [replace(t, reward_version="2") for t in old.values()]
    new[1] = replace(new[1], reward=0.0)
    s = summarise(new, old)
    assert s.trajectories == 2 and s.by_reward == {"default:2": 2}
    assert s.mean_by_domain == {"code": 0.0, "math": 1.0}
    assert (s.compared, s.changed, s.mean_delta) == (2, 1, -0.25)
    assert parse_reward("default:2") == ("default", "2")
    with pytest.raises(ConfigError):
        parse_reward("default")


def test_scored_output_settles_when_steady_and_consumed() -> None:
    steady = [(float(t), 7) for t in range(0, 16)]
    assert settled(steady, 15.0, all_consumed=True)
    assert not settled(steady, 15.0, all_consumed=False)
    assert settled(steady, 15.0, all_consumed=None)  # no commits to look at: a steady, non-empty output
    assert not settled([(float(t), 0) for t in range(16)], 15.0, all_consumed=None)
    assert not settled(steady[:-1] + [(15.0, 8)], 15.0, all_consumed=True)
    assert not settled(steady[:5], 15.0, all_consumed=True)
