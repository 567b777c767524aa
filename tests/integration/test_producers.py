"""Rollout workers against the real broker and store: ordered episodes, broker outage, checkpoint following."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import torch

from infra.bootstrap import bootstrap
from infra.kafka import Publisher, end_offsets, read_topic
from infra.objectstore import ObjectStore
from infra.settings import Settings
from producers.checkpoints import WEIGHTS_FILE, CheckpointFollower
from producers.settings import WorkerSettings
from producers.tasks import load_source
from producers.worker import RolloutWorker
from schemas import codec
from schemas.keys import checkpoint_prefix
from schemas.manifests import CheckpointManifest, FileEntry
from schemas.packing import sha256_hex
from schemas.records import (
    CheckpointPublished,
    EpisodeEnded,
    EpisodeStarted,
    PipelineMetric,
    PolicyTurn,
    RolloutEvent,
    SandboxResult,
)
from schemas.topics import Topics
from streams.outbox import KafkaOutbox
from tests.stack import private_launcher
from tests.streams_data import batch_record

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def small_worker(ns: str, stack: Settings, **kw: object) -> RolloutWorker:
    settings = WorkerSettings(ns=ns, producer_id="test-worker", group_size=2, max_new_tokens=12, layers=2,
                              width=64, follow_checkpoints=False, **kw)  # type: ignore[arg-type]
    return RolloutWorker(settings, stack)


def events_by_episode(stack: Settings, topics: Topics) -> dict[str, list[tuple[int, int, RolloutEvent]]]:
    out: dict[str, list[tuple[int, int, RolloutEvent]]] = defaultdict(list)
    for msg in read_topic(stack, topics.events):
        ev = codec.decode(msg.value())
        out[ev.episode_id].append((msg.partition(), msg.offset(), ev))
    return out


def assert_complete_and_ordered(events: list[tuple[int, int, RolloutEvent]]) -> None:
    assert len({p for p, _, _ in events}) == 1, "an episode spans partitions"
    ordered = [ev for _, _, ev in sorted(events, key=lambda t: t[1])]
    assert [ev.seq for ev in ordered] == list(range(len(ordered)))
    assert isinstance(ordered[0].body, EpisodeStarted) and isinstance(ordered[-1].body, EpisodeEnded)
    turns = [ev.body.turn for ev in ordered if isinstance(ev.body, PolicyTurn)]
    assert turns == list(range(len(turns))) and ordered[-1].body.num_turns == len(turns)
    for prev, ev in zip(ordered, ordered[1:]):
        if isinstance(ev.body, SandboxResult):
            assert isinstance(prev.body, PolicyTurn) and prev.body.turn == ev.body.turn
    for ev in ordered:
        if isinstance(ev.body, PolicyTurn):
            assert len(ev.body.tokens) == len(ev.body.logprobs) > 0


def test_a_worker_produces_complete_ordered_episodes_for_all_three_domains(stack: Settings, topics: Topics) -> None:
    worker = small_worker(topics.ns, stack, max_turns=2, sources=("math-easy", "table", "humaneval"))
    tasks = [load_source("math-easy")[0], load_source("table", seed=1)[0], load_source("humaneval")[2]]
    summary = worker.runner.run_step(tasks)
    worker.sink.close()
    worker.code_runner.close()
    assert summary.episodes == 6 and sum(summary.statuses.values()) == 6
    by_ep = events_by_episode(stack, topics)
    assert len(by_ep) == 6
    domains = defaultdict(int)
    for events in by_ep.values():
        assert_complete_and_ordered(events)
        domains[events[0][2].domain] += 1
        code_turns = [e for _, _, e in events if isinstance(e.body, PolicyTurn)]
        if events[0][2].domain == "code":
            results = [e for _, _, e in events if isinstance(e.body, SandboxResult)]
            assert len(results) == len(code_turns) >= 1
            assert results[0].body.outcome in ("passed", "failed", "syntax_error", "runtime_error", "timeout")
    assert domains == {"math": 2, "table": 2, "code": 2}
    groups = {events[0][2].group_id for events in by_ep.values()}
    assert len(groups) == 3
    assert worker.sink.stats["delivered"] == sum(len(v) for v in by_ep.values())


@pytest.mark.slow
def test_killing_the_broker_mid_run_loses_no_event(tmp_path: Path) -> None:
    launcher = private_launcher(tmp_path / "stack")
    launcher.up()
    try:
        own = launcher.settings()
        bootstrap(own, "outage")
        env = {**own.as_env(), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
        proc = subprocess.Popen(
            [sys.executable, "-m", "producers", "--ns", "outage", "--sources", "math-easy", "--episodes", "48",
             "--group-size", "4", "--prompts-per-step", "2", "--max-new-tokens", "8", "--layers", "2",
             "--width", "64", "--no-follow", "--own-weights"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        topics = Topics("outage")
        deadline = time.monotonic() + 120
        while sum(hi for _, hi in _watermarks(own, topics)) < 20 and time.monotonic() < deadline:
            time.sleep(0.5)
        outbox = KafkaOutbox(own)  # what the streams sweeper asks before it lets wall time age an episode
        assert asyncio.run(outbox.reachable())
        launcher.kill("kafka")
        assert not asyncio.run(outbox.reachable())
        time.sleep(5)
        launcher.start("kafka")
        assert asyncio.run(outbox.reachable(timeout=30))
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        report = json.loads(out.strip().splitlines()[-1])
        by_ep = events_by_episode(own, topics)
        total = sum(len(v) for v in by_ep.values())
        assert report["events"]["failed"] == 0 and report["events"]["delivered"] == report["events"]["sent"] == total
        assert len(by_ep) == report["episodes"] == 48
        for events in by_ep.values():
            assert_complete_and_ordered(events)
    finally:
        launcher.down()


def _watermarks(settings: Settings, topics: Topics) -> list[tuple[int, int]]:
    from infra.kafka import end_offsets

    try:
        return list(end_offsets(settings, topics.events, timeout=2).values())
    except Exception:
        return []


def publish_checkpoint(stack: Settings, store: ObjectStore, topics: Topics, version: int,
                       weights: dict[str, torch.Tensor], corrupt: bool = False, next_batches: int = 0,
                       offsets: dict[int, int] | None = None) -> None:
    from safetensors.torch import save

    data = save(weights, metadata={"format": "pt"})
    prefix = checkpoint_prefix(topics.ns, version)
    store.put(prefix + WEIGHTS_FILE, data)
    manifest = CheckpointManifest(run=topics.ns, version=version, step=version, algorithm="grpo",
                                  files={WEIGHTS_FILE: FileEntry(sha256_hex(data), len(data))}, offsets=offsets or {},
                                  batch_ids=[], next_batches=next_batches)
    body = manifest.to_json()
    store.put(prefix + "manifest.json", body)
    sha = sha256_hex(body) if not corrupt else "0" * 64
    event = CheckpointPublished(run=topics.ns, version=version, step=version, bucket=store.bucket, prefix=prefix,
                                manifest_key=prefix + "manifest.json", manifest_sha256=sha, algorithm="grpo",
                                batch_ids=(), ts=0)
    pub = Publisher(stack)
    pub.send(topics.checkpoints, topics.ns.encode(), codec.encode(event))
    pub.close()


def test_a_bad_checkpoint_is_refused_and_a_good_one_is_loaded(stack: Settings, topics: Topics,
                                                               store: ObjectStore) -> None:
    worker = small_worker(topics.ns, stack)
    model = worker.backend.model  # type: ignore[attr-defined]
    weights = {k: (v + 0.5).contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    publish_checkpoint(stack, store, topics, 1, weights, corrupt=True)
    follower = CheckpointFollower(stack, topics, store)
    worker.follower = follower
    follower.start()
    deadline = time.monotonic() + 30
    while not follower.refused and time.monotonic() < deadline:
        time.sleep(0.2)
    assert follower.refused and "v1 refused" in follower.refused[0]
    assert follower.take_ready() is None

    # v2 verifies but was made for a wider model: refused with its reason, the worker keeps what it has
    misfit = {**weights, "model.embed_tokens.weight": torch.zeros(7, 3)}
    publish_checkpoint(stack, store, topics, 2, misfit)
    while follower.latest_published < 2 and time.monotonic() < deadline + 30:
        time.sleep(0.2)
    worker.maybe_load_checkpoint()
    assert worker.backend.version != 2 and len(follower.refused) == follower.refused_count == 2
    assert "v2 verifies but does not fit this worker's model" in follower.refused[1]

    publish_checkpoint(stack, store, topics, 3, weights)
    while follower.latest_published < 3 and time.monotonic() < deadline + 60:
        time.sleep(0.2)
    worker.maybe_load_checkpoint()
    follower.stop()
    assert worker.backend.version == 3
    embed = model.get_input_embeddings().weight
    assert torch.equal(embed, weights["model.embed_tokens.weight"])
    worker.runner.run_step([load_source("math-easy")[3]])
    worker.sink.close()
    worker.code_runner.close()
    versions = {ev.policy_version for events in events_by_episode(stack, topics).values() for _, _, ev in events}
    assert versions == {3}


def _run_in_thread(worker: RolloutWorker) -> "threading.Thread":
    import threading

    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    return thread


def test_a_worker_waits_for_published_weights_then_generates_only_with_them(
        stack: Settings, topics: Topics, store: ObjectStore, capfd: pytest.CaptureFixture[str]) -> None:
    settings = WorkerSettings(ns=topics.ns, producer_id="waiter", group_size=2, max_new_tokens=4, layers=2,
                              width=64, episodes=4, prompts_per_step=1)
    worker = RolloutWorker(settings, stack)
    own = {k: v.clone() for k, v in worker.backend.model.state_dict().items()}  # type: ignore[attr-defined]
    thread = _run_in_thread(worker)
    time.sleep(4)
    assert thread.is_alive() and worker.stats.episodes == 0   # nothing generated with its own weights
    assert "waiting for a published checkpoint" in capfd.readouterr().err
    published = {k: (v + 0.25).contiguous() for k, v in own.items() if k != "lm_head.weight"}
    publish_checkpoint(stack, store, topics, 0, published)
    thread.join(timeout=120)
    assert not thread.is_alive() and worker.stats.episodes == 4
    embed = worker.backend.model.get_input_embeddings().weight  # type: ignore[attr-defined]
    assert torch.equal(embed, published["model.embed_tokens.weight"])
    versions = {ev.policy_version for events in events_by_episode(stack, topics).values() for _, _, ev in events}
    assert versions == {0}
    turns = [ev.body for events in events_by_episode(stack, topics).values() for _, _, ev in events
             if isinstance(ev.body, PolicyTurn)]
    assert {(t.temperature, t.top_p) for t in turns} == {(1.0, 1.0)}   # the sampling settings travel per turn


def test_a_restarted_worker_starts_from_the_newest_checkpoint(stack: Settings, topics: Topics,
                                                              store: ObjectStore) -> None:
    settings = WorkerSettings(ns=topics.ns, producer_id="restarted", group_size=2, max_new_tokens=4, layers=2,
                              width=64, episodes=2, prompts_per_step=1, max_policy_lag=0)
    worker = RolloutWorker(settings, stack)
    base = {k: v.clone() for k, v in worker.backend.model.state_dict().items() if k != "lm_head.weight"}
    for version in range(4):  # the fleet had moved on to v3 before this worker (re)started
        publish_checkpoint(stack, store, topics, version, {k: (v + version).contiguous() for k, v in base.items()})
    worker.run()
    assert worker.stats.versions_loaded[-1] == 3 and worker.stats.episodes == 2
    versions = {ev.policy_version for events in events_by_episode(stack, topics).values() for _, _, ev in events}
    assert versions == {3}
    # its own figures on the metrics topic: the episodes it ended, by status, as the events say
    ended = Counter(ev.body.status for events in events_by_episode(stack, topics).values() for _, _, ev in events
                    if isinstance(ev.body, EpisodeEnded))
    figures: Counter[str] = Counter()
    drawn: dict[str, float] = {}
    for message in read_topic(stack, topics.metrics):
        metric = codec.decode(message.value(), PipelineMetric)
        if metric.source == "rollout" and metric.name == "rollout/episodes":
            assert metric.labels["producer"] == "restarted"
            figures[metric.labels["status"]] += int(metric.value)
        if metric.name == "rollout/policy_version":
            assert metric.value == 3
        if metric.name == "rollout/tasks_drawn":  # cumulative: the newest value per source
            drawn[metric.labels["source"]] = metric.value
    assert figures == ended and sum(ended.values()) == 2
    groups = {ev.group_id for events in events_by_episode(stack, topics).values() for _, _, ev in events}
    assert drawn == {"math-easy": float(len(groups))}  # one task drawn per group, from the only source


def test_a_worker_that_follows_nothing_needs_a_checkpoint_or_an_explicit_opt_in(stack: Settings, topics: Topics) -> None:
    from schemas.errors import ConfigError

    with pytest.raises(ConfigError, match="--init-checkpoint"):
        small_worker(topics.ns, stack, episodes=2).run()


def test_a_worker_makes_exactly_its_quota_of_episodes_per_version(stack: Settings, topics: Topics,
                                                                  store: ObjectStore,
                                                                  capfd: pytest.CaptureFixture[str]) -> None:
    """--max-episodes-per-version 10 with steps of 8 episodes: a step of 8, then one of the 2 left, then the
    wait for a newer version. The last step of a version used to be a whole one: 16 episodes of v0, where
    the learner's demand was 10, and a fleet generated up to a step a worker more than it asked for."""
    settings = WorkerSettings(ns=topics.ns, producer_id="paced", group_size=2, max_new_tokens=4, layers=2,
                              width=64, episodes=20, prompts_per_step=4, max_episodes_per_version=10,
                              quota_wait_s=0.5, max_policy_lag=9)
    worker = RolloutWorker(settings, stack)
    base = {k: v.clone() for k, v in worker.backend.model.state_dict().items() if k != "lm_head.weight"}
    publish_checkpoint(stack, store, topics, 0, base)
    worker.run()
    steps = [int(line.split(": ", 1)[1].split()[0]) for line in capfd.readouterr().err.splitlines()
             if line.startswith("[paced] step ")]
    assert steps == [8, 2, 8, 2] and worker.stats.episodes == 20
    assert len(events_by_episode(stack, topics)) == 20


def add_batch_records(stack: Settings, topics: Topics, n: int, version: int) -> None:
    """n batch records as the shard writer writes them, of rollouts of `version` or of demonstrations (-1)."""
    pub = Publisher(stack)
    for i in range(n):
        pub.send(topics.batches, None, batch_record(i, version, run=topics.ns))
    pub.close()


def close_worker(worker: RolloutWorker) -> None:
    worker.follower.stop()
    worker.sink.close()
    worker.metrics_out.close()
    worker.code_runner.close()
    worker.demand.close()


@pytest.mark.parametrize("fixed", [False, True], ids=["following-demand", "fixed-quota"])
def test_a_worker_past_its_quota_makes_what_the_learner_lacks_at_the_rate_its_episodes_fill_batches(
        stack: Settings, topics: Topics, store: ObjectStore, fixed: bool) -> None:
    """v0 says the learner needs 8 batches for v1 and the batches topic holds 1. The worker's quota of 8 episodes
    (steps of 4) adds 4 batches (here the test adds them, as streams and the shard writer would: 2 episodes a
    batch, where every group teaches something). Once they had 0.3 s to arrive it makes the 6 episodes the 3
    missing batches take at that rate, instead of waiting 3 s for a version the learner cannot make; the share of
    a quota they are of the version's batches (3/8 of 8) would have made a step of 4 and waited again. Once the
    topic holds the 8 batches it waits for the version (the 3 s bound: no learner makes it here). With
    --fixed-quota every wait runs to the bound and ends with a whole quota."""
    settings = WorkerSettings(ns=topics.ns, producer_id="demand", group_size=2, max_new_tokens=4, layers=2,
                              width=64, prompts_per_step=2, max_episodes_per_version=8, quota_wait_s=3.0,
                              demand_settle_s=None if fixed else 0.3, max_policy_lag=9)
    worker = RolloutWorker(settings, stack)
    base = {k: v.clone() for k, v in worker.backend.model.state_dict().items() if k != "lm_head.weight"}

    add_batch_records(stack, topics, 1, version=0)
    publish_checkpoint(stack, store, topics, 0, base, next_batches=8)
    worker.follower.start()
    steps, waits = [], []
    try:
        worker.wait_for_published_weights()
        for i in range(5):
            if i == 2:
                add_batch_records(stack, topics, 4, version=0)  # what the quota's 8 episodes added
            if i == 4:
                add_batch_records(stack, topics, 3, version=0)  # the learner has its 8 batches: the wait before the next step is for v1
            made = worker.stats.episodes
            worker.step()
            steps.append(worker.stats.episodes - made)
            waits.append((worker.stats.quota_waits, worker.stats.demand_steps))
    finally:
        close_worker(worker)
    if fixed:
        assert steps == [4, 4, 4, 4, 4] and waits == [(0, 0), (0, 0), (1, 0), (1, 0), (2, 0)]
    else:
        assert steps == [4, 4, 4, 2, 4] and waits == [(0, 0), (0, 0), (1, 1), (1, 1), (2, 1)]
    assert worker.backend.version == 0


@pytest.mark.parametrize("fixed", [False, True], ids=["following-demand", "fixed-quota"])
def test_a_worker_with_quota_left_waits_while_the_learner_already_holds_its_next_two_versions_batches(
        stack: Settings, topics: Topics, store: ObjectStore, fixed: bool) -> None:
    """v0 says the learner trains 2 batches a version. Behind 6 batches of demonstrations left over from an SFT phase
    (which the learner only skips), with 3 batches of rollouts on the topic the worker makes a step; with 4
    (those of v1 and v2) it makes none, though 4 of its quota of 8 episodes are left: they would queue behind
    them and reach the learner stale. It waits until v1 comes, read past those batches, then makes its step with
    v1. With --fixed-quota it ignores the learner's batches and makes its quota with v0."""
    settings = WorkerSettings(ns=topics.ns, producer_id="queued", group_size=2, max_new_tokens=4, layers=2,
                              width=64, prompts_per_step=2, max_episodes_per_version=8, quota_wait_s=3.0,
                              demand_settle_s=None if fixed else 0.3, max_policy_lag=9)
    worker = RolloutWorker(settings, stack)
    base = {k: v.clone() for k, v in worker.backend.model.state_dict().items() if k != "lm_head.weight"}
    add_batch_records(stack, topics, 6, version=-1)
    add_batch_records(stack, topics, 3, version=0)
    publish_checkpoint(stack, store, topics, 0, base, next_batches=2)
    worker.follower.start()
    stepping = threading.Thread(target=worker.step, daemon=True)
    try:
        worker.wait_for_published_weights()
        first = threading.Thread(target=worker.step, daemon=True)
        first.start()
        first.join(30)
        assert not first.is_alive(), "the left-over demonstrations held the worker"
        assert (worker.stats.episodes, worker.stats.queue_waits) == (4, 0)
        add_batch_records(stack, topics, 1, version=0)
        stepping.start()
        time.sleep(2.0)
        made_while_full = worker.stats.episodes
        read_past = {p: high for p, (_, high) in end_offsets(stack, topics.batches).items()}
        publish_checkpoint(stack, store, topics, 1, {k: (t + 1).contiguous() for k, t in base.items()},
                           next_batches=2, offsets=read_past)
        stepping.join(60)
        assert not stepping.is_alive()
    finally:
        worker.request_stop()
        close_worker(worker)
    started = Counter(events[0][2].policy_version for events in events_by_episode(stack, topics).values())
    if fixed:
        assert made_while_full == 8 and worker.stats.queue_waits == 0 and started == {0: 8}
    else:
        assert made_while_full == 4 and worker.stats.queue_waits == 1
        assert worker.backend.version == 1 and worker.stats.episodes == 8 and started == {0: 4, 1: 4}


def test_a_worker_whose_episodes_added_no_batch_makes_a_whole_quota_more_at_most(
        stack: Settings, topics: Topics, store: ObjectStore) -> None:
    """Its quota of 8 episodes added no batch yet (all dropped upstream, or still on their way): the learner
    lacks 3 of its 4 batches, and the worker makes at most one more quota (8) before it asks again."""
    settings = WorkerSettings(ns=topics.ns, producer_id="dry", group_size=2, max_new_tokens=4, layers=2,
                              width=64, prompts_per_step=2, max_episodes_per_version=8, quota_wait_s=3.0,
                              demand_settle_s=0.3, max_policy_lag=9)
    worker = RolloutWorker(settings, stack)
    base = {k: v.clone() for k, v in worker.backend.model.state_dict().items() if k != "lm_head.weight"}
    add_batch_records(stack, topics, 1, version=0)
    publish_checkpoint(stack, store, topics, 0, base, next_batches=4)
    worker.follower.start()
    try:
        worker.wait_for_published_weights()
        worker.step()
        worker.step()
        assert worker.episodes_the_learner_lacks(waited_s=1.0) == 8
    finally:
        close_worker(worker)


def test_left_over_demonstrations_do_not_count_as_batches_the_learner_holds_for_its_next_version(
        stack: Settings, topics: Topics, store: ObjectStore) -> None:
    """v0 says the next version trains 2 batches; the topic holds only 6 batches of demonstrations left over from
    an SFT phase, which the RL phase skips. The worker's quota of 4 is made and none of its batches has arrived:
    the learner lacks both batches, so the worker makes another quota instead of waiting out --quota-wait-s."""
    settings = WorkerSettings(ns=topics.ns, producer_id="leftover", group_size=2, max_new_tokens=4, layers=2,
                              width=64, prompts_per_step=2, max_episodes_per_version=4, quota_wait_s=3.0,
                              demand_settle_s=0.3, max_policy_lag=9)
    worker = RolloutWorker(settings, stack)
    base = {k: v.clone() for k, v in worker.backend.model.state_dict().items() if k != "lm_head.weight"}
    add_batch_records(stack, topics, 6, version=-1)
    publish_checkpoint(stack, store, topics, 0, base, next_batches=2)
    worker.follower.start()
    try:
        worker.wait_for_published_weights()
        worker.step()
        assert worker.stats.episodes == 4
        assert worker.demand.shortfall(worker.manifest) == 2  # type: ignore[arg-type]
        assert worker.episodes_the_learner_lacks(waited_s=1.0) == 4
    finally:
        close_worker(worker)


def test_a_worker_a_version_ahead_holds_a_second_quota_and_waits_only_when_both_are_made(
        stack: Settings, topics: Topics, store: ObjectStore) -> None:
    """--versions-ahead 1 with a quota of 8: the first version loaded gives 16 episodes without a wait, each
    newer one 8 more, a jump of three versions refills to 16 and no further; the one wait is for a version
    that never came (1 s here). Without the reserve the same steps wait three times."""
    settings = WorkerSettings(ns=topics.ns, producer_id="ahead", group_size=2, max_new_tokens=4, layers=2,
                              width=64, prompts_per_step=4, max_episodes_per_version=8, versions_ahead=1,
                              quota_wait_s=1.0, max_policy_lag=9)
    worker = RolloutWorker(settings, stack)
    base = {k: v.clone() for k, v in worker.backend.model.state_dict().items() if k != "lm_head.weight"}

    def publish(*versions: int) -> None:
        for v in versions:
            publish_checkpoint(stack, store, topics, v, {k: (t + v).contiguous() for k, t in base.items()})
        deadline = time.monotonic() + 60
        while worker.follower.latest_published < versions[-1] and time.monotonic() < deadline:
            time.sleep(0.1)

    publish_checkpoint(stack, store, topics, 0, base)
    worker.follower.start()
    try:
        worker.wait_for_published_weights()
        credits = []
        for versions in [(), (), (1,), (2, 3, 4), (), ()]:
            if versions:
                publish(*versions)
            worker.step()
            credits.append((worker.backend.version, worker.credit))
    finally:
        worker.follower.stop()
        worker.sink.close()
        worker.metrics_out.close()
        worker.code_runner.close()
    assert credits == [(0, 8), (0, 0), (1, 0), (4, 8), (4, 0), (4, 0)]
    assert worker.stats.quota_waits == 1
    started = Counter(events[0][2].policy_version for events in events_by_episode(stack, topics).values())
    assert started == {0: 16, 1: 8, 4: 24}
