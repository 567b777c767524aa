"""Demonstrations: each source's gold completion, recorded as an episode, is scored as solving its task."""
from __future__ import annotations

from typing import Any

import pytest


from learner.update import TrainConfig, skip_reason
from producers.demonstrations import (
    DemonstrationBackend,
    DemonstrationRunner,
    demonstration_events,
    publish_demonstrations,
)
from producers.policy.tokenizer import PolicyTokenizer
from producers.sandbox import unavailable_reason
from producers.sandbox_runner import SandboxCodeRunner
from producers.settings import WorkerSettings
from producers.tasks import load_source
from producers.tasks.split import SplitSource
from producers.tasks.strings import StringReversalSource
from schemas.errors import ConfigError
from schemas.packing import unpack_ids
from schemas.records import DEMONSTRATION_VERSION, PolicyTurn, RolloutEvent, SourcePosition
from streams import assembly
from streams.scoring import Scorer
from streams.validation import validate
from transformers import ByT5Tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> PolicyTokenizer:
    return PolicyTokenizer(ByT5Tokenizer())


@pytest.mark.parametrize("name, seed", [("reverse", 0), ("math-easy", 0), ("math", 1), ("table", 2)])
def test_every_gold_completion_scores_as_solved(tokenizer: PolicyTokenizer, name: str, seed: int) -> None:
    source = load_source(name, seed=seed)
    scorer = Scorer.load("default", "1")
    for index in (0, 3, 7):
        events = demonstration_events(source[index], tokenizer, "run", "demos")
        state = None
        for offset, event in enumerate(events):
            validate(event)
            state = assembly.fold(state, event, SourcePosition(0, offset))
        assert state is not None
        scored = scorer.score(assembly.to_trajectory(state, "run.rollout.events"))
        assert scored.reward_components["outcome/correct"] == 1.0, (source[index].task_id, scored.turns[0].text)
        assert scored.reward_components["status/demonstration"] == 1.0
        assert {t.policy_version for t in scored.turns} == {DEMONSTRATION_VERSION}


def test_a_demonstration_ends_with_eos_and_adds_no_bos(tokenizer: PolicyTokenizer) -> None:
    task = StringReversalSource(seed=0)[5]
    turn = demonstration_events(task, tokenizer, "run", "demos")[1].body
    assert isinstance(turn, PolicyTurn)
    ids = unpack_ids(turn.tokens)
    assert ids[-1] in tokenizer.eos_token_ids and tokenizer.decode(ids) == task.spec["answer"]
    assert len(turn.logprobs) == 4 * len(ids)


def test_a_task_without_a_demonstration_is_refused(tokenizer: PolicyTokenizer) -> None:
    task = load_source("math-easy")[0]
    bare = type(task)(task.task_id, task.domain, task.prompt, task.spec)
    with pytest.raises(ConfigError, match="no demonstration"):
        demonstration_events(bare, tokenizer, "run", "demos")


def test_reversal_tasks_are_reproducible_and_held_out_words_are_never_trained() -> None:
    a, b = StringReversalSource(seed=0, size=2000), StringReversalSource(seed=0, size=2000)
    assert [a[i].prompt for i in range(50)] == [b[i].prompt for i in range(50)]
    assert [a[i].prompt for i in range(50)] != [StringReversalSource(seed=1, size=2000)[i].prompt for i in range(50)]
    train, held = SplitSource(a, "train"), SplitSource(a, "heldout")
    train_words = {train[i].task_id for i in range(len(train))}
    held_words = {held[i].task_id for i in range(len(held))}
    assert not train_words & held_words and 0.1 < len(held) / len(a) < 0.3
    task = a[0]
    assert task.spec["answer"] == task.prompt.removeprefix("reverse ").removesuffix(":")[::-1]
    assert 3 <= len(task.spec["answer"]) <= 6


@pytest.mark.skipif(unavailable_reason("bwrap") is not None, reason=f"the bwrap sandbox: {unavailable_reason('bwrap')}")
@pytest.mark.parametrize("name", ["humaneval", "terminal"])
def test_demonstrations_checked_by_running_them_are_played_in_the_sandbox_and_imitated(
        tokenizer: PolicyTokenizer, name: str) -> None:
    """Code and terminal answers are verified by their sandbox results: a demonstration has them (the gold
    solution ran against the tests; the fixing call and `submit` ran on the repository), so it scores as
    solved and the SFT phase imitates it."""
    source = load_source(name)
    tasks = [source[i] for i in (0, 3, 7, 11)]
    events: list[RolloutEvent] = []
    settings = WorkerSettings(ns="run", producer_id="demos", group_size=1, prompts_per_step=1, max_new_tokens=64)
    runner = SandboxCodeRunner("bwrap", workers=2)
    try:
        played = DemonstrationRunner(DemonstrationBackend(tokenizer), runner, events.append, settings,
                                     max_context=1 << 16)
        assert publish_demonstrations(tasks, tokenizer, "run", "demos", events.append, played) == len(tasks)
    finally:
        runner.close()
    states: dict[str, Any] = {}
    for offset, event in enumerate(events):
        validate(event)
        states[event.episode_id] = assembly.fold(states.get(event.episode_id), event, SourcePosition(0, offset))
    scorer, config = Scorer.load("default", "1"), TrainConfig(algorithm="sft")
    assert len(states) == len(tasks)
    for state in states.values():
        scored = scorer.score(assembly.to_trajectory(state, "run.rollout.events"))
        assert scored.status == "completed" and all(t.outcome == "passed" for t in scored.turns if t.outcome)
        assert scored.reward_components["outcome/tests_passed"] == 1.0, [t.text for t in scored.turns]
        assert scored.reward_components["status/demonstration"] == 1.0
        assert {t.policy_version for t in scored.turns} == {DEMONSTRATION_VERSION}
        assert skip_reason(scored, config) is None  # the SFT phase trains on it
    if name == "terminal":  # the fixing call, then submit, each with its result
        assert {len(state.turns) for state in states.values()} == {2}
