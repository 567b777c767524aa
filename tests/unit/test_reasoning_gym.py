"""reasoning-gym datasets as domains: every one that is registered verifies its gold answer and rejects a wrong one."""
from __future__ import annotations

import json

import pytest

from producers.tasks import load_source
from producers.tasks.reasoning_gym import EXCLUDED, ReasoningGymDomain, expand, generators
from producers.tasks.split import SplitSource
from schemas.errors import ConfigError, RewardError
from schemas.tasks import DOMAINS, TaskSpecError, decode_task_spec, is_domain
from streams.reasoning import answer_text
from streams.rewards import get_reward_fn
from tests.unit.test_rewards import traj, turn

SCORE = get_reward_fn("default", "1")
WRONG = "definitely not the answer 12345"


def scored(task_spec: str, domain: str, text: str) -> dict[str, float]:
    return SCORE(traj(domain, task_spec, [turn(0, text)])).components


def test_a_hundred_domains_are_registered() -> None:
    assert len(generators()) + len(DOMAINS) >= 100
    assert expand(["rg:*", "math"]) == [f"rg:{g}" for g in generators()] + ["math"]


@pytest.mark.parametrize("generator", generators())
def test_each_dataset_verifies_its_gold_answer_and_rejects_a_wrong_one(generator: str) -> None:
    source = ReasoningGymDomain(generator, seed=3, size=5)
    task = source[2]
    assert task.domain == f"rg/{generator}" and is_domain(task.domain) and task.demonstration is not None
    gold = scored(task.task_spec, task.domain, task.demonstration)
    assert gold["outcome/correct"] == 1.0 and gold["process/answer_found"] == 1.0, generator
    assert scored(task.task_spec, task.domain, WRONG)["outcome/correct"] == 0.0, generator


def test_the_verifier_regenerates_the_task_and_never_trusts_the_events_gold_answer() -> None:
    task = ReasoningGymDomain("basic_arithmetic", seed=1, size=10)[4]
    forged = json.dumps({**decode_task_spec(task.task_spec), "answer": "999999"})
    assert scored(forged, task.domain, f"Answer: {task.spec['answer']}")["outcome/correct"] == 1.0
    assert scored(forged, task.domain, "Answer: 999999")["outcome/correct"] == 0.0


def test_an_unknown_dataset_or_a_bad_spec_is_a_reward_error_for_the_dead_letters() -> None:
    spec = json.dumps({"v": 1, "domain": "rg/no_such_dataset", "generator": "no_such_dataset", "seed": 0,
                       "index": 0, "size": 5})
    with pytest.raises(RewardError, match="no_such_dataset"):
        SCORE(traj("rg/no_such_dataset", spec, [turn(0, "1")]))
    with pytest.raises(TaskSpecError, match="generator"):
        decode_task_spec(json.dumps({"v": 1, "domain": "rg/leg_counting", "generator": "basic_arithmetic",
                                     "seed": 0, "index": 0, "size": 5}))
    assert not is_domain("rg/") and not is_domain("rg/Bad-Name") and not is_domain("gym/leg_counting")


def test_excluded_and_unknown_datasets_are_refused_with_the_reason() -> None:
    with pytest.raises(ConfigError, match=EXCLUDED["composite"]):
        load_source("rg:composite")
    with pytest.raises(ConfigError, match="rg:\\*"):
        load_source("rg:nope")


def test_sources_split_by_task_id_and_answers_are_read_from_the_last_mark() -> None:
    source = load_source("rg:leg_counting", seed=0)
    held = SplitSource(source, "heldout")
    train = SplitSource(source, "train")
    assert len(held) + len(train) == len(source) and 0 < len(held) < len(train)
    assert {held[i].task_id for i in range(len(held))}.isdisjoint(train[i].task_id for i in range(len(train)))
    assert answer_text("so the answer is 4. Final answer: 12") == "12"
    assert answer_text("it is \\boxed{x + 1} surely") == "x + 1" and answer_text(" 7\n") == "7"
