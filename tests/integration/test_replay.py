"""Replay against the real broker and store: time ranges, the archive after the topic is gone, re-scoring."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from typing import Any

import pytest
from confluent_kafka import Message

from consumers.archive import ArchiveBounds, Archiver
from consumers.rescore import latest_scored, run_streams
from infra.bootstrap import delete_topics
from infra.kafka import read_topic
from infra.objectstore import ObjectStore
from infra.settings import Settings
from schemas import codec
from schemas.records import Trajectory
from schemas.topics import Topics
from tests.conftest import ROOT
from tests.taps import episode, produce

pytestmark = pytest.mark.integration
T0 = 1_700_000_000_000
STREAMS_CLI = (ROOT / "streams" / "__main__.py").exists()


def replay_cli(stack: Settings, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "consumers.replay", "--no-progress", *args], cwd=ROOT,
                          env={**os.environ, **stack.as_env()}, capture_output=True, text=True, timeout=timeout)


def replay_ok(stack: Settings, *args: str, timeout: float = 300) -> dict[str, Any]:
    out = replay_cli(stack, "--json", *args, timeout=timeout)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def rows(messages: list[Message]) -> list[tuple[Any, ...]]:
    """What a verbatim replay keeps of every record: its position too."""
    return sorted((m.partition(), m.offset(), m.key(), m.value(), m.timestamp()[1]) for m in messages)


def per_partition(messages: list[Message]) -> dict[int, list[tuple[Any, ...]]]:
    out: dict[int, list[tuple[Any, ...]]] = {}
    for m in sorted(messages, key=lambda m: (m.partition(), m.offset())):
        out.setdefault(m.partition() or 0, []).append((m.key(), m.value(), m.timestamp()[1]))
    return out


def test_a_time_range_replay_selects_exactly_the_events_in_the_range(stack: Settings, topics: Topics) -> None:
    since, until = T0 + 10_000, T0 + 20_000
    events = [e for i in range(6) for e in episode(f"before-{i}", T0 + 100 * i)]
    events += [e for i in range(6) for e in episode(f"inside-{i}", since + 100 * i)]
    events += [e for i in range(6) for e in episode(f"after-{i}", until + 100 * i)]
    produce(stack, topics.events, events)
    target = f"{topics.ns}-day"
    summary = replay_ok(stack, "--from-ns", topics.ns, "--to-ns", target,
                        "--since", "2023-11-14T22:13:30Z", "--until", str(until))
    source = list(read_topic(stack, topics.events))
    copied = list(read_topic(stack, Topics(target).events))
    wanted = [m for m in source if since <= m.timestamp()[1] < until]
    assert per_partition(copied) == per_partition(wanted)  # bytes, keys, times, partitions and order
    assert summary["episodes"] == 6 and summary["copied"] == 24
    assert summary["outside_window"] <= topics.partitions  # the time index skipped the earlier events


def test_replay_from_the_archive_after_the_topic_is_gone(stack: Settings, topics: Topics, store: ObjectStore) -> None:
    produce(stack, topics.events, [e for i in range(5) for e in episode(f"ep-{i}", T0 + 1000 * i)])
    archiver = Archiver(stack, topics.ns, ArchiveBounds(max_events=7), store=store)
    archiver.run_once(timeout_s=60)
    archiver.close()
    original = list(read_topic(stack, topics.events))
    delete_topics(stack, [topics.events])
    target = f"{topics.ns}-back"
    summary = replay_ok(stack, "--from-ns", topics.ns, "--to-ns", target, "--from-archive")
    restored = list(read_topic(stack, Topics(target).events))
    assert summary["copied"] == len(original) == 20
    assert rows(restored) == rows(original)  # byte for byte, at the same partitions and offsets


def test_replay_refuses_the_source_and_a_used_target(stack: Settings, topics: Topics) -> None:
    produce(stack, topics.events, episode("ep", T0))
    same = replay_cli(stack, "--from-ns", topics.ns, "--to-ns", topics.ns)
    assert same.returncode == 1 and "must differ" in same.stderr
    target = f"{topics.ns}-once"
    replay_ok(stack, "--from-ns", topics.ns, "--to-ns", target)
    again = replay_cli(stack, "--from-ns", topics.ns, "--to-ns", target)
    assert again.returncode == 1 and "already holds events" in again.stderr


def recorded_run() -> list:  # type: ignore[type-arg]
    """Math groups of two: right or wrong answers, some truncated (default v2 penalises those 0.5 more)."""
    shapes = [(" 4", "completed", " 5", "completed"), (" 4", "truncated", " 5", "completed"),
              (" 4", "completed", " 4", "truncated"), (" 5", "truncated", " 4", "completed")]
    events = []
    for g, (text_a, status_a, text_b, status_b) in enumerate(shapes):
        for k, (text, status) in enumerate(((text_a, status_a), (text_b, status_b))):
            events += episode(f"ep-{g}-{k}", T0 + 1000 * g + 10 * k, group_id=f"grp-{g}", task_id=f"t-{g}",
                              text=text, status=status, sandbox=False,
                              finish="length" if status == "truncated" else "stop")
    return events


def latest_trajectories(settings: Settings, ns: str) -> dict[str, Trajectory]:
    """Every scored trajectory of a namespace by id, before the group stage's zero-variance filter."""
    return {t.trajectory_id: t for t in (codec.decode(m.value(), Trajectory)
                                         for m in read_topic(settings, Topics(ns).trajectories))}


def comparable(t: Trajectory, source_topic: str, reward_version: str = "1") -> bytes:
    # The trajectory names the topic it was read from, which is the replayed namespace's own.
    return codec.encode(replace(t, source_topic=source_topic, reward_version=reward_version))


@pytest.mark.slow
@pytest.mark.skipif(not STREAMS_CLI, reason="needs the streams worker (python -m streams)")
def test_replay_reproduces_scores_and_differs_only_where_the_reward_does(stack: Settings, topics: Topics) -> None:
    from streams.rewards import get_reward_fn

    produce(stack, topics.events, recorded_run())
    run_streams(stack, topics.ns, "default:1", settle_s=10, timeout_s=300)
    original = latest_scored(stack, topics.ns)
    assert original

    same = f"{topics.ns}-same"
    replay_ok(stack, "--from-ns", topics.ns, "--to-ns", same)
    run_streams(stack, same, "default:1", settle_s=10, timeout_s=300)
    again = latest_scored(stack, same)
    assert {i: comparable(t, topics.events) for i, t in again.items()} == {
        i: codec.encode(t) for i, t in original.items()}

    v2 = f"{topics.ns}-v2"
    summary = replay_ok(stack, "--from-ns", topics.ns, "--to-ns", v2, "--score", "default:2", "--settle", "10",
                        timeout=600)
    # Compared before the group filter: a new reward can make a group's rewards (un)equal, and so change
    # which zero-variance groups are dropped from the scored topic.
    before, after = latest_trajectories(stack, topics.ns), latest_trajectories(stack, v2)
    assert set(after) == set(before) and {t.reward_version for t in after.values()} == {"2"}
    v1_fn, v2_fn = get_reward_fn("default", "1"), get_reward_fn("default", "2")
    differs = {i for i, t in before.items() if v2_fn(t).total != v1_fn(t).total}
    assert differs and {i for i, t in after.items() if t.reward != before[i].reward} == differs
    assert all(after[i].reward == v2_fn(before[i]).total for i in before)
    rescored = latest_scored(stack, v2)
    assert summary["scored"]["by_reward"] == {"default:2": len(rescored)}
    assert summary["scored"]["changed"] == len(differs & set(rescored) & set(original))
