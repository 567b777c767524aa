"""Demonstrations through the log: a task's gold completion recorded as an episode the learner can imitate.

    python -m producers --ns demo --sources reverse --demonstrations 2048    # publish, then exit

Each demonstration is an ordinary episode whose turns carry policy_version DEMONSTRATION_VERSION: the text
came from the task source, not from a policy, so its log-probs are meaningless (zeros). Streams score it
like any episode (a wrong gold answer shows as a failed outcome), the learner's SFT phase imitates the ones
that solve their task, and RL never uses them.

A task whose answer is checked by running it (code, terminal) is played: `DemonstrationRunner` takes the
rollout worker's episode runner through the gold turns (the canonical solution; the fixing call, then
`submit`), so its code runs in the sandbox and the log holds the same facts as for any episode, with the
observations the policy reads in the same form. Streams score it by those facts, as a policy's episode; a
demonstration without them would score as unsolved and never be imitated. Other tasks are three events
(EpisodeStarted, one PolicyTurn, EpisodeEnded).
"""
from __future__ import annotations

import sys
import time
from typing import Any, Callable, Iterable, Optional

from producers.episodes import EpisodeRunner, StepSummary
from producers.policy.interface import Generation, Prompts, Sampling, Tokenizer
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
from schemas.toolcalls import ToolCall

PLAYED = ("code", "terminal")  # domains whose demonstrations run in the sandbox
CHUNK = 64  # played demonstrations per step of the episode runner (its sandbox calls go out together)


def gold_turns(task: Task) -> list[str]:
    """What a demonstration of the task says, turn by turn."""
    if task.demonstration is None:
        raise ConfigError(f"task {task.task_id} ({task.domain}) has no demonstration")
    if task.domain == "terminal":
        return [task.demonstration, ToolCall("submit").text()]
    return [task.demonstration]


class DemonstrationBackend:
    """The policy of a played demonstration: the model's tokenizer, and the version that marks a demonstration.
    `DemonstrationRunner` says the gold turns itself, so nothing is ever sampled."""

    version = DEMONSTRATION_VERSION

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def generate(self, prompts: Prompts, n: int, sampling: Sampling) -> list[list[Generation]]:
        raise NotImplementedError("a demonstration says its task's gold turns: DemonstrationRunner.generate")

    def load_weights(self, state: Any, version: int) -> None:
        raise NotImplementedError("a demonstration has no weights")


class DemonstrationRunner(EpisodeRunner):
    """The rollout worker's episode runner, each episode saying its task's gold turns instead of sampling."""

    def generate(self, live: list[Any], first: bool, summary: StepSummary) -> None:
        for ep in live:
            turns = gold_turns(ep.task)
            text = turns[min(ep.turn, len(turns) - 1)]
            tokens = self.backend.tokenizer.completion(text)
            ep.last = Generation(tokens, [0.0] * len(tokens), text, "stop")
            ep.context += tokens
            summary.tokens += len(tokens)
            summary.turns += 1


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
                           emit: Callable[[RolloutEvent], None], played: Optional[DemonstrationRunner] = None) -> int:
    """Emit one demonstration episode per task (code and terminal tasks played by `played`); returns how many."""
    count, chunk = 0, []
    for task in tasks:
        if task.domain not in PLAYED:
            for event in demonstration_events(task, tokenizer, run, producer_id):
                emit(event)
            count += 1
            continue
        if played is None:
            raise ConfigError(f"a {task.domain} demonstration runs in the sandbox: it needs a DemonstrationRunner")
        chunk.append(task)
        if len(chunk) == CHUNK:
            count += _play(played, chunk)
    return count + (_play(played, chunk) if chunk and played is not None else 0)


def _play(played: DemonstrationRunner, tasks: list[Task]) -> int:
    summary = played.run_step(tasks)
    print(f"[demonstrations] played {summary.episodes} in the sandbox: {summary.statuses}"
          + (f", {summary.skipped_too_long} longer than the context" if summary.skipped_too_long else ""),
          file=sys.stderr, flush=True)
    tasks.clear()
    return summary.episodes
