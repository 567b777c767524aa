"""The monitor's figures without a broker: folding records, lag, rates, the Prometheus view, the report."""
from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from consumers.monitor import StatsCollector, dashboard
from consumers.monitoring import PipelineStats, consumer_lag, first_unread, sparkline, trajectory_version
from infra.metrics import Welford
from consumers.report import PLOTS, summary_markdown, write_report
from schemas import codec
from schemas.records import BatchManifest, CheckpointPublished, DeadLetter, PipelineMetric
from schemas.topics import Topics
from tests.taps import episode, trajectory, turn

T0 = 1_700_000_000_000
TOPICS = Topics("mon")


def checkpoint(version: int) -> bytes:
    return codec.encode(CheckpointPublished(run="r", version=version, step=version, bucket="b", prefix="p",
                                            manifest_key="m", manifest_sha256="s", algorithm="grpo", batch_ids=(),
                                            ts=T0))


def dead(reason: str, offset: int = 0) -> bytes:
    return codec.encode(DeadLetter(reason=reason, detail="", stage="clean", source_topic="x", partition=0,
                                   offset=offset, key=None, original=b"", ts=T0))


def metric(name: str, value: float, source: str = "learner", at: int = T0) -> bytes:
    return codec.encode(PipelineMetric(source=source, name=name, value=value, window_end=at))


def filled() -> PipelineStats:
    s = PipelineStats(TOPICS)
    for i, outcome in enumerate(["passed", "failed", "failed"]):
        for ev in episode(f"e{i}", T0, outcome=outcome):
            s.observe(TOPICS.events, ev.ts, codec.encode(ev))
    s.observe(TOPICS.checkpoints, T0, checkpoint(3))
    rewards = {"math": [1.0, 0.0, 0.5], "code": [0.2]}
    for domain, values in rewards.items():
        for i, r in enumerate(values):
            t = trajectory(f"{domain}{i}", r, domain=domain, turns=[turn(" 4", version=i), turn(" 5", version=i + 1)])
            s.observe(TOPICS.scored, T0 + 10_000 * i, codec.encode(t))
    for offset, reason in enumerate(("bad_magic", "bad_magic", "truncated")):
        s.observe(TOPICS.deadletter, T0, dead(reason, offset))
    s.observe(TOPICS.metrics, T0, metric("loss/policy", 0.7, at=T0))
    s.observe(TOPICS.metrics, T0, metric("loss/policy", 0.5, at=T0 + 1))
    s.observe(TOPICS.metrics, T0, metric("loss/policy", 9.0, source="streams"))
    s.observe(TOPICS.metrics, T0, metric("rollout/reward_mean", 9.0))
    s.observe(TOPICS.scored, T0, b"\xc3\x01junk")
    return s


def test_counts_outcomes_reasons_and_rewards() -> None:
    s = filled()
    assert s.events_total[TOPICS.events] == 12 and s.events_total[TOPICS.scored] == 5
    assert s.sandbox_outcomes == {"passed": 1, "failed": 2}
    assert s.deadletter_reasons == {"bad_magic": 2, "truncated": 1}
    assert s.undecodable == {TOPICS.scored: 1}
    assert s.reward["math"].n == 3 and abs(s.reward["math"].mean - 0.5) < 1e-12
    assert abs(s.reward["math"].std - statistics.pstdev([1.0, 0.0, 0.5])) < 1e-12
    assert {k: w.mean for k, w in s.reward_by_version.items()} == {("math", 0): 1.0, ("math", 1): 0.0,
                                                                   ("math", 2): 0.5, ("code", 0): 0.2}
    assert s.latest_learner() == {"loss/policy": 0.5}  # only the learner's loss/* figures
    assert s.reward_trend("math") == [1.0, 0.0, 0.5]


def test_records_a_restarted_service_sends_again_are_counted_once() -> None:
    """After a kill -9 the streams worker re-processes what it had not committed: the same trajectories (same
    ids, byte-identical), the same dead letters (same input record and reason) and the log may hold an event
    twice. Every figure counts each once; the copies show as re-sent, per topic."""
    s = filled()
    again = episode("e9", T0, outcome="passed")
    for ev in again:
        s.observe(TOPICS.events, ev.ts, codec.encode(ev))
    before = (dict(s.sandbox_outcomes), dict(s.deadletter_reasons), {d: w.n for d, w in s.reward.items()},
              {d: w.mean for d, w in s.success.items()}, list(s.recent_policy_lag))
    for ev in again:  # the log holds it twice
        s.observe(TOPICS.events, ev.ts, codec.encode(ev))
    s.observe(TOPICS.scored, T0, codec.encode(trajectory("math0", 1.0, domain="math",
                                                         turns=[turn(" 4", version=0), turn(" 5", version=1)])))
    s.observe(TOPICS.deadletter, T0, dead("bad_magic", 0))
    after = (dict(s.sandbox_outcomes), dict(s.deadletter_reasons), {d: w.n for d, w in s.reward.items()},
             {d: w.mean for d, w in s.success.items()}, list(s.recent_policy_lag))
    assert after == before
    assert s.resent == {TOPICS.events: 1, TOPICS.scored: 1, TOPICS.deadletter: 1}
    s.observe(TOPICS.deadletter, T0, dead("bad_magic", 7))  # another input record: counted
    assert s.deadletter_reasons["bad_magic"] == 3


def test_policy_lag_measures_the_oldest_turn_against_the_newest_checkpoint() -> None:
    s = filled()
    assert s.newest_checkpoint == 3 and s.newest_trajectory_version == 3
    assert s.policy_lag() == ((3 + 2 + 1 + 3) / 4, 3)
    t = trajectory("x", turns=[turn("a", version=4), turn("b", version=2)])
    assert trajectory_version(t) == 2 and trajectory_version(replace(t, turns=())) == 0


def test_welford_matches_statistics() -> None:
    w, values = Welford(), [3.0, -1.5, 2.25, 8.0, 0.0]
    for v in values:
        w.add(v)
    assert abs(w.mean - statistics.fmean(values)) < 1e-12 and abs(w.std - statistics.pstdev(values)) < 1e-12
    assert Welford().std == 0.0


def test_consumer_lag_sums_partitions_and_treats_no_commit_as_unread() -> None:
    committed = {("t", 0): 5, ("t", 1): -1001, ("u", 0): 10, ("gone", 0): 3}
    ends = {("t", 0): (0, 9), ("t", 1): (2, 6), ("u", 0): (0, 10)}
    assert consumer_lag(committed, ends) == {"t": 4 + 4, "u": 0}
    assert consumer_lag({("t", 0): 1}, {("t", 0): (5, 9)}) == {"t": 4}  # retention moved the start


def test_rates_count_the_recent_window_of_record_time() -> None:
    s = PipelineStats(TOPICS, bucket_ms=1000)
    for i in range(60):
        s.observe("x", T0 + i * 1000, None)
    assert s.rates(T0 + 60_000, window_s=30) == {"x": 1.0}
    assert s.rates(T0 + 600_000, window_s=30) == {"x": 0.0}


def test_lag_history_and_sparkline() -> None:
    s = PipelineStats(TOPICS)
    s.set_consumer_lag(1, {("g", "a"): 2, ("g", "b"): 3, ("h", "a"): 0})
    s.set_consumer_lag(2, {("g", "a"): 0})
    assert s.lag_over_time == {"g": [(1, 5), (2, 0)], "h": [(1, 0)]}
    assert s.consumer_lags == {("g", "a"): 0}
    assert sparkline([0.0, 0.5, 1.0]) == "▁▄█" and sparkline([]) == "" and sparkline([2.0]) == "▅"


def scrape(s: PipelineStats) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(s, __import__("threading").Lock()))
    text = generate_latest(registry).decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_prometheus_view_has_the_same_figures() -> None:
    s = filled()
    s.set_consumer_lag(T0, {("mon.streams", TOPICS.events): 7})
    m = scrape(s)
    assert m[("trajpipe_events_total", (("topic", TOPICS.events),))] == 12
    assert m[("trajpipe_deadletter_total", (("reason", "bad_magic"),))] == 2
    assert m[("trajpipe_sandbox_outcomes_total", (("outcome", "failed"),))] == 2
    assert m[("trajpipe_reward_mean", (("domain", "math"),))] == 0.5
    # outcome/correct 1.0, 0.0 and 0.5 in math (one solved), 0.2 in code (none)
    assert abs(m[("trajpipe_success_rate", (("domain", "math"),))] - 1 / 3) < 1e-12
    assert m[("trajpipe_success_rate", (("domain", "code"),))] == 0.0
    assert m[("trajpipe_scored_trajectories_total", (("domain", "code"),))] == 1
    assert m[("trajpipe_consumer_lag", (("group", "mon.streams"), ("topic", TOPICS.events)))] == 7
    assert m[("trajpipe_policy_version", (("source", "checkpoint"),))] == 3
    assert m[("trajpipe_learner", (("name", "loss/policy"),))] == 0.5
    assert m[("trajpipe_undecodable_total", (("topic", TOPICS.scored),))] == 1


def test_dashboard_and_report_render(tmp_path: Path) -> None:
    s = filled()
    s.set_consumer_lag(T0, {("mon.streams", TOPICS.events): 7})
    left, right = dashboard(s).columns[0]._cells[0], dashboard(s).columns[1]._cells[0]
    assert len(left.renderables) + len(right.renderables) == 9
    summary = write_report(s, tmp_path).read_text()
    for name in PLOTS:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"({name})" in summary
    assert "| bad_magic | 2 |" in summary and "| math | 3 | 0.5000 |" in summary
    write_report(PipelineStats(TOPICS), tmp_path / "empty")  # nothing yet: still every file
    assert sorted(p.name for p in (tmp_path / "empty").iterdir()) == sorted([*PLOTS, "summary.md"])


def manifest(batch: str, trajectory_ids: list[str]) -> bytes:
    return codec.encode(BatchManifest(batch_id=batch, run="r", bucket="b", key="k", sha256="s", size=1,
                                      num_trajectories=len(trajectory_ids), num_tokens=1, source_topic="x",
                                      partition=0, first_offset=0, last_offset=1, policy_version_min=0,
                                      policy_version_max=0, reward_mean=0.0, reward_std=0.0,
                                      trajectory_ids=tuple(trajectory_ids), ts=T0))


def test_latency_histograms_pair_each_episode_end_with_its_batch_in_either_order() -> None:
    """EpisodeEnded -> batch: a manifest read before its trajectory (the monitor reads topics side by side)
    pairs when the trajectory comes. Checkpoint -> generating: each worker's figure for a version once."""
    s = PipelineStats(TOPICS)
    early, late, later = (replace(trajectory(e), ended_ts=T0 + dt) for e, dt in (("a", 0), ("b", 1000), ("c", 1200)))
    for t in (early, late):
        s.observe(TOPICS.scored, T0 + 1100, codec.encode(t))
    batch = manifest("batch-1", [t.trajectory_id for t in (early, late, later)])
    s.observe(TOPICS.batches, T0 + 1500, batch)
    s.observe(TOPICS.scored, T0 + 1600, codec.encode(later))  # scored record read after its batch
    s.observe(TOPICS.batches, T0 + 1500, batch)  # a restarted shard writer's copy: no second observation
    assert sorted(s.batch_latency.recent) == [0.3, 0.5, 1.5]
    for producer, version, seconds in (("w0", 3, 0.8), ("w0", 3, 0.8), ("w1", 3, 2.5), ("w0", 4, 0.2)):
        s.observe(TOPICS.metrics, T0, codec.encode(PipelineMetric(
            source="rollout", name="rollout/checkpoint_latency_s", value=seconds,
            labels={"producer": producer, "version": str(version)}, window_end=T0)))
    assert sorted(s.checkpoint_latency.recent) == [0.2, 0.8, 2.5]
    assert s.checkpoint_latency.quantile(0.5) == 0.8
    assert "| episode ended -> in a batch | 3 | 0.50 | 1.50 |" in summary_markdown(s)

    m = scrape(s)
    assert m[("trajpipe_batch_latency_seconds_count", ())] == 3
    assert abs(m[("trajpipe_batch_latency_seconds_sum", ())] - 2.3) < 1e-9
    buckets = {dict(k[1])["le"]: v for k, v in m.items() if k[0] == "trajpipe_batch_latency_seconds_bucket"}
    assert (buckets["0.25"], buckets["0.5"], buckets["1.0"], buckets["2.0"], buckets["+Inf"]) == (0, 2, 2, 3, 3)
    assert m[("trajpipe_checkpoint_latency_seconds_count", ())] == 3


def test_queue_age_is_the_time_of_the_oldest_record_a_group_has_not_committed() -> None:
    s = PipelineStats(TOPICS)
    for offset in range(10):  # partition 0: one record a second; partition 1 holds offsets 0, 2, 4 (compacted)
        s.observe(TOPICS.events, T0 + 1000 * offset, None, partition=0, offset=offset)
    for offset in (0, 2, 4):
        s.observe(TOPICS.events, T0 + 500 * offset, None, partition=1, offset=offset)
    committed = {(TOPICS.events, 0): 7, (TOPICS.events, 1): 3, (TOPICS.scored, 0): 5}
    ends = {(TOPICS.events, 0): (0, 10), (TOPICS.events, 1): (0, 5), (TOPICS.scored, 0): (0, 5)}
    unread = {("g", topic): positions for topic, positions in first_unread(committed, ends).items()}
    assert unread == {("g", TOPICS.events): {0: 7, 1: 3}}  # caught up on scored: no age there
    lags = {("g", topic): n for topic, n in consumer_lag(committed, ends).items()}
    s.set_consumer_lag(T0 + 20_000, lags, unread)
    assert s.oldest_unread == {("g", TOPICS.events): T0 + 2000}  # partition 1's offset 3 is gone: offset 4's time
    s.set_consumer_lag(T0 + 20_000, {("g", TOPICS.events): 1}, {("g", TOPICS.events): {0: 12}})
    assert s.oldest_unread == {}  # not read by the monitor yet: unknown, not guessed
    s.set_consumer_lag(T0, lags, unread)
    m = scrape(s)
    assert m[("trajpipe_queue_oldest_unread_timestamp_seconds", (("group", "g"), ("topic", TOPICS.events)))] == \
        (T0 + 2000) / 1000
    assert m[("trajpipe_queue_age_seconds", (("group", "g"), ("topic", TOPICS.events)))] > 0


def labelled(name: str, value: float, at: int, source: str = "learner", **labels: str) -> bytes:
    return codec.encode(PipelineMetric(source=source, name=name, value=value, labels=labels, window_end=at))


def test_a_figure_labelled_with_each_version_stays_one_series() -> None:
    """The learner labels every figure with the version it made: a long run is one series per figure, not one per
    version to hold, scrape and sum."""
    s = PipelineStats(TOPICS)
    for version in range(1, 2001):
        s.observe(TOPICS.metrics, T0, labelled("stale/dropped", float(version % 7), T0 + version * 1000,
                                               algorithm="grpo", version=str(version)))
        s.observe(TOPICS.metrics, T0, labelled("learner/updates", 1.0, T0 + version * 1000, version=str(version)))
    assert len(s.service_latest) == len(s.service_sum) == 2
    assert s.service_sum[("learner", "learner/updates", "")] == 2000  # the windows of every version, summed
    assert s.service_latest[("learner", "stale/dropped", "")] == 2000 % 7
    services = [labels for (name, labels) in scrape(s) if name == "trajpipe_service"]
    assert len(services) == 2


def test_a_restarted_workers_last_figures_leave_the_sums_of_the_live_ones() -> None:
    """A rollout worker publishes under its producer id (host-pid): after a restart, the dead id's last tokens/s
    must not be added to the live worker's, in the headline or the Prometheus gauge; its episodes stay counted."""
    s = PipelineStats(TOPICS)
    for i in range(60):  # 10 minutes of 10 s windows from worker A, which then dies
        s.observe(TOPICS.metrics, T0, labelled("rollout/tokens_per_s", 100.0, T0 + i * 10_000, "rollout", producer="a"))
        s.observe(TOPICS.metrics, T0, labelled("rollout/episodes", 4.0, T0 + i * 10_000, "rollout", producer="a"))
    start = T0 + 600_000
    for i in range(12):  # its replacement, B, for two minutes
        s.observe(TOPICS.metrics, T0, labelled("rollout/tokens_per_s", 30.0, start + i * 10_000, "rollout", producer="b"))
        s.observe(TOPICS.metrics, T0, labelled("rollout/episodes", 1.0, start + i * 10_000, "rollout", producer="b"))
    assert s.headline()["rollout/tokens_per_s"] == 130.0  # A's last window is a minute old: still counted
    for i in range(12, 120):  # B goes on for another 18 minutes
        s.observe(TOPICS.metrics, T0, labelled("rollout/tokens_per_s", 30.0, start + i * 10_000, "rollout", producer="b"))
        s.observe(TOPICS.metrics, T0, labelled("rollout/episodes", 1.0, start + i * 10_000, "rollout", producer="b"))
    assert s.headline()["rollout/tokens_per_s"] == 30.0
    assert s.headline()["rollout/episodes"] == 60 * 4 + 120
    gauges = {labels: v for (name, labels), v in scrape(s).items() if name == "trajpipe_service"}
    assert gauges == {(("labels", "producer=b"), ("name", "rollout/episodes"), ("source", "rollout")): 1.0,
                      (("labels", "producer=b"), ("name", "rollout/tokens_per_s"), ("source", "rollout")): 30.0}
    # The streams worker's windows are in event time: working through an hour-old backlog, its figures are an hour
    # behind the rollout workers' and still live.
    for i in range(31):  # its last window is also a look for stale series (one a minute of its metric time)
        s.observe(TOPICS.metrics, T0, labelled("streams/events_per_s", 500.0, start - 3_600_000 + i * 10_000,
                                               "streams", worker="s1"))
        s.observe(TOPICS.metrics, T0, labelled("rollout/tokens_per_s", 30.0, start + (120 + i) * 10_000, "rollout",
                                               producer="b"))
    for i in range(150, 160):  # the rollout worker's windows go on past a look for stale series
        s.observe(TOPICS.metrics, T0, labelled("rollout/tokens_per_s", 30.0, start + i * 10_000, "rollout", producer="b"))
    assert s.headline()["streams/events_per_s"] == 500.0


def test_reward_by_version_holds_a_bounded_number_of_points_however_many_versions(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A long run makes hundreds of thousands of versions: each domain keeps at most KEEP_VERSIONS points, in
    buckets of versions whose figures are those of every trajectory in them."""
    import consumers.monitoring

    monkeypatch.setattr(consumers.monitoring, "KEEP_VERSIONS", 8)
    s = PipelineStats(TOPICS)
    rewards: dict[int, list[float]] = {}
    for version in range(100):
        for i in range(3):
            r = ((version * 7 + i * 3) % 10) / 10
            rewards.setdefault(version, []).append(r)
            t = trajectory(f"t{version}-{i}", r, domain="math", turns=[turn(" 4", version=version)])
            s.observe(TOPICS.scored, T0, codec.encode(t))
    s.observe(TOPICS.scored, T0, codec.encode(trajectory("c0", 0.5, domain="code", turns=[turn(" 4", version=3)])))
    math_points = sorted((v, w) for (d, v), w in s.reward_by_version.items() if d == "math")
    assert len(math_points) <= 8 and s.version_width["math"] == 16
    assert [v for v, _ in math_points] == list(range(0, 100, 16))
    for start, w in math_points:  # each bucket's figures are its trajectories'
        inside = [r for v in range(start, min(start + 16, 100)) for r in rewards[v]]
        assert w.n == len(inside) and abs(w.mean - statistics.fmean(inside)) < 1e-12
        assert abs(w.std - statistics.pstdev(inside)) < 1e-9
    assert sum(w.n for (d, _), w in s.success_by_version.items() if d == "math") == 300
    assert {k for k in s.success_by_version} == {k for k in s.reward_by_version}
    assert s.reward_by_version[("code", 3)].n == 1  # another domain keeps its own buckets
