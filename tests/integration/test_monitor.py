"""The monitor as a process: its /metrics figures equal counts taken from the topics here, and its report."""
from __future__ import annotations

import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from confluent_kafka import TopicPartition
from prometheus_client.parser import text_string_to_metric_families

from consumers.report import PLOTS
from infra.kafka import consumer, read_topic
from infra.metrics import Metrics
from infra.settings import Settings
from schemas import codec
from schemas.records import CheckpointPublished, DeadLetter, PipelineMetric, SandboxResult, Trajectory
from schemas.topics import Topics
from tests.conftest import ROOT
from tests.taps import episode, produce, publish, publish_in_transaction, trajectory, turn

pytestmark = pytest.mark.integration
T0 = 1_700_000_000_000
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> Samples:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def fill(stack: Settings, topics: Topics) -> None:
    outcomes = ["passed", "failed", "timeout", "failed", "syntax_error"]
    produce(stack, topics.events, [e for i, o in enumerate(outcomes) for e in episode(f"ep-{i}", T0, outcome=o)])
    publish(stack, topics.deadletter, [DeadLetter(reason=r, detail="", stage="clean", source_topic=topics.events,
                                                  partition=0, offset=i, key=None, original=b"", ts=T0)
                                       for i, r in enumerate(["bad_magic", "truncated", "bad_magic"])])
    rewards = [("math", 1.0, 1), ("math", 0.0, 2), ("math", 0.25, 2), ("code", 0.5, 1), ("code", 0.75, 3)]
    publish(stack, topics.scored, [trajectory(f"s{i}", r, domain=d, group_id=f"g{i}", turns=[turn(" 4", version=v)])
                                   for i, (d, r, v) in enumerate(rewards)])
    publish(stack, topics.checkpoints, [CheckpointPublished(run="r", version=3, step=30, bucket="b", prefix="p",
                                                            manifest_key="m", manifest_sha256="s", algorithm="grpo",
                                                            batch_ids=(), ts=T0)], key=b"r")
    publish(stack, topics.metrics, [PipelineMetric(source="learner", name="loss/policy", value=v, window_end=T0 + i)
                                    for i, v in enumerate([0.9, 0.4])])
    windows = []  # two windows of a rollout worker's and the shard writer's own figures
    for episodes, batches in ((16, 2), (8, 1)):
        rollout, shards = Metrics("rollout"), Metrics("shards")
        rollout.count("rollout/episodes", episodes, producer="w1", status="completed")
        rollout.gauge("rollout/tokens_per_s", 10.0 * episodes, producer="w1")
        shards.count("shards/batches", batches)
        shards.observe("shards/write_s", 0.5)
        windows += rollout.flush(T0, T0 + 1000) + shards.flush(T0, T0 + 1000)
    # the streams worker's cumulative counters: partition 0 counted 5, then 9 (after a restart it goes on from
    # its stored count, never from 0), partition 1 counted 4
    windows += [PipelineMetric(source="streams", name="streams/events", value=v, labels={"partition": p},
                               window_end=T0 + i, total=True) for i, (p, v) in enumerate([("0", 5), ("1", 4), ("0", 9)])]
    publish(stack, topics.metrics, windows)


def commit_streams_position(stack: Settings, topics: Topics, offset: int) -> str:
    """A consumer group of the namespace that has read `offset` records of each events partition."""
    group = f"{topics.ns}.streams"
    c = consumer(stack, group)
    c.commit(offsets=[TopicPartition(topics.events, p, offset) for p in range(topics.partitions)], asynchronous=False)
    c.close()
    return group


def expected(stack: Settings, topics: Topics, group: str, offset: int) -> Samples:
    """The same figures, counted here from the topics."""
    out: Samples = {}
    outcomes: Counter[str] = Counter()
    ends: list[int] = []
    for topic in (topics.events, topics.deadletter, topics.scored, topics.checkpoints, topics.metrics):
        msgs = list(read_topic(stack, topic))
        out[("trajpipe_events_total", (("topic", topic),))] = len(msgs)
        if topic == topics.events:
            bodies = [codec.decode(m.value()).body for m in msgs]
            outcomes.update(b.outcome for b in bodies if isinstance(b, SandboxResult))
            per_partition = Counter(m.partition() for m in msgs)
            ends = [per_partition[p] for p in range(topics.partitions)]
            unread = [m.timestamp()[1] for m in msgs if m.offset() == offset]  # the group's first uncommitted
            out[("trajpipe_queue_oldest_unread_timestamp_seconds", (("group", group), ("topic", topics.events)))] = \
                min(unread) / 1000
        if topic == topics.deadletter:
            for reason, n in Counter(codec.decode(m.value(), DeadLetter).reason for m in msgs).items():
                out[("trajpipe_deadletter_total", (("reason", reason),))] = n
        if topic == topics.scored:
            by_domain: dict[str, list[float]] = {}
            solved: dict[str, list[bool]] = {}
            for m in msgs:
                t = codec.decode(m.value(), Trajectory)
                by_domain.setdefault(t.domain, []).append(t.reward)
                solved.setdefault(t.domain, []).append(any(v >= 1.0 for k, v in t.reward_components.items()
                                                           if k.startswith("outcome/")))
            for domain, flags in solved.items():
                out[("trajpipe_success_rate", (("domain", domain),))] = sum(flags) / len(flags)
            for domain, values in by_domain.items():
                out[("trajpipe_reward_mean", (("domain", domain),))] = statistics.fmean(values)
                out[("trajpipe_reward_std", (("domain", domain),))] = statistics.pstdev(values)
                out[("trajpipe_scored_trajectories_total", (("domain", domain),))] = len(values)
    newest: dict[tuple[tuple[str, str], ...], dict[str, float]] = {}  # cumulative: per partition
    for message in read_topic(stack, topics.metrics):
        metric = codec.decode(message.value(), PipelineMetric)
        labels = {k: v for k, v in metric.labels.items() if not (metric.total and k == "partition")}
        key = (("labels", ",".join(f"{k}={v}" for k, v in sorted(labels.items()))), ("name", metric.name),
               ("source", metric.source))
        if metric.total:
            newest.setdefault(key, {})[metric.labels["partition"]] = metric.value
            continue
        out[("trajpipe_service", key)] = metric.value
        total = out.get(("trajpipe_service_windows_total", key), 0.0)
        out[("trajpipe_service_windows_total", key)] = total + metric.value
    for key, partitions in newest.items():
        out[("trajpipe_service", key)] = out[("trajpipe_service_windows_total", key)] = sum(partitions.values())
    assert out[("trajpipe_service", (("labels", ""), ("name", "streams/events"), ("source", "streams")))] == 13
    for outcome, n in outcomes.items():
        out[("trajpipe_sandbox_outcomes_total", (("outcome", outcome),))] = n
    out[("trajpipe_consumer_lag", (("group", group), ("topic", topics.events)))] = sum(max(0, e - offset) for e in ends)
    out[("trajpipe_policy_version", (("source", "checkpoint"),))] = 3
    out[("trajpipe_learner", (("name", "loss/policy"),))] = 0.4
    return out


def mismatches(want: Samples, got: Samples) -> dict[str, tuple[float, object]]:
    return {f"{k[0]}{dict(k[1])}": (v, got.get(k)) for k, v in want.items()
            if got.get(k) is None or abs(got[k] - v) > 1e-9}


@pytest.mark.slow
def test_metrics_match_counts_taken_from_the_topics(stack: Settings, topics: Topics, tmp_path: Path) -> None:
    fill(stack, topics)
    group = commit_streams_position(stack, topics, offset=3)
    want = expected(stack, topics, group, offset=3)
    port = free_port()
    report = tmp_path / "report"
    proc = subprocess.Popen([sys.executable, "-m", "consumers.monitor", "--ns", topics.ns, "--port", str(port),
                             "--addr", "127.0.0.1", "--no-tui", "--duration", "120", "--report", str(report)],
                            cwd=ROOT, env={**os.environ, **stack.as_env()}, stderr=subprocess.PIPE, text=True)
    try:
        deadline, diff = time.monotonic() + 90, {"not scraped": (0.0, None)}
        while diff and time.monotonic() < deadline:
            time.sleep(1.0)
            try:
                diff = mismatches(want, scrape(port))
            except OSError:
                continue
        assert not diff, diff
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    summary = (report / "summary.md").read_text()
    assert all((report / name).stat().st_size > 0 for name in PLOTS)
    assert "| bad_magic | 2 |" in summary and f"| {group} | {topics.events} |" in summary
    # the headline service figures: the streams counter's partitions summed, the rollout windows summed
    assert "| streams/events | 13 |" in summary and "| rollout/episodes | 24 |" in summary


def run_report(stack: Settings, topics: Topics, out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "consumers.monitor", "--ns", topics.ns, "--port", "0", "--addr",
                           "127.0.0.1", "--no-tui", "--report", str(out), *args], cwd=ROOT, timeout=180,
                          env={**os.environ, **stack.as_env()}, capture_output=True, text=True)


def test_a_report_read_to_the_end_counts_every_record_and_a_cut_short_one_says_so(stack: Settings, topics: Topics,
                                                                                    tmp_path: Path) -> None:
    # more records than one consume() call returns, on both partitions: the demo's report used to read for 5 s
    # and printed whatever it had by then (28k of 59k trajectories) as the run's totals
    produce(stack, topics.events, [e for i in range(1500) for e in episode(f"ep-{i}", T0 + 10 * i, group_id=f"g{i % 7}")])
    # and a transactional writer's records, whose commit marker ends the partition past its last record
    publish_in_transaction(stack, topics.metrics, [PipelineMetric(source="java", name="x", value=1.0, window_end=T0)])
    n = sum(1 for _ in read_topic(stack, topics.events))
    assert n == 1500 * 4
    done = run_report(stack, topics, tmp_path / "full", "--to-end", "--duration", "150")
    assert done.returncode == 0, done.stderr
    summary = (tmp_path / "full" / "summary.md").read_text()
    assert f"| {topics.events} | {n} | 0 |" in summary and "Partial" not in summary
    assert "| passed | 1500 |" in summary  # every SandboxResult folded, once
    cut = run_report(stack, topics, tmp_path / "cut", "--to-end", "--duration", "0")
    assert cut.returncode == 0, cut.stderr
    assert f"read 0 of the {n + 2:,} offsets" in (tmp_path / "cut" / "summary.md").read_text()  # + record, marker
