"""Records for the tests of the taps (archive, replay, lineage, monitor, export): episodes and trajectories."""
from __future__ import annotations

import json
from dataclasses import replace
from typing import Optional, Sequence

from confluent_kafka import Producer

from infra.kafka import producer_config
from infra.settings import Settings
from schemas.codec import codec
from schemas.keys import new_event_id, trajectory_id
from schemas.packing import pack_floats, pack_ids
from schemas.records import (
    EpisodeEnded,
    EpisodeStarted,
    PolicyTurn,
    RolloutEvent,
    SandboxResult,
    SourcePosition,
    Trajectory,
    TrajectoryTurn,
)

MATH_SPEC = json.dumps({"answer": "4"})


def episode(episode_id: str, ts: int, domain: str = "math", task_id: str = "t-1", group_id: str = "g-1",
            policy_version: int = 0, turns: int = 1, outcome: str = "passed", status: str = "completed",
            run: str = "test", versions: Optional[list[int]] = None, text: str = " 4", sandbox: bool = True,
            finish: str = "stop") -> list[RolloutEvent]:
    """EpisodeStarted, then per turn a PolicyTurn (and a SandboxResult), then EpisodeEnded; ts, ts+1, ..."""
    versions = versions or [policy_version] * (turns * (2 if sandbox else 1) + 2)
    bodies: list = [EpisodeStarted(prompt_text="2+2=", prompt_tokens=pack_ids([5, 6]), task_spec=MATH_SPEC,
                                   group_size=2, max_turns=turns, temperature=1.0, max_new_tokens=8)]
    for turn in range(turns):
        bodies.append(PolicyTurn(turn=turn, obs_text="" if turn == 0 else "error\n", obs_tokens=b"", text=text,
                                 tokens=pack_ids([7, 8]), logprobs=pack_floats([-0.5, -0.25]), finish_reason=finish))
        if sandbox:
            bodies.append(SandboxResult(turn=turn, outcome=outcome, tests_passed=1, tests_total=1, stdout="",
                                        stderr="", duration_ms=3, backend="subprocess"))
    bodies.append(EpisodeEnded(status=status, num_turns=turns))
    return [RolloutEvent(event_id=new_event_id(ts + i), run=run, episode_id=episode_id, group_id=group_id,
                         task_id=task_id, domain=domain, policy_version=versions[i], producer_id="test",
                         ts=ts + i, seq=i, body=body)
            for i, body in enumerate(bodies)]


def produce(settings: Settings, topic: str, events: list[RolloutEvent], timestamps: Optional[list[int]] = None) -> None:
    """Publish events keyed by episode with the given record timestamps (default: each event's ts)."""
    producer = Producer(producer_config(settings))
    for i, ev in enumerate(events):
        producer.produce(topic, key=ev.episode_id.encode(), value=codec.encode(ev),
                         timestamp=timestamps[i] if timestamps else ev.ts)
    assert producer.flush(60) == 0


def publish(settings: Settings, topic: str, records: list[object], key: Optional[bytes] = None) -> None:
    """Publish any top-level records (trajectories, dead letters, manifests...) to `topic`."""
    producer = Producer(producer_config(settings))
    for rec in records:
        producer.produce(topic, key=key, value=codec.encode(rec))
    assert producer.flush(60) == 0


def turn(text: str, obs_text: str = "", version: int = 0, outcome: str = "", finish: str = "stop") -> TrajectoryTurn:
    return TrajectoryTurn(turn=0, policy_version=version, obs_text=obs_text, obs_tokens=b"", text=text,
                          tokens=pack_ids([1, 2]), logprobs=pack_floats([-0.1, -0.2]), finish_reason=finish,
                          outcome=outcome)


def trajectory(episode_id: str, reward: float = 1.0, domain: str = "math", group_id: str = "g-1",
               status: str = "completed", turns: Optional[list[TrajectoryTurn]] = None,
               components: Optional[dict[str, float]] = None, prompt: str = "2+2=") -> Trajectory:
    return Trajectory(
        trajectory_id=trajectory_id(episode_id), episode_id=episode_id, group_id=group_id, task_id="t-1",
        domain=domain, run="test", status=status, task_spec=MATH_SPEC, prompt_text=prompt,
        prompt_tokens=pack_ids([5, 6]), turns=tuple(turns or [turn(" 4")]), reward=reward,
        reward_components=components or {"outcome/correct": reward}, reward_fn="default", reward_version="1",
        advantage=0.0, group_reward_mean=0.0, group_reward_std=0.0, source_topic="x.rollout.events",
        source_offsets=(SourcePosition(0, 0),), started_ts=1, ended_ts=2)


def with_turns(t: Trajectory, *turns: TrajectoryTurn) -> Trajectory:
    return replace(t, turns=tuple(turns))


def publish_in_transaction(settings: Settings, topic: str, records: Sequence[object], key: Optional[bytes] = None) -> None:
    """Records written by a transactional producer (as a Java or Flink writer may): the commit marker takes an
    offset after the last record, so the partition's end lies past it."""
    p = Producer(producer_config(settings, **{"transactional.id": f"trajpipe-tests-{topic}", "message.timeout.ms": 60_000}))
    p.init_transactions(30)
    p.begin_transaction()
    for record in records:
        p.produce(topic, codec.encode(record), key=key)
    p.commit_transaction(30)
