"""The streams worker as a process against the real broker: outputs, dead letters, kill -9 recovery, determinism.

Outputs are at-least-once: after a crash a trajectory may be re-sent, so these tests (like the shard writer)
dedupe downstream by trajectory id; what must hold is that none is lost and none differs.
"""
from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest
from confluent_kafka import TopicPartition

from infra.bootstrap import bootstrap
from infra.claims import offload
from infra.kafka import Publisher, consumer, end_offsets, read_topic
from infra.objectstore import ObjectStore
from infra.settings import Settings
from schemas.codec import codec
from schemas.packing import pack_floats, pack_ids
from schemas.records import DeadLetter, PipelineMetric, PolicyTurn, TaskStats, Trajectory
from schemas.topics import Topics
from tests.streams_data import Episode, RecordedStream, events_of, recorded_stream

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
FAST = ["--episode-timeout-s", "4", "--group-timeout-s", "4", "--sweep-interval-s", "0.5",
        "--metrics-window-s", "1", "--dedupe-horizon-s", "3600"]


STARTED: list["Worker"] = []


@pytest.fixture(autouse=True)
def no_worker_outlives_its_test() -> Iterator[None]:
    yield
    while STARTED:
        worker = STARTED.pop()
        if worker.proc.poll() is None:
            worker.kill()


class Worker:
    """`python -m streams` as a child process, its log in `log`."""

    def __init__(self, stack: Settings, ns: str, log: Path, *args: str, fault: str = "") -> None:
        # no restart on failure, so that a test sees it, unless a fault is injected (see infra.faults)
        env = {**os.environ, **stack.as_env(), "PYTHONUNBUFFERED": "1",
               "TRAJPIPE_STREAMS_RESTARTS": "0" if fault else "1000", "TRAJPIPE_FAULT": fault}
        self.log = log
        self.proc = subprocess.Popen([sys.executable, "-m", "streams", "--ns", ns, *FAST, *args], cwd=ROOT, env=env,
                                     stdout=subprocess.DEVNULL, stderr=log.open("a"))
        STARTED.append(self)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)

    def kill(self) -> None:
        self.proc.kill()  # SIGKILL: no flush, no commit
        self.proc.wait(10)

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(f"the worker exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")


def publish(stack: Settings, topics: Topics, messages: list[tuple[bytes, bytes]]) -> None:
    publisher = Publisher(stack)
    for key, value in messages:
        publisher.send(topics.events, key, value)
    publisher.close()


def count(stack: Settings, topic: str) -> int:
    return sum(hi - lo for lo, hi in end_offsets(stack, topic).values())


def wait_until(check: Callable[[], bool], worker: Worker, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        worker.check_alive()
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out; worker log:\n{worker.log.read_text()[-3000:]}")
        time.sleep(0.5)


def records(stack: Settings, topic: str) -> list[Any]:
    return [codec.decode(m.value()) for m in read_topic(stack, topic)]


def by_id(stack: Settings, topic: str) -> dict[str, bytes]:
    """Trajectory id -> record bytes; a re-sent record must be byte-identical to the first."""
    out: dict[str, bytes] = {}
    for message in read_topic(stack, topic):
        tid = codec.decode(message.value(), expect=Trajectory).trajectory_id
        assert out.setdefault(tid, message.value()) == message.value(), f"{tid} re-sent with different bytes"
    return out


def committed(stack: Settings, topics: Topics) -> int:
    c = consumer(stack, topics.streams_app_id)
    try:
        parts = [TopicPartition(topics.events, p) for p in range(topics.partitions)]
        return sum(max(tp.offset, 0) for tp in c.committed(parts, timeout=10))
    finally:
        c.close()


def ended_ids(stream: RecordedStream) -> set[str]:
    return {e.trajectory_id for e in stream.episodes}  # the abandoned one too: the sweeper closes it


def counters(stack: Settings, topics: Topics) -> Counter[tuple[str, tuple[tuple[str, str], ...]]]:
    """The worker's counters as a reader of the metrics topic takes them: the newest cumulative value of each
    partition, summed over the partitions."""
    newest: dict[tuple[str, tuple[tuple[str, str], ...], str], float] = {}
    for m in records(stack, topics.metrics):
        if isinstance(m, PipelineMetric) and m.total:
            labels = tuple(sorted((k, v) for k, v in m.labels.items() if k != "partition"))
            newest[(m.name, labels, m.labels["partition"])] = m.value
    out: Counter[tuple[str, tuple[tuple[str, str], ...]]] = Counter()
    for (name, labels, _), value in newest.items():
        out[(name, labels)] += int(value)
    return out


def metric_total(stack: Settings, topics: Topics, name: str) -> float:
    return sum(n for (counter, _), n in counters(stack, topics).items() if counter == name)


def window_sum(stack: Settings, topics: Topics, name: str) -> float:
    """The same counter summed over per-window records, as the worker published them before its counters were
    cumulative (a replayed batch then counted twice)."""
    return sum(m.value for m in records(stack, topics.metrics)
               if isinstance(m, PipelineMetric) and m.name == name and not m.total)


def run_to_completion(stack: Settings, topics: Topics, stream: RecordedStream, log: Path,
                      worker: Optional[Worker] = None) -> Worker:
    worker = worker or Worker(stack, topics.ns, log)
    wait_until(lambda: count(stack, topics.scored) >= len(stream.expect_scored)
               and count(stack, topics.trajectories) >= len(stream.episodes)
               and count(stack, topics.deadletter) >= sum(stream.expect_reasons.values()), worker)
    return worker


def test_a_recorded_stream_gives_exactly_the_expected_outputs(stack: Settings, topics: Topics,
                                                              tmp_path: Path) -> None:
    stream = recorded_stream(run=topics.ns)
    publish(stack, topics, stream.messages)
    worker = run_to_completion(stack, topics, stream, tmp_path / "worker.log")
    time.sleep(2)  # a metrics window after the last record
    assert worker.stop() == 0, "SIGTERM must stop the worker cleanly"

    scored = [codec.decode(v) for v in by_id(stack, topics.scored).values()]
    assert sorted(t.trajectory_id for t in scored) == sorted(stream.expect_scored)
    assert all(t.reward_fn == "default" and t.reward_version == "1" and t.reward_components for t in scored)
    trajectories = records(stack, topics.trajectories)
    assert {t.trajectory_id for t in trajectories} == ended_ids(stream)
    assert Counter(t.status for t in trajectories if t.status != "completed") == {"abandoned": 1, "aborted": 1}
    letters = records(stack, topics.deadletter)
    assert all(isinstance(d, DeadLetter) and d.source_topic == topics.events for d in letters)
    assert Counter(d.reason for d in letters) == stream.expect_reasons
    stats = records(stack, topics.task_stats)
    assert isinstance(stats[0], TaskStats) and {s.task_id for s in stats} >= {"math/g-math-allright"}
    # every input event accounted for: folded, dead-lettered, or a counted duplicate
    assert metric_total(stack, topics, "streams/duplicates") == stream.duplicates
    assert metric_total(stack, topics, "streams/events") == stream.events
    assert metric_total(stack, topics, "streams/accepted") + len(letters) + stream.duplicates == stream.events
    assert sum(len(t.source_offsets) for t in trajectories) == metric_total(stack, topics, "streams/accepted")


def test_a_small_buffer_pauses_and_resumes_the_partitions_and_the_outputs_stay_exact(
        stack: Settings, topics: Topics, tmp_path: Path) -> None:
    """Records of the agents' topics go into their channels without Faust's conductor (streams.runtime); with a
    buffer of 8 events, each channel fills and drains over and over, pausing and resuming its partition's fetch.
    Every record is handed over once: no restart, no record fetched twice, the outputs exactly as expected."""
    stream = recorded_stream(run=topics.ns)
    publish(stack, topics, stream.messages)
    log = tmp_path / "worker.log"
    worker = run_to_completion(stack, topics, stream, log,
                               Worker(stack, topics.ns, log, "--batch-max", "4", "--buffer-maxsize", "8"))
    time.sleep(2)
    assert worker.stop() == 0
    text = log.read_text()
    assert "restarting" not in text and "Traceback" not in text, text[-3000:]
    assert sorted(codec.decode(v).trajectory_id for v in by_id(stack, topics.scored).values()) == \
        sorted(stream.expect_scored)
    assert metric_total(stack, topics, "streams/events") == stream.events
    handed = re.search(r"(\d+) records handed to the agents without the conductor", text)
    assert handed, text[-3000:]
    assert int(handed.group(1)) == stream.events + count(stack, topics.trajectories)


@pytest.mark.slow
def test_kill_9_mid_stream_loses_no_episode_and_recovers_the_half_sent_ones(stack: Settings, topics: Topics,
                                                                           tmp_path: Path) -> None:
    stream = recorded_stream(run=topics.ns, bad=False, duplicates=0)
    half = len(stream.messages) // 2
    first, rest = stream.messages[:half], stream.messages[half:]
    straddling = {k for k, _ in first} & {k for k, _ in rest}
    assert straddling, "the split must leave episodes half sent"
    publish(stack, topics, first)
    log = tmp_path / "worker.log"
    # half-sent episodes and groups must wait out the kill, not be abandoned or emitted short
    patient = ("--episode-timeout-s", "30", "--group-timeout-s", "30")
    worker = Worker(stack, topics.ns, log, *patient)
    # the first half is processed and its offsets committed, so only the changelog remembers those events
    wait_until(lambda: committed(stack, topics) >= half, worker)
    worker.kill()
    publish(stack, topics, rest)
    worker = Worker(stack, topics.ns, log, *patient)
    wait_until(lambda: len(by_id(stack, topics.scored)) >= len(stream.expect_scored)
               and len(by_id(stack, topics.trajectories)) >= len(stream.episodes), worker, timeout=180)
    assert worker.stop() == 0

    trajectories = by_id(stack, topics.trajectories)
    assert set(trajectories) == ended_ids(stream)
    assert set(by_id(stack, topics.scored)) == stream.expect_scored
    episodes = {e.episode_id.encode(): e for e in stream.episodes}
    for key in straddling:
        traj = codec.decode(trajectories[episodes[key].trajectory_id])
        n_events = sum(1 for k, _ in stream.messages if k == key)
        assert len(traj.source_offsets) == n_events, f"{key!r} lost the events from before the kill"
        assert (traj.status == "abandoned") == (episodes[key].status is None)


@pytest.mark.slow
def test_counters_stay_exact_when_a_worker_is_killed_9_between_a_batch_and_its_commit(
        stack: Settings, topics: Topics, tmp_path: Path) -> None:
    """The kill comes after the third batch's outputs and metrics are on the broker and before its offsets can
    be committed: the restarted worker processes those batches again, and counts each input once."""
    stream = recorded_stream(run=topics.ns)
    publish(stack, topics, stream.messages)
    log = tmp_path / "worker.log"
    first = Worker(stack, topics.ns, log, "--batch-max", "16", fault="processed_batch:3")
    assert first.proc.wait(120) == -signal.SIGKILL, log.read_text()[-3000:]
    assert committed(stack, topics) < 3 * 16, "the batches before the kill must come again"
    assert any(isinstance(m, PipelineMetric) and m.total for m in records(stack, topics.metrics))
    worker = run_to_completion(stack, topics, stream, log, Worker(stack, topics.ns, log, "--batch-max", "16"))
    time.sleep(2)  # a metrics window after the last record
    assert worker.stop() == 0

    trajectories = by_id(stack, topics.trajectories)
    letters = {(d.source_topic, d.partition, d.offset, d.reason): d for d in records(stack, topics.deadletter)}
    got = counters(stack, topics)
    assert metric_total(stack, topics, "streams/events") == stream.events
    assert metric_total(stack, topics, "streams/duplicates") == stream.duplicates
    assert metric_total(stack, topics, "streams/accepted") == sum(
        len(codec.decode(v).source_offsets) for v in trajectories.values())
    assert {labels[0][1]: n for (name, labels), n in got.items() if name == "streams/trajectories"} == \
        Counter(codec.decode(v).status for v in trajectories.values())
    assert Counter({dict(labels)["reason"]: n for (name, labels), n in got.items() if name == "streams/deadletters"}) \
        == Counter(reason for (_, _, _, reason) in letters) == stream.expect_reasons
    scored = by_id(stack, topics.scored)
    assert metric_total(stack, topics, "streams/scored") == len(scored) == len(stream.expect_scored)
    assert window_sum(stack, topics, "streams/events_per_s") > 0  # the windows still carry the rates
    assert not window_sum(stack, topics, "streams/events")  # and no counter


def long_episode(i: int, run: str, tokens: int) -> list[tuple[bytes, bytes]]:
    """One math episode of group g-long whose single turn is `tokens` long (right when i is even)."""
    ep = Episode(f"ep-long-{i}", "g-long", "math", 16, i % 2 == 0)
    rng = random.Random(i)
    text = "".join(rng.choice("abcdefgh ") for _ in range(tokens - 40)) + (" The answer is 7" if ep.right
                                                                          else " The answer is 8")
    events = []
    for event in events_of(ep, 1_000 * (i + 1), run=run):
        if isinstance(event.body, PolicyTurn):
            event = replace(event, body=replace(event.body, text=text, tokens=pack_ids(
                [rng.randrange(3, 259) for _ in range(tokens)]), logprobs=pack_floats([-0.5] * tokens)))
        events.append((ep.episode_id.encode(), codec.encode(event)))
    return events


def test_a_group_of_16_trajectories_of_32k_tokens_each_is_scored_without_a_restart(
        stack: Settings, topics: Topics, tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    worker = Worker(stack, topics.ns, log, "--group-timeout-s", "120")
    # 15 members first, so the open group is kept in the changelog, then the 16th
    publish(stack, topics, [m for i in range(15) for m in long_episode(i, topics.ns, 32_768)])
    wait_until(lambda: count(stack, topics.trajectories) >= 15, worker)
    time.sleep(3)  # the group agent takes in the 15 and writes the open group
    publish(stack, topics, long_episode(15, topics.ns, 32_768))
    wait_until(lambda: count(stack, topics.scored) >= 16, worker, timeout=180)
    assert worker.stop() == 0
    scored = records(stack, topics.scored)
    assert len({t.trajectory_id for t in scored}) == 16 and all(len(t.turns[0].tokens) == 4 * 32_768 for t in scored)
    assert "restarting" not in log.read_text()
    largest = max(len(m.value() or b"") for m in read_topic(stack, topics.changelog("groups")))
    assert largest < 1024 * 1024, f"a groups changelog value of {largest} bytes"


def test_a_wedged_worker_notices_it_and_restarts_within_the_stall_limit(stack: Settings, topics: Topics,
                                                                        tmp_path: Path) -> None:
    stream = recorded_stream(run=topics.ns, bad=False, duplicates=0)
    publish(stack, topics, stream.messages)
    log = tmp_path / "worker.log"
    started = time.monotonic()
    # its events agent hangs on the first batch, as a client stuck after a broker restart would
    worker = Worker(stack, topics.ns, log, "--stall-restart-s", "10", fault="wedged_batch:1")
    wait_until(lambda: len(by_id(stack, topics.scored)) >= len(stream.expect_scored)
               and len(by_id(stack, topics.trajectories)) >= len(stream.episodes), worker, timeout=120)
    took = time.monotonic() - started
    assert worker.stop() == 0
    text = log.read_text()
    assert "streams worker stuck: no progress for" in text and "records waiting on" in text, text[-3000:]
    assert text.count("restarting (attempt") == 1  # the fault fires once; the restarted process finishes
    assert set(by_id(stack, topics.trajectories)) == ended_ids(stream)
    print(f"a wedged worker restarted and finished in {took:.0f} s")


@pytest.mark.slow
def test_the_same_input_twice_gives_byte_identical_scored_trajectories(stack: Settings, ns: str,
                                                                        tmp_path: Path) -> None:
    stream = recorded_stream(run="twice")
    outputs = []
    for suffix in ("a", "b"):
        bootstrap(stack, ns + suffix, partitions=2)
        topics = Topics(ns + suffix, partitions=2)
        publish(stack, topics, stream.messages)
        worker = run_to_completion(stack, topics, stream, tmp_path / f"worker-{suffix}.log")
        assert worker.stop() == 0
        outputs.append((by_id(stack, topics.scored), by_id(stack, topics.trajectories)))
    (scored_a, trajectories_a), (scored_b, trajectories_b) = outputs
    assert len(scored_a) == len(stream.expect_scored) and len(trajectories_a) == len(stream.episodes)
    # the only difference allowed is source_topic, which names the namespace (same length here)
    a_topic, b_topic = (Topics(ns + suffix).events.encode() for suffix in ("a", "b"))
    assert {k: v.replace(a_topic, b_topic) for k, v in scored_a.items()} == scored_b
    assert {k: v.replace(a_topic, b_topic) for k, v in trajectories_a.items()} == trajectories_b


def test_claim_checked_turns_are_fetched_from_the_object_store(stack: Settings, topics: Topics, store: ObjectStore,
                                                              tmp_path: Path) -> None:
    kept, lost = Episode("ep-claim-0", "g-claim", "math", 2, True), Episode("ep-claim-1", "g-claim", "math", 2, False)
    messages = []
    for ep in (kept, lost):
        for event in events_of(ep, 1_000, run=topics.ns):
            event = offload(event, store, topics.ns, threshold=8)  # every PolicyTurn goes through MinIO
            if isinstance(event.body, PolicyTurn) and ep is lost:
                store.delete(event.body.claim.key)  # type: ignore[union-attr]
            messages.append((ep.episode_id.encode(), codec.encode(event)))
    publish(stack, topics, messages)
    worker = Worker(stack, topics.ns, tmp_path / "worker.log")
    wait_until(lambda: count(stack, topics.trajectories) >= 1 and count(stack, topics.deadletter) >= 2, worker)
    assert worker.stop() == 0
    (traj,) = records(stack, topics.trajectories)
    original = events_of(kept, 1_000, run=topics.ns)[1].body
    assert traj.episode_id == kept.episode_id and traj.turns[0].tokens == original.tokens
    assert [d.reason for d in records(stack, topics.deadletter)] == ["claim_unavailable", "bad_step"]


def test_a_namespace_that_was_not_bootstrapped_is_refused_with_the_fix(stack: Settings, ns: str) -> None:
    env = {**os.environ, **stack.as_env()}
    done = subprocess.run([sys.executable, "-m", "streams", "--ns", ns], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "python -m infra bootstrap" in done.stderr


def test_a_partition_count_that_does_not_match_is_refused(stack: Settings, topics: Topics) -> None:
    env = {**os.environ, **stack.as_env()}
    done = subprocess.run([sys.executable, "-m", "streams", "--ns", topics.ns, "--partitions", "3"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "pass --partitions 2" in done.stderr


def test_demonstrations_published_by_a_worker_reach_the_scored_topic(stack: Settings, topics: Topics,
                                                                       tmp_path: Path) -> None:
    env = {**os.environ, **stack.as_env(), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "producers", "--ns", topics.ns, "--sources", "reverse",
                           "--demonstrations", "12", "--layers", "2", "--width", "64"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert count(stack, topics.events) == 36          # started, the gold turn, ended: per demonstration
    worker = Worker(stack, topics.ns, tmp_path / "streams.log")
    wait_until(lambda: count(stack, topics.scored) >= 12, worker)  # groups of one, kept: they teach by imitation
    assert worker.stop() == 0
    scored = [t for t in records(stack, topics.scored) if isinstance(t, Trajectory)]
    assert len({t.trajectory_id for t in scored}) == 12
    assert all(t.reward_components["outcome/correct"] == 1.0 and t.reward_components["status/demonstration"] == 1.0
               and t.advantage == 0.0 and t.domain == "text" for t in scored)


def holders(stack: Settings, topics: Topics) -> list[set[int]]:
    """The events partitions each member of the streams group holds."""
    from infra.kafka import group_assignment

    try:
        return sorted(group_assignment(stack, topics.streams_app_id, topics.events).values(), key=sorted)
    except Exception:  # the group is forming
        return []


@pytest.mark.slow
def test_workers_share_the_partitions_a_killed_ones_move_and_a_spare_one_idles(stack: Settings, topics: Topics,
                                                                               tmp_path: Path) -> None:
    """Two workers from the start; one is killed -9 mid-stream and its partition moves; a third joins, then a
    fourth that finds no partition and idles. Every ended episode in exactly one trajectory id, re-sends
    byte-identical, and the task pass counts on the feed equal counts made from the trajectories topic."""
    from producers.feeds import TaskStatsFollower
    from streams import grouping

    stream = recorded_stream(run=topics.ns)  # its event times span 3.2 s: no episode idles 8 s of them
    # A group waits in wall time too: one whose members come from episodes of the killed worker's partition
    # waits out the group session timeout (10 s) and the takeover, so its timeout is longer than both.
    spare = ["--unassigned-restart-s", "3", "--episode-timeout-s", "8", "--group-timeout-s", "20"]
    a, b = Worker(stack, topics.ns, tmp_path / "a.log", *spare), Worker(stack, topics.ns, tmp_path / "b.log", *spare)
    wait_until(lambda: holders(stack, topics) == [{0}, {1}], a, timeout=90)
    half = len(stream.messages) // 2
    publish(stack, topics, stream.messages[:half])
    # a few episodes of the first half end; the others stay open (the rest of their events comes next) and
    # must be closed by whichever worker holds their partition then
    wait_until(lambda: count(stack, topics.trajectories) >= 2, b)
    a.kill()
    publish(stack, topics, stream.messages[half:])
    run_to_completion(stack, topics, stream, tmp_path / "b.log", worker=b)  # b took over a's partition
    c = Worker(stack, topics.ns, tmp_path / "c.log", *spare)
    wait_until(lambda: len(holders(stack, topics)) == 2 and all(holders(stack, topics)), c, timeout=90)
    # b let go of the state of the partition c took (c recovered it from the changelog)
    assert re.search(r"holding partitions \[\d\]; let go of \d+", b.log.read_text()), b.log.read_text()[-3000:]
    d = Worker(stack, topics.ns, tmp_path / "d.log", *spare)
    wait_until(lambda: len(holders(stack, topics)) == 3, d, timeout=90)
    time.sleep(12)  # four watchdog rounds past --unassigned-restart-s
    d.check_alive()
    assert "stuck" not in d.log.read_text() and "restarting" not in d.log.read_text(), d.log.read_text()[-2000:]
    assert sorted(len(h) for h in holders(stack, topics)) == [0, 1, 1]
    for worker in (b, c, d):
        assert worker.stop() == 0

    trajectories = [codec.decode(v) for v in by_id(stack, topics.trajectories).values()]  # re-sends identical
    assert {t.trajectory_id for t in trajectories} == ended_ids(stream)
    scored = by_id(stack, topics.scored)
    assert sorted(scored) == sorted(stream.expect_scored)
    expected: dict[str, tuple[int, int]] = {}
    for t in trajectories:
        attempts, passes = expected.get(t.task_id, (0, 0))
        if grouping.is_trainable(t):
            expected[t.task_id] = (attempts + 1, passes + int(grouping.passed(t)))
    stats: dict[str, tuple[int, int]] = {}
    follower = TaskStatsFollower(stack, topics, stats)
    for message in read_topic(stack, topics.task_stats):
        follower.fold(message.key(), codec.decode(message.value(), TaskStats))
    assert stats == {task: counts for task, counts in expected.items() if counts[0]}
