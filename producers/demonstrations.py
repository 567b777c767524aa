"""Demonstrations through the log: a task's gold completion recorded as an episode the learner can imitate.

    python -m producers --ns demo --sources reverse --demonstrations 2048    # publish, then exit

Each demonstration is an ordinary episode (EpisodeStarted, one PolicyTurn, EpisodeEnded) whose turn carries
policy_version DEMONSTRATION_VERSION: the text came from the task source, not from a policy, so its
log-probs are meaningless (zeros). Streams score it like any episode (a wrong gold answer shows as a failed
outcome), the learner's SFT phase imitates the ones that solve their task, and RL never uses them.
"""
from __future__ import annotations

import time
from typing import Callable, Iterable

from producers.policy.interface import Tokenizer
from producers.tasks.task import Task
from schemas.errors import ConfigError
from schemas.keys import new_event_id
from schemas.packing import pack_floats, pack_ids
from schemas.records import (
    DEMONSTRATION_VERSION,
    Body,
    EpisodeEnded,
    EpisodeStarted,
    PolicyTurn,
    RolloutEvent,
)


def demonstration_events(task: Task, tokenizer: Tokenizer, run: str, producer_id: str) -> list[RolloutEvent]:
    """The three events of one demonstration episode (a group of one)."""
    if task.demonstration is None:
        raise ConfigError(f"task {task.task_id} ({task.domain}) has no demonstration")
    prompt = tokenizer.prompt(task.prompt)
    tokens = tokenizer.completion(task.demonstration)
    episode_id, group_id = "ep-" + new_event_id(), "demo-" + new_event_id()
    bodies: list[Body] = [
        EpisodeStarted(prompt_text=task.prompt, prompt_tokens=pack_ids(prompt), task_spec=task.task_spec,
                       group_size=1, max_turns=1, temperature=1.0, max_new_tokens=len(tokens)),
        PolicyTurn(turn=0, obs_text="", obs_tokens=b"", text=task.demonstration, tokens=pack_ids(tokens),
                   logprobs=pack_floats([0.0] * len(tokens)), finish_reason="stop"),
        EpisodeEnded(status="completed", num_turns=1, detail="demonstration"),
    ]
    now = int(time.time() * 1000)
    return [RolloutEvent(event_id=new_event_id(now), run=run, episode_id=episode_id, group_id=group_id,
                         task_id=task.task_id, domain=task.domain, policy_version=DEMONSTRATION_VERSION,
                         producer_id=producer_id, ts=now, seq=seq, body=body) for seq, body in enumerate(bodies)]


def publish_demonstrations(tasks: Iterable[Task], tokenizer: Tokenizer, run: str, producer_id: str,
                           emit: Callable[[RolloutEvent], None]) -> int:
    """Emit one demonstration episode per task; returns how many."""
    count = 0
    for task in tasks:
        for event in demonstration_events(task, tokenizer, run, producer_id):
            emit(event)
        count += 1
    return count
