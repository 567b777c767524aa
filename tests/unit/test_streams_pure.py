"""The pure functions of the streams worker: cleaning, assembly, scoring, grouping, metrics, state, settings."""
from __future__ import annotations

import io
import json
import math
from dataclasses import replace

import pytest
from fastavro import schemaless_writer

from schemas.codec import MAGIC, codec, to_avro
from schemas.errors import REASONS, ConfigError, DecodeError, RewardError, ValidationError
from schemas.keys import trajectory_id
from schemas.packing import pack_floats, pack_ids, split_payload
from schemas.records import (
    DEMONSTRATION_VERSION,
    ClaimCheck,
    EpisodeEnded,
    PolicyTurn,
    RolloutEvent,
    SandboxResult,
    SourcePosition,
    Trajectory,
)
from schemas.tasks import encode_task_spec, make_spec
from streams.eventtime import EventTime
from streams import assembly, fastcodec, grouping
from streams.assembly import ABANDONED, EpisodeState, fold
from streams.metrics import observe_trajectory, streams_metrics
from streams.rewards import RewardResult
from streams.scoring import Scorer
from streams.settings import StreamSettings, parse_reward
from streams.state import (
    EpisodeLog,
    StateFormatError,
    dump_closed_episode,
    dump_episode,
    dump_group,
    dump_task_count,
    load_closed_episode,
    load_episode,
    MemberRecord,
    load_group,
    load_task_count,
)
from streams.validation import Limits, decode_event, validate
from tests.streams_data import Episode, bad_messages, events_of

CODE = Episode("ep-1", "g-1", "code", group_size=2, right=True, turns=2)
MATH = Episode("ep-2", "g-1", "math", group_size=2, right=False)


def positions(n: int, partition: int = 1) -> list[SourcePosition]:
    return [SourcePosition(partition, 10 + i) for i in range(n)]


def folded(ep: Episode, upto: int | None = None) -> EpisodeState:
    events = events_of(ep, 1_000)[:upto]
    state = None
    for event, position in zip(events, positions(len(events))):
        state = fold(state, event, position)
    assert state is not None
    return state


def reason_of(event: RolloutEvent, limits: Limits = Limits()) -> str:
    with pytest.raises(ValidationError) as info:
        validate(event, limits)
    assert info.value.reason in REASONS
    return info.value.reason


# ---- validation ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", range(len(bad_messages(events_of(CODE, 1)[1]))))
def test_each_bad_message_is_refused_with_its_reason(case: int) -> None:
    reason, _, value = bad_messages(events_of(CODE, 1)[1])[case]
    if reason in ("bad_step", "unknown_episode"):  # need the episode's history: checked by fold
        validate(decode_event(value))
        return
    with pytest.raises((DecodeError, ValidationError)) as info:
        validate(decode_event(value))
    assert info.value.reason == reason  # type: ignore[attr-defined]


def test_every_event_of_a_good_episode_is_valid() -> None:
    for ep in (CODE, MATH):
        for event in events_of(ep, 1):
            validate(decode_event(codec.encode(event)))


def test_a_tombstone_is_a_truncated_message() -> None:
    with pytest.raises(DecodeError) as info:
        decode_event(None)
    assert info.value.reason == "truncated"


def test_content_rules() -> None:
    started, turn, result, ended = (e for e in events_of(Episode("e", "g", "code", 2, True), 1))
    assert reason_of(replace(started, body=replace(started.body, task_spec=""))) == "missing_field"
    assert reason_of(replace(started, body=replace(started.body, group_size=0))) == "bad_step"
    assert reason_of(replace(started, body=replace(started.body, group_size=5000))) == "oversize"
    assert reason_of(replace(started, body=replace(started.body, prompt_tokens=b"\x01\x02\x03"))) == "length_mismatch"
    assert reason_of(replace(turn, body=replace(turn.body, tokens=pack_ids(range(9)), logprobs=pack_floats([-1] * 9))),
                     Limits(max_tokens=8)) == "oversize"
    assert reason_of(replace(turn, body=replace(turn.body, tokens=b""))) == "missing_field"
    assert reason_of(replace(turn, body=replace(turn.body, logprobs=turn.body.logprobs[:-4] + pack_floats([-math.inf])))) \
        == "bad_logprob"
    assert reason_of(replace(turn, body=replace(turn.body, turn=-1))) == "bad_step"
    assert reason_of(replace(turn, body=replace(turn.body, claim=ClaimCheck("k", "0" * 64, 1)))) == "claim_unavailable"
    assert reason_of(replace(result, body=replace(result.body, outcome="exploded"))) == "schema_mismatch"
    assert reason_of(replace(result, body=replace(result.body, tests_passed=3))) == "bad_step"
    assert reason_of(replace(ended, body=replace(ended.body, status="done"))) == "schema_mismatch"
    assert reason_of(replace(ended, ts=0)) == "bad_step"
    assert reason_of(replace(ended, producer_id="")) == "missing_field"


def test_a_log_prob_a_hair_above_zero_is_float_rounding_not_an_error() -> None:
    turn = events_of(MATH, 1)[1]
    n = len(turn.body.tokens) // 4
    validate(replace(turn, body=replace(turn.body, logprobs=pack_floats([0.0] + [1e-7] * (n - 1)))))


# ---- assembly ------------------------------------------------------------------------------------------

def test_fold_builds_the_trajectory_with_lineage() -> None:
    state = folded(CODE)
    traj = assembly.to_trajectory(state, "ns.rollout.events")
    events = events_of(CODE, 1_000)
    assert traj.trajectory_id == trajectory_id("ep-1") and traj.status == "completed"
    assert traj.group_size == 2 and traj.task_spec == events[0].body.task_spec
    assert [t.turn for t in traj.turns] == [0, 1]
    assert [(t.outcome, t.tests_passed) for t in traj.turns] == [("failed", 0), ("passed", 1)]
    assert traj.turns[1].tokens == events[3].body.tokens and traj.turns[1].logprobs == events[3].body.logprobs
    assert traj.source_offsets == tuple(positions(len(events)))
    assert (traj.started_ts, traj.ended_ts) == (1_000, 1_000 + len(events) - 1)
    assert state.event_ids == tuple(e.event_id for e in events)


def test_duplicates_are_recognised_by_event_id() -> None:
    state = folded(MATH, upto=2)
    assert assembly.is_duplicate(state, events_of(MATH, 1_000)[1])
    assert not assembly.is_duplicate(state, events_of(MATH, 1_000)[2])


@pytest.mark.parametrize("mangle, detail", [
    (lambda ev: replace(ev, body=replace(ev.body, turn=0)) if isinstance(ev.body, PolicyTurn) and ev.body.turn == 1
     else ev, "must increase"),
    (lambda ev: replace(ev, body=replace(ev.body, turn=5)) if isinstance(ev.body, SandboxResult) else ev, "no PolicyTurn"),
    (lambda ev: replace(ev, body=replace(ev.body, num_turns=3)) if isinstance(ev.body, EpisodeEnded) else ev,
     "says 3 turns"),
    (lambda ev: replace(ev, group_id="other") if ev.seq == 2 else ev, "group_id"),
])
def test_steps_that_do_not_fit_the_episode_are_bad_steps(mangle, detail: str) -> None:  # type: ignore[no-untyped-def]
    state = None
    with pytest.raises(ValidationError) as info:
        for event, position in zip(events_of(CODE, 1), positions(99)):
            state = fold(state, mangle(event), position)
    assert info.value.reason == "bad_step" and detail in info.value.detail


def test_a_second_start_a_second_result_and_events_after_the_end_are_bad_steps() -> None:
    events = events_of(CODE, 1)
    state = folded(CODE, upto=3)
    for event in (events[0], events[2], replace(events[1], body=replace(events[1].body, turn=7))):
        with pytest.raises(ValidationError) as info:
            fold(state, replace(event, event_id="other"), SourcePosition(1, 99))
        assert info.value.reason == "bad_step"
    with pytest.raises(ValidationError, match="after EpisodeEnded"):
        fold(folded(CODE), replace(events[2], event_id="late"), SourcePosition(1, 99))


def test_an_episode_must_start_with_episode_started() -> None:
    with pytest.raises(ValidationError) as info:
        fold(None, events_of(MATH, 1)[1], SourcePosition(0, 0))
    assert info.value.reason == "unknown_episode"


def test_closed_episodes_tell_duplicates_from_late_events() -> None:
    state = folded(MATH)
    closed = assembly.close(state, "completed")
    events = events_of(MATH, 1_000)
    for event in events:  # a copy of any event taken is a duplicate: no error
        assembly.classify_late(closed, event)
    with pytest.raises(ValidationError) as info:
        assembly.classify_late(closed, replace(events[-1], event_id="new", seq=len(events)))
    assert info.value.reason == "unknown_episode" and "closed as completed" in info.value.detail
    # the marker's size does not grow with the episode's events (no event ids are kept)
    assert closed.last_seq == len(events) - 1 and closed.missing == () and "ids" not in dump_closed_episode(closed).decode()
    # an episode abandoned after three events: a copy of one of them is a duplicate, its fourth came late
    abandoned = assembly.close(folded(CODE, upto=3), ABANDONED)
    code = events_of(CODE, 1_000)
    assembly.classify_late(abandoned, code[0])
    with pytest.raises(ValidationError):
        assembly.classify_late(abandoned, code[3])


def test_an_abandoned_trajectory_ends_at_its_last_event() -> None:
    state = folded(CODE, upto=3)
    traj = assembly.to_trajectory(state, "t", ABANDONED)
    assert traj.status == "abandoned" and traj.ended_ts == 1_002 and len(traj.turns) == 1
    with pytest.raises(ValueError, match="has not ended"):
        assembly.to_trajectory(state, "t")


def test_idle_time_is_the_longer_of_event_time_and_wall_time() -> None:
    clock = EventTime(max_skew_ms=2_000, now_ms=lambda: 1_000_000)
    a, b = (0, "producer-a"), (0, "producer-b")
    clock.observe(a, 1_000)
    clock.touch(b"ep", a)
    clock.observe(a, 61_000)
    assert clock.idle_ms(b"ep", wall_idle_s=1.0) == 60_000
    assert clock.idle_ms(b"ep", wall_idle_s=90.0) == 90_000
    assert clock.idle_ms(b"recovered", wall_idle_s=1.0) == 1_000  # no clock known: wall time
    assert not clock.observe(b, 900_000)  # another producer's clock, far ahead, does not age producer-a's episodes
    assert clock.idle_ms(b"ep", wall_idle_s=1.0) == 60_000
    assert clock.observe(a, 5_000_000)  # from the future: capped at the worker's clock + 2 s
    assert clock.clocks[a] == 1_002_000
    assert not clock.observe(a, 500)  # a clock never goes back
    assert clock.clocks[a] == 1_002_000 and clock.age_ms(0, 2_000, wall_idle_s=0.0) == 1_000_000


def test_the_clocks_of_producers_no_open_episode_uses_are_let_go() -> None:
    """Each restarted rollout worker writes under a new producer id: a clock per id and partition would stay for the
    stream worker's life. Those no open episode was touched on go; the others keep their time."""
    clock = EventTime(max_skew_ms=2_000, now_ms=lambda: 1_000_000)
    for restart in range(1000):
        clock.observe((restart % 4, f"host-{restart}"), 1_000 + restart)
    live = (1, "host-999")
    clock.observe(live, 2_000)
    clock.touch(b"ep", live)
    clock.touch(b"done", (2, "host-998"))
    clock.forget(b"done")
    assert clock.forget_unused() == 1000 and list(clock.clocks) == [live]
    clock.observe(live, 32_000)
    assert clock.idle_ms(b"ep", wall_idle_s=0.0) == 30_000  # its clock kept its time
    assert clock.partitions == {0: 1_996, 1: 32_000, 2: 1_998, 3: 1_999}  # the watermarks stay
    clock.observe((3, "host-1000"), 40_000)  # a producer that writes again starts a clock again
    assert clock.clocks[(3, "host-1000")] == 40_000


def test_claim_checked_turns_are_filled_in_when_the_episode_closes() -> None:
    events = events_of(MATH, 1)
    full = events[1].body
    slim, _ = split_payload(full, "claims/x")
    state = None
    for event, position in zip([events[0], replace(events[1], body=slim), events[2]], positions(3)):
        state = fold(state, event, position)
    assert state is not None and state.turns[0].tokens == b"" and len(state.claims) == 1
    filled = assembly.with_payloads(state, {0: full})
    assert filled.turns[0].tokens == full.tokens and filled.claims == ()


# ---- scoring -------------------------------------------------------------------------------------------

def test_scoring_records_the_function_version_and_every_component() -> None:
    scored = Scorer.load("default", "1").score(assembly.to_trajectory(folded(CODE), "t"))
    assert (scored.reward_fn, scored.reward_version) == ("default", "1")
    assert scored.reward_components["outcome/tests_passed"] == 1.0 and scored.reward > 1.0
    assert list(scored.reward_components) == sorted(scored.reward_components)


def test_a_failing_or_non_finite_reward_is_a_reward_error() -> None:
    traj = assembly.to_trajectory(folded(MATH), "t")

    def boom(t: Trajectory) -> RewardResult:
        raise ZeroDivisionError("x")

    with pytest.raises(RewardError, match="ZeroDivisionError"):
        Scorer("boom", "1", boom).score(traj)
    with pytest.raises(RewardError, match="not finite"):
        Scorer("nan", "1", lambda t: RewardResult(1.0, {"c": math.nan})).score(traj)
    with pytest.raises(ConfigError, match="no reward function"):
        Scorer.load("nope", "1")


# ---- grouping ------------------------------------------------------------------------------------------

def scored(i: int, reward: float, status: str = "completed", group: str = "g", size: int = 4, **components: float
           ) -> Trajectory:
    base = assembly.to_trajectory(folded(replace(MATH, episode_id=f"ep-{i}", group_id=group)), "t", status)
    return replace(base, reward=reward, reward_components={"outcome/correct": float(reward >= 1), **components},
                   group_size=size, ended_ts=2_000 + i)


def member(trajectory: Trajectory) -> grouping.Member:
    raw = codec.encode(trajectory)
    return grouping.Member(fastcodec.read_summary(raw), raw)


def test_advantages_are_group_normalised_with_population_std() -> None:
    mean, std, advs = grouping.advantages([1.0, 0.0, 0.0, 1.0], eps=1e-6)
    assert (mean, std) == (0.5, 0.5)
    assert advs == pytest.approx([0.999998, -0.999998, -0.999998, 0.999998])
    assert grouping.advantages([0.3, 0.3], 1e-6)[2] == [0.0, 0.0]
    assert grouping.advantages([0.3], 1e-6)[2] == [0.0]


def test_a_group_is_complete_at_g_members_and_ignores_a_repeated_member() -> None:
    state = None
    for i in range(3):
        state = grouping.add_member(state, member(scored(i, float(i % 2))), partition=1)
    assert state is not None and not grouping.is_complete(state) and state.partition == 1
    assert grouping.add_member(state, member(scored(1, 1.0))) is state
    state = grouping.add_member(state, member(scored(3, 1.0)))
    assert grouping.is_complete(state) and state.first_ts == 2_000


def test_finalize_scores_trainable_members_only_sorted_by_id() -> None:
    members = [scored(0, 1.0), scored(1, 0.0), scored(2, 0.0, status="abandoned"),
               scored(3, 1.0, **{"status/not_trainable": 1.0})]
    state = None
    for t in reversed(members):
        state = grouping.add_member(state, member(t))
    assert state is not None
    result = grouping.finalize(state, eps=1e-6, drop_zero_variance=True)
    assert [m.trajectory_id for m, _ in result.scored] == sorted(t.trajectory_id for t in members[:2])
    assert {m.trajectory_id: round(a, 4) for m, a in result.scored} == {
        members[0].trajectory_id: 1.0, members[1].trajectory_id: -1.0}
    assert (result.mean, result.std, result.trainable, result.passes, result.ended_ts) == (0.5, 0.5, 2, 1, 2_003)
    out, advantage = result.scored[0]
    patched = fastcodec.with_advantage(out.raw, out.summary.advantage_at, advantage, result.mean, result.std)
    original = next(t for t in members if t.trajectory_id == out.trajectory_id)
    assert codec.decode(patched) == replace(original, advantage=advantage, group_reward_mean=0.5,
                                            group_reward_std=0.5)


def test_zero_variance_groups_are_dropped_or_kept_with_advantage_zero() -> None:
    state = None
    for i in range(2):
        state = grouping.add_member(state, member(scored(i, 1.0, size=2)))
    assert state is not None
    dropped = grouping.finalize(state, 1e-6, drop_zero_variance=True)
    kept = grouping.finalize(state, 1e-6, drop_zero_variance=False)
    assert dropped.zero_variance and dropped.dropped and dropped.scored == []
    assert not kept.dropped and [a for _, a in kept.scored] == [0.0, 0.0]
    assert dropped.passes == 2  # the curriculum still learns the task is solved


def test_task_stats_sum_the_partition_counts() -> None:
    result = grouping.GroupResult(scored=[], trainable=4, mean=0, std=0, zero_variance=False, dropped=False,
                                  passes=1, ended_ts=50)
    a = grouping.count_task(None, "math", result)
    a = grouping.count_task(a, "math", result)
    b = grouping.count_task(None, "math", replace(result, passes=4, ended_ts=70))
    stats = grouping.task_stats("t-1", [a, b])
    assert (stats.attempts, stats.passes, stats.ts, stats.domain) == (12, 6, 70, "math")


# ---- metrics -------------------------------------------------------------------------------------------

def test_metrics_windows_carry_rates_means_and_gauges_and_leave_the_counters_to_the_totals() -> None:
    m = streams_metrics()
    m.count("streams/events", 30)
    m.count("streams/deadletters", reason="bad_magic")
    m.count("streams/deadletters", 2, reason="truncated")
    for r in (0.0, 1.0):
        m.observe("rollout/reward", r, domain="math")
    m.gauge("streams/open_episodes", 7)
    # a window in event time (an hour of history) that took 10 s of wall time to process
    out = {(x.name, tuple(sorted(x.labels.items()))): x for x in m.flush(1_000, 3_601_000, seconds=10.0)}
    assert out[("streams/events_per_s", ())].value == 3.0
    assert not any(name == "streams/deadletters" for name, _ in out)  # cumulative records carry the counters
    assert out[("rollout/reward_mean", (("domain", "math"),))].value == 0.5
    assert out[("rollout/reward_std", (("domain", "math"),))].value == 0.5
    assert out[("streams/open_episodes", ())].value == 7
    assert all((x.window_start, x.window_end, x.source, x.total) == (1_000, 3_601_000, "streams", False)
               for x in out.values())
    assert [x.name for x in m.flush(11_000, 12_000)] == ["streams/events_per_s"]
    assert m.total("streams/deadletters") == 3 and m.total("streams/events") == 30


def test_a_trajectory_feeds_reward_length_and_sandbox_mix() -> None:
    m = streams_metrics()
    observe_trajectory(m, Scorer.load("default", "1").score(assembly.to_trajectory(folded(CODE), "t")))
    names = {(x.name, x.labels.get("outcome", x.labels.get("domain"))): x.value for x in m.flush(0, 1_000)}
    assert m.total("rollout/sandbox_outcomes", outcome="passed") == 1
    assert m.total("rollout/sandbox_outcomes", outcome="failed") == 1
    assert names[("rollout/episode_turns_mean", "code")] == 2
    assert ("rollout/reward_mean", "code") in names


# ---- table state ---------------------------------------------------------------------------------------

def test_an_episode_log_folds_back_to_the_same_state() -> None:
    events = events_of(CODE, 1_000)[:4]
    state = None
    for event, position in zip(events, positions(4)):
        state = fold(state, event, position)
    assert state is not None
    log = EpisodeLog(state, tuple(codec.encode(e) for e in events))
    assert load_episode(dump_episode(log)) == log
    with pytest.raises(StateFormatError):
        load_episode(dump_episode(log)[:-3])


def test_groups_markers_and_counts_round_trip() -> None:
    members = [scored(i, float(i % 2), size=3) for i in range(2)]
    state = None
    for t in members:
        state = grouping.add_member(state, member(t), partition=1)
    assert state is not None
    loaded = load_group(dump_group(state))  # the members' records are stored under their own keys
    assert loaded == replace(state, members=tuple(replace(m, raw=b"") for m in state.members))
    assert all(m.raw not in dump_group(state) for m in state.members)
    record = MemberRecord(state.members[0].raw)
    assert load_group(dump_group(record)) == record
    closed = grouping.close(state, timed_out=True)
    assert load_group(dump_group(closed)) == closed
    marker = assembly.close(folded(MATH), "completed")
    assert load_closed_episode(dump_closed_episode(marker)) == marker
    count = grouping.TaskCount("math", 3, 1, 99)
    assert load_task_count(dump_task_count(count)) == count


# ---- fast codec paths -------------------------------------------------------------------------------

def test_a_closed_marker_is_written_byte_for_byte_as_its_json() -> None:
    """The usual marker is formatted directly; the changelog must hold the same bytes the JSON writer makes."""
    markers = [assembly.ClosedEpisode("completed", 1_760_000_000_123, 4, (), 1),
               assembly.ClosedEpisode('odd "status" \\ é\n', 5, 0, (), 0),
               assembly.ClosedEpisode("abandoned", 7, 9, (2, 5), 3)]
    for marker in markers:
        doc = {"status": marker.status, "closed_ts": marker.closed_ts, "last_seq": marker.last_seq,
               "partition": marker.partition, **({"missing": list(marker.missing)} if marker.missing else {})}
        assert dump_closed_episode(marker) == json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()
        assert load_closed_episode(dump_closed_episode(marker)) == marker


def test_the_fast_event_decode_gives_what_the_codec_gives() -> None:
    from tests.streams_data import recorded_stream

    for _, value in recorded_stream().messages:
        try:
            expected = codec.decode(value, expect=RolloutEvent)
        except DecodeError as exc:
            with pytest.raises(DecodeError) as info:
                fastcodec.decode_event(value)
            assert info.value.reason == exc.reason
            continue
        got = fastcodec.decode_event(value)
        assert got == expected and repr(got) == repr(expected) and hash(got.body) == hash(expected.body)


def test_a_summary_reads_what_grouping_needs_and_an_old_trajectory_is_re_encoded_first() -> None:
    traj = replace(scored(3, 0.5, size=6), reward_components={"outcome/correct": 0.0, "penalty/overlong": 0.25})
    head = fastcodec.read_summary(codec.encode(traj))
    assert (head.trajectory_id, head.group_id, head.status, head.reward, head.ended_ts, head.group_size) == (
        traj.trajectory_id, "g", "completed", 0.5, 2_003, 6)
    assert head.reward_components == traj.reward_components
    with pytest.raises(DecodeError):
        fastcodec.read_summary(b"\xc3\x01garbage")
    with pytest.raises(DecodeError):
        fastcodec.read_summary(codec.encode(traj)[:-2])


# ---- settings and schema -------------------------------------------------------------------------------

def test_settings_from_the_command_line_and_the_environment() -> None:
    s = StreamSettings.from_args(["--ns", "run1", "--reward", "outcome:1", "--keep-zero-variance"],
                                 env={"TRAJPIPE_STREAMS_EPISODE_TIMEOUT_S": "30"})
    assert (s.reward_fn, s.reward_version, s.episode_timeout_s, s.drop_zero_variance) == ("outcome", "1", 30.0, False)
    assert s.topics.events == "run1.rollout.events" and parse_reward("default") == ("default", "1")


@pytest.mark.parametrize("argv, fix", [
    (["--reward", "default:"], "NAME:VERSION"),
    (["--episode-timeout-s", "0"], "--episode-timeout-s must be a positive number"),
    (["--episode-timeout-s", "7200", "--dedupe-horizon-s", "60"], "--dedupe-horizon-s (60.0) must be >="),
    (["--partitions", "0"], "--partitions must be >= 1"),
    (["--batch-max", "10", "--buffer-maxsize", "5"], "--buffer-maxsize (5) must be >="),
])
def test_bad_settings_are_refused_with_the_fix(argv: list[str], fix: str) -> None:
    with pytest.raises(ConfigError) as info:
        StreamSettings.from_args(["--ns", "run1", *argv], env={})
    assert fix in str(info.value)
    with pytest.raises(SystemExit):  # argparse: "the following arguments are required: --ns"
        StreamSettings.from_args([], env={})
    assert StreamSettings.from_args([], env={"TRAJPIPE_NS": "from-env"}).ns == "from-env"


def test_a_trajectory_written_before_group_size_reads_with_zero() -> None:
    old = next(e for e in codec.by_fingerprint.values() if e.name == "trajpipe.Trajectory" and e.version == 1)
    traj = scored(0, 1.0)
    fields = to_avro(traj)
    del fields["group_size"]
    buf = io.BytesIO()
    schemaless_writer(buf, old.parsed, fields)
    # Nor did it record the turns' sampling settings: they read as unrecorded (None).
    unrecorded = tuple(replace(t, temperature=None, top_p=None) for t in traj.turns)
    assert codec.decode(MAGIC + old.fingerprint + buf.getvalue()) == replace(traj, group_size=0, turns=unrecorded)


# ---- demonstrations and the text domain ------------------------------------------------------------------

def _as_demonstration(trajectory: Trajectory) -> Trajectory:
    return replace(trajectory, turns=tuple(replace(t, policy_version=DEMONSTRATION_VERSION) for t in trajectory.turns))


def test_a_group_of_one_demonstration_is_kept_while_a_lone_rollout_is_dropped() -> None:
    demo = _as_demonstration(scored(0, 1.0, size=1, **{"status/demonstration": 1.0}))
    kept = grouping.finalize(grouping.add_member(None, member(demo)), 1e-6, drop_zero_variance=True)
    assert kept.zero_variance and not kept.dropped and [a for _, a in kept.scored] == [0.0]
    lone = grouping.finalize(grouping.add_member(None, member(scored(1, 1.0, size=1))), 1e-6, True)
    assert lone.dropped and lone.scored == []


def test_the_reward_marks_a_demonstration_and_weighs_the_mark_zero() -> None:
    plain = assembly.to_trajectory(folded(replace(MATH, right=True)), "t")
    demo = _as_demonstration(plain)
    scorer = Scorer.load("default", "1")
    marked, unmarked = scorer.score(demo), scorer.score(plain)
    assert marked.reward_components["status/demonstration"] == 1.0
    assert "status/demonstration" not in unmarked.reward_components
    assert marked.reward == unmarked.reward


def test_only_the_demonstration_version_may_be_negative() -> None:
    event = events_of(MATH, 1_000)[0]
    validate(replace(event, policy_version=DEMONSTRATION_VERSION))
    assert reason_of(replace(event, policy_version=-2)) == "bad_step"


@pytest.mark.parametrize("text, correct, chars", [
    ("dcba", 1.0, 1.0), (" dcba\nmore", 1.0, 1.0), ("dcbx", 0.0, 0.75), ("dcbaa", 0.0, 0.8), ("", 0.0, 0.0),
])
def test_text_answers_are_exact_with_a_per_character_process_reward(text: str, correct: float, chars: float) -> None:
    from streams.rewards import measure

    base = assembly.to_trajectory(folded(replace(MATH, right=True)), "t")
    spec = encode_task_spec(make_spec("text", answer="dcba"))
    traj = replace(base, domain="text", task_spec=spec, turns=(replace(base.turns[0], text=text),))
    parts = measure(traj)
    assert (parts["outcome/correct"], parts["process/chars_correct"]) == (correct, pytest.approx(chars))
    assert parts["process/answer_found"] == float(bool(text.strip()))


def test_closed_markers_are_due_oldest_first_an_out_of_order_one_late_never_early_and_stale_entries_dropped() -> None:
    from streams.assembly import ClosedEpisode
    from streams.expiry import ClosedMarkers

    table: dict[bytes, ClosedEpisode] = {}
    queue = ClosedMarkers()

    def close(key: bytes, ts: int, partition: int = 0) -> None:
        table[key] = ClosedEpisode("completed", ts, 0, partition=partition)
        queue.add(partition, key, table[key])

    for key, ts in ((b"a", 100), (b"b", 300), (b"late", 50), (b"c", 400)):
        close(key, ts)
    close(b"p1", 10, partition=1)
    close(b"b", 350)  # closed again (a recovered duplicate): its older entry is stale
    del table[b"c"]  # let go in a rebalance

    def due(before: int) -> list[tuple[int, bytes]]:
        return queue.due(lambda marker: marker.closed_ts < before, table.get)

    assert due(60) == [(1, b"p1")]  # "late" (ts 50) waits behind "a" (ts 100): forgotten late, never early
    assert due(200) == [(0, b"a"), (0, b"late")]
    assert due(340) == []  # b@350 is not due (its stale b@300 entry went on the way to "late")
    assert due(1000) == [(0, b"b")] and len(queue) == 0  # c was deleted: dropped, not reported
    queue.rebuild([(b"y", ClosedEpisode("completed", 9, 0)), (b"x", ClosedEpisode("completed", 5, 0, partition=2))])
    assert [(p, [k for k, _ in q]) for p, q in sorted(queue.queues.items())] == [(0, [b"y"]), (2, [b"x"])]
