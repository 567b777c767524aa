"""Demonstrations: each source's gold completion, recorded as an episode, is scored as solving its task."""
from __future__ import annotations

import pytest

from producers.demonstrations import demonstration_events
from producers.policy.tokenizer import PolicyTokenizer
from producers.tasks import load_source
from producers.tasks.split import SplitSource
from producers.tasks.strings import StringReversalSource
from schemas.errors import ConfigError
from schemas.packing import unpack_ids
from schemas.records import DEMONSTRATION_VERSION, PolicyTurn, SourcePosition
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
