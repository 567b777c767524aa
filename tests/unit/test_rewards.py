"""Reward functions on crafted trajectories: outcomes, equivalent answers, process credit, penalties, versions."""
from __future__ import annotations

import time
from typing import Any

import pytest

from producers.tasks import TableQASource
from schemas.errors import ConfigError, PipelineError, RewardError
from schemas.packing import pack_ids
from schemas.records import Trajectory, TrajectoryTurn
from schemas.tasks import decode_task_spec, encode_task_spec, make_spec
from streams.rewards import (
    REWARDS,
    RewardResult,
    extract_final_answer,
    get_reward_fn,
    math_equivalent,
    register,
)

CODE_SPEC = encode_task_spec(make_spec("code", entry_point="add", tests="def check(candidate): pass"))
V1, V2, OUTCOME = get_reward_fn("default", "1"), get_reward_fn("default", "2"), get_reward_fn("outcome", "1")


def math_spec(answer: str, **extra: Any) -> str:
    return encode_task_spec(make_spec("math", answer=answer, **extra))


def turn(i: int, text: str, outcome: str = "", passed: int = 0, total: int = 0, finish: str = "stop",
         tokens: bytes = b"") -> TrajectoryTurn:
    return TrajectoryTurn(turn=i, policy_version=0, obs_text="", obs_tokens=b"", text=text, tokens=tokens,
                          logprobs=b"", finish_reason=finish, outcome=outcome, tests_passed=passed,
                          tests_total=total)


def traj(domain: str, spec: str, turns: list[TrajectoryTurn], status: str = "completed") -> Trajectory:
    return Trajectory(
        trajectory_id="tr-1", episode_id="ep-1", group_id="g-1", task_id="t-1", domain=domain, run="test",
        status=status, task_spec=spec, prompt_text="", prompt_tokens=b"", turns=tuple(turns), reward=0.0,
        reward_components={}, reward_fn="", reward_version="", advantage=0.0, group_reward_mean=0.0,
        group_reward_std=0.0, source_topic="t.rollout.events", source_offsets=(), started_ts=0, ended_ts=1)


def math_traj(text: str, answer: str = "7", **kwargs: Any) -> Trajectory:
    finish = kwargs.pop("finish", "stop")
    return traj("math", math_spec(answer), [turn(0, text, finish=finish)], **kwargs)


def code_traj(*runs: tuple[str, int, int], status: str = "completed") -> Trajectory:
    turns = [turn(i, "    return a + b\n", outcome, passed, total) for i, (outcome, passed, total) in enumerate(runs)]
    return traj("code", CODE_SPEC, turns, status=status)


# ---- registry ------------------------------------------------------------------------------------------


def test_registry_lookup_and_unknown_versions() -> None:
    assert {("default", "1"), ("default", "2"), ("outcome", "1")} <= set(REWARDS)
    with pytest.raises(ConfigError, match="default v1"):
        get_reward_fn("default", "9")
    with pytest.raises(ValueError, match="already registered"):
        register("default", "1")(lambda t: RewardResult(0.0, {}))


def test_a_failing_reward_fn_raises_reward_error() -> None:
    @register("broken", "test")
    def broken(trajectory: Trajectory) -> RewardResult:
        raise KeyError("boom")

    try:
        with pytest.raises(RewardError, match="broken vtest failed on tr-1"):
            get_reward_fn("broken", "test")(math_traj("7"))
    finally:
        del REWARDS[("broken", "test")]
    assert issubclass(RewardError, PipelineError)


# ---- code ----------------------------------------------------------------------------------------------


def test_code_all_tests_pass() -> None:
    result = V1(code_traj(("passed", 7, 7)))
    assert result.components["outcome/tests_passed"] == 1.0
    assert result.components["process/syntax_ok"] == 1.0
    assert result.total == pytest.approx(1.2)


def test_code_partial_tests() -> None:
    result = V1(code_traj(("failed", 3, 7)))
    assert result.components["outcome/tests_passed"] == pytest.approx(3 / 7)
    assert result.total == pytest.approx(3 / 7 + 0.1 + 0.1 * 3 / 7)


def test_code_syntax_error() -> None:
    result = V1(code_traj(("syntax_error", 0, 7)))
    assert result.components["process/syntax_ok"] == 0.0
    assert result.components["outcome/tests_passed"] == 0.0
    assert result.total == 0.0


def test_code_multi_turn_fix_scores_the_final_turn_and_credits_progress() -> None:
    fixed = V1(code_traj(("syntax_error", 0, 7), ("passed", 7, 7)))
    assert fixed.components["outcome/tests_passed"] == 1.0
    assert fixed.components["process/syntax_ok"] == 0.5
    regressed = V1(code_traj(("failed", 5, 7), ("failed", 2, 7)))
    assert regressed.components["outcome/tests_passed"] == pytest.approx(2 / 7)
    assert regressed.components["process/tests_partial"] == pytest.approx(5 / 7)


def test_code_without_test_counts_uses_the_outcome() -> None:
    assert V1(code_traj(("passed", 0, 0))).components["outcome/tests_passed"] == 1.0
    assert V1(code_traj(("runtime_error", 0, 0))).components["outcome/tests_passed"] == 0.0
    assert V1(code_traj()).components["outcome/tests_passed"] == 0.0


def test_code_sandbox_infra_error_is_not_trainable() -> None:
    result = V1(code_traj(("infra_error", 0, 0)))
    assert result.total == 0.0
    assert result.components == {"status/not_trainable": 1.0, "status/infra_error": 1.0}


# ---- math ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["7", " 7", "3+4=7", "The answer is 7.", "Answer: 7", "so \\boxed{7}",
                                  "7\n", "x = 7.0", "$7$"])
def test_math_correct_answers(text: str) -> None:
    result = V1(math_traj(text))
    assert result.components["outcome/correct"] == 1.0, text
    assert result.total == pytest.approx(1.1)


@pytest.mark.parametrize("text", ["8", "3+4=8", "The answer is 77", "\\boxed{6} though 7 is close"])
def test_math_wrong_answers(text: str) -> None:
    result = V1(math_traj(text))
    assert result.components == {"status/not_trainable": 0.0, "outcome/correct": 0.0,
                                  "process/answer_found": 1.0, "penalty/truncated": 0.0, "penalty/overlong": 0.0}
    assert result.total == pytest.approx(0.1)


def test_math_without_an_answer_gets_nothing() -> None:
    result = V1(math_traj("I do not know"))
    assert result.components["process/answer_found"] == 0.0 and result.total == 0.0


@pytest.mark.parametrize("gold, text", [("1/2", "0.5"), ("0.5", "1/2"), ("0.5", "\\boxed{\\frac{1}{2}}"),
                                        ("1692", "1,692"), ("30", "30.0"), ("-204", "= -204"),
                                        ("\\frac{3}{4}", "0.75")])
def test_math_equivalent_forms(gold: str, text: str) -> None:
    assert V1(math_traj(text, answer=gold)).components["outcome/correct"] == 1.0


@pytest.mark.parametrize("gold, candidate", [("1/2", "0.51"), ("2", "-2"), ("1692", "1,693")])
def test_math_non_equivalent_forms(gold: str, candidate: str) -> None:
    assert not math_equivalent(gold, candidate)


def test_math_answer_extraction_order() -> None:
    assert extract_final_answer("\\boxed{\\frac{1}{2}} = 3") == "\\frac{1}{2}"
    assert extract_final_answer("2+2=4\nanswer: 5 apples") == "5 apples"
    assert extract_final_answer("2+2=4") == "4"
    assert extract_final_answer("it is 1,692 or 12") == "12"
    assert extract_final_answer("nothing here") is None


def test_math_pathological_answers_are_rejected_quickly() -> None:
    start = time.monotonic()
    assert V1(math_traj("\\boxed{9^{9^{9}}}")).components["outcome/correct"] == 0.0
    assert V1(math_traj("\\boxed{100000!}")).components["outcome/correct"] == 0.0
    assert time.monotonic() - start < 5


# ---- table ---------------------------------------------------------------------------------------------


def table_task() -> tuple[str, dict[str, Any]]:
    task = next(t for t in (TableQASource(seed=1, size=40)[i] for i in range(40)) if t.spec["unit"] == "percent")
    return task.task_spec, decode_task_spec(task.task_spec, "table")


def cells_text(spec: dict[str, Any]) -> str:
    return ", ".join(f"{c['row']} {c['column']} = {c['value']:,}" for c in spec["cells"])


def test_table_correct_answer_citing_the_cells() -> None:
    spec_text, spec = table_task()
    text = f"{cells_text(spec)}.\nAnswer: {spec['answer']}%"
    result = V1(traj("table", spec_text, [turn(0, text)]))
    assert result.components["outcome/correct"] == 1.0
    assert result.components["process/cells_cited"] == 1.0
    assert result.total == pytest.approx(1.2)


def test_table_answer_within_tolerance_and_outside() -> None:
    spec_text, spec = table_task()
    gold = float(spec["answer"])
    close = V1(traj("table", spec_text, [turn(0, f"{gold + 0.004:.4f}")]))
    far = V1(traj("table", spec_text, [turn(0, f"{gold + 0.02:.2f}")]))
    assert close.components["outcome/correct"] == 1.0
    assert far.components["outcome/correct"] == 0.0


def test_table_cells_cited_by_value_or_label() -> None:
    spec_text, spec = table_task()
    first = spec["cells"][0]
    by_value = V1(traj("table", spec_text, [turn(0, f"{first['value']} so {spec['answer']}")]))
    by_label = V1(traj("table", spec_text, [turn(0, f"{first['row']} gives {spec['answer']}")]))
    none = V1(traj("table", spec_text, [turn(0, spec["answer"])]))
    assert by_value.components["process/cells_cited"] >= 1 / len(spec["cells"])
    assert by_label.components["process/cells_cited"] >= 1 / len(spec["cells"])
    assert none.components["process/cells_cited"] == 0.0


def test_table_value_must_not_be_part_of_a_longer_number() -> None:
    spec_text = encode_task_spec(make_spec("table", answer="2.00", tolerance=0.005, cells=[
        {"statement": "Balance sheet", "row": "Inventory", "column": "FY2020", "value": 1234}]))
    assert V1(traj("table", spec_text, [turn(0, "12345 so 2")])).components["process/cells_cited"] == 0.0
    assert V1(traj("table", spec_text, [turn(0, "1,234 so 2")])).components["process/cells_cited"] == 1.0


# ---- penalties and statuses ----------------------------------------------------------------------------


def test_truncation_by_status_or_finish_reason() -> None:
    by_status = V1(math_traj("7", status="truncated"))
    by_length = V1(math_traj("7", finish="length"))
    for result in (by_status, by_length):
        assert result.components["penalty/truncated"] == 1.0
        assert result.total == pytest.approx(1.1 - 0.5)


def test_overlong_penalty_ramps_over_the_last_quarter_of_the_budget() -> None:
    def overlong(n_tokens: int, **spec_extra: Any) -> float:
        t = traj("math", math_spec("7", **spec_extra), [turn(0, "7", tokens=pack_ids([50] * n_tokens))])
        return V1(t).components["penalty/overlong"]

    assert overlong(192) == 0.0
    assert overlong(224) == pytest.approx(0.5)
    assert overlong(300) == 1.0
    assert overlong(30, length_budget=40) == 0.0
    assert overlong(35, length_budget=40) == pytest.approx(0.5)
    # Without token ids the UTF-8 length stands in for them.
    assert V1(math_traj("1" * 255 + " 7")).components["penalty/overlong"] == 1.0


@pytest.mark.parametrize("status", ["abandoned", "aborted", "error"])
def test_untrainable_statuses_score_zero_without_reading_the_spec(status: str) -> None:
    for fn in (V1, V2, OUTCOME):
        result = fn(traj("math", "not json at all", [turn(0, "7")], status=status))
        assert result == RewardResult(0.0, {"status/not_trainable": 1.0})


def test_unknown_status_is_a_reward_error() -> None:
    with pytest.raises(RewardError, match="unknown status 'weird'"):
        V1(math_traj("7", status="weird"))


# ---- versions ------------------------------------------------------------------------------------------


def test_version_2_differs_from_1_only_by_the_truncation_weight() -> None:
    spec_text, spec = table_task()
    cases = [math_traj("7"), math_traj("8"), math_traj("7", status="truncated"), math_traj("8", finish="length"),
             code_traj(("failed", 3, 7)), code_traj(("passed", 7, 7), status="truncated"),
             traj("table", spec_text, [turn(0, spec["answer"], finish="length")]),
             math_traj("7", status="aborted")]
    for case in cases:
        one, two = V1(case), V2(case)
        assert one.components == two.components
        truncated = one.components.get("penalty/truncated", 0.0)
        assert two.total == pytest.approx(one.total - 0.5 * truncated)
    assert sum(V1(c).total != V2(c).total for c in cases) == 4


def test_outcome_version_is_the_outcome_alone() -> None:
    for case in (math_traj("7", status="truncated"), code_traj(("failed", 3, 7))):
        result = OUTCOME(case)
        outcome = result.components.get("outcome/correct", result.components.get("outcome/tests_passed"))
        assert result.total == outcome
        assert result.components == V1(case).components


# ---- malformed task_spec -------------------------------------------------------------------------------


@pytest.mark.parametrize("spec, needle", [
    ("{not json", "not valid JSON"),
    ('"a string"', "JSON object"),
    ('{"domain": "math"}', "missing required key 'answer'"),
    ('{"domain": "table", "answer": "7"}', "missing required key 'tolerance'"),
    ('{"domain": "code", "entry_point": "f"}', "missing required key 'tests'"),
])
def test_bad_task_spec_is_a_reward_error(spec: str, needle: str) -> None:
    domain = decode_domain(spec)
    with pytest.raises(RewardError, match="bad task_spec") as info:
        V1(traj(domain, spec, [turn(0, "7")]))
    assert needle in str(info.value)


def decode_domain(spec: str) -> str:
    for domain in ("code", "table"):
        if f'"{domain}"' in spec:
            return domain
    return "math"


def test_spec_of_another_domain_is_a_reward_error() -> None:
    with pytest.raises(RewardError, match="differs from the episode's domain"):
        V1(traj("table", math_spec("7"), [turn(0, "7")]))
