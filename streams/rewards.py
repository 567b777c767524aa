"""Versioned reward functions: outcome, process and penalty components of a Trajectory, per domain.

    fn = get_reward_fn("default", "1")
    result = fn(trajectory)            # RewardResult(total, components); raises RewardError
    replace(trajectory, reward=result.total, reward_components=result.components,
            reward_fn="default", reward_version="1")

Components are measurements with stable names; a version is a table of weights over them, and
total = sum(weight * component). Registered functions:

    ("default", "1")  outcome + 0.1 * each process component - 0.5 * truncated - 0.2 * overlong
    ("default", "2")  as "1" but the truncation penalty weighs 1.0: a truncated trajectory scores exactly
                      0.5 less than under "1"; every other trajectory scores the same. Components are equal.
    ("outcome", "1")  the outcome component alone (all components still recorded)
    installed packages' functions, entry points "name:version" of group trajpipe.rewards: fn(trajectory,
                      components) -> total over the components measured here (schemas.environments)

Components by domain (all in [0, 1]):
    code   outcome/tests_passed  fraction of tests passed on the last turn the sandbox ran
           process/syntax_ok     fraction of executed turns without a syntax_error
           process/tests_partial best fraction of tests passed on any turn (credit for progress)
    math   outcome/correct       final answer equivalent to the gold one: exact rational compare when both
                                 are plain numbers, else math-verify (so "0.5" == "1/2" == "\\frac{1}{2}")
           process/answer_found  a final answer could be extracted at all (format reward)
    table  outcome/correct       |answer - gold| <= the spec's tolerance
           process/answer_found
           process/cells_cited   fraction of the spec's cells whose row label or value the text mentions
    text   outcome/correct       the first line of the answer, stripped, equals the gold text exactly
           process/answer_found  the answer has a non-empty first line
           process/chars_correct characters equal to the gold one at the same position, over the longer length
    terminal outcome/tests_passed  fraction of the task's tests passing at submit (0 without a submit)
           process/tests_partial best fraction of any run_tests or submit
           process/tests_gained  best fraction minus the first one measured (tests that newly pass)
           process/commands_ok   fraction of run / read_file / write_file calls that succeeded
           process/syntax_ok     fraction of written .py files that compiled
           penalty/tool_errors   fraction of turns that were no valid tool call
           penalty/steps         steps beyond the two a fix needs (a write, a submit), over the step budget
    env/<name>       an installed environment's verify(spec, answer): its own components (schemas.environments)
    rg/<generator>   (streams.reasoning: the task re-generated from its spec, scored by its dataset)
           outcome/correct       the dataset's score_answer is 1
           process/tests_partial the dataset's score in [0, 1] (partial credit where the dataset gives it)
           process/answer_found  an answer could be read (the last \boxed{}, else after "answer:", else the text)
    all    penalty/truncated     status "truncated" or any turn stopped by finish_reason "length"
           penalty/overlong      0 up to 3/4 of the length budget, rising linearly to 1 at the budget
           status/not_trainable  0 here
           status/demonstration  1 when the turns are a task's gold completion (policy_version -1), absent else

Final answers are taken from the last turn's text: the last \\boxed{...}, else the text after the last
"answer:" / "answer is", else after the last "=", else the last number.

Trajectories with status abandoned, aborted or error, and code trajectories whose last executed turn is an
infra_error (the sandbox failed, not the policy), are never trained on: every version scores them 0 with
the single component status/not_trainable = 1 (plus status/infra_error = 1 for the latter), without reading
the task_spec. Any failure inside a reward function surfaces as RewardError (the caller dead-letters it).
"""
from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache, wraps
from typing import Any, Callable, Mapping

from math_verify import parse, verify

from schemas import environments
from schemas.errors import ConfigError, RewardError
from schemas.records import Trajectory, TrajectoryTurn, is_demonstration
from schemas.tasks import ENVIRONMENT, REASONING_GYM, TaskSpecError, decode_task_spec, domain_kind
from schemas.toolcalls import ToolCall, ToolCallError, parse_call
from streams import reasoning

OUTCOME_TESTS = "outcome/tests_passed"
OUTCOME_CORRECT = "outcome/correct"
PROCESS_SYNTAX = "process/syntax_ok"
PROCESS_PARTIAL = "process/tests_partial"
PROCESS_ANSWER = "process/answer_found"
PROCESS_CELLS = "process/cells_cited"
PROCESS_CHARS = "process/chars_correct"
PROCESS_GAINED = "process/tests_gained"
PROCESS_COMMANDS = "process/commands_ok"
PENALTY_TRUNCATED = "penalty/truncated"
PENALTY_OVERLONG = "penalty/overlong"
PENALTY_TOOL_ERRORS = "penalty/tool_errors"
PENALTY_STEPS = "penalty/steps"
NOT_TRAINABLE = "status/not_trainable"
INFRA_ERROR = "status/infra_error"
DEMONSTRATION = "status/demonstration"  # weighs 0 in every version: it marks, it does not reward

TRAINABLE_STATUSES = ("completed", "truncated")
UNTRAINABLE_STATUSES = ("abandoned", "aborted", "error")
# Generated tokens at which penalty/overlong reaches 1, unless the task_spec sets length_budget.
LENGTH_BUDGET = {"code": 1024, "math": 256, "table": 256, "text": 64, "rg": 512, "terminal": 4096}
# Longer answers skip math-verify: sympy on adversarial text (towers of powers) can run for minutes,
# and with its signal-based timeout off (it fails outside the main thread) nothing would stop it.
MAX_SYMBOLIC_CHARS = 64
_FLOAT_SLACK = 1e-9

WEIGHTS_V1: dict[str, float] = {
    OUTCOME_TESTS: 1.0, OUTCOME_CORRECT: 1.0,
    PROCESS_SYNTAX: 0.1, PROCESS_PARTIAL: 0.1, PROCESS_ANSWER: 0.1, PROCESS_CELLS: 0.1, PROCESS_CHARS: 0.1,
    PENALTY_TRUNCATED: -0.5, PENALTY_OVERLONG: -0.2,
    PROCESS_GAINED: 0.1, PROCESS_COMMANDS: 0.1, PENALTY_TOOL_ERRORS: -0.2, PENALTY_STEPS: -0.1,
}
WEIGHTS_V2: dict[str, float] = {**WEIGHTS_V1, PENALTY_TRUNCATED: -1.0}
WEIGHTS_OUTCOME: dict[str, float] = {OUTCOME_TESTS: 1.0, OUTCOME_CORRECT: 1.0}


@dataclass(frozen=True)
class RewardResult:
    total: float
    components: dict[str, float]


RewardFn = Callable[[Trajectory], RewardResult]
REWARDS: dict[tuple[str, str], RewardFn] = {}


def register(name: str, version: str) -> Callable[[RewardFn], RewardFn]:
    """Register under (name, version); the registered function raises nothing but RewardError."""
    def decorate(fn: RewardFn) -> RewardFn:
        if (name, version) in REWARDS:
            raise ValueError(f"reward function {name} v{version} is already registered")

        @wraps(fn)
        def guarded(trajectory: Trajectory) -> RewardResult:
            try:
                result = fn(trajectory)
            except RewardError:
                raise
            except Exception as exc:
                raise RewardError(f"reward {name} v{version} failed on {trajectory.trajectory_id}: {exc!r}") from exc
            if not math.isfinite(result.total):
                raise RewardError(f"reward {name} v{version} gave {result.total} for {trajectory.trajectory_id}")
            return result

        REWARDS[(name, version)] = guarded
        return guarded
    return decorate


def get_reward_fn(name: str, version: str) -> RewardFn:
    if (name, str(version)) not in REWARDS:
        _register_installed()
    try:
        return REWARDS[(name, str(version))]
    except KeyError:
        known = ", ".join(f"{n} v{v}" for n, v in sorted(REWARDS))
        raise ConfigError(f"no reward function {name} v{version}; registered: {known} (and any installed "
                          f"package's, entry points 'name:version' of group {environments.REWARDS_GROUP})") from None


def _register_installed() -> None:
    """Reward functions of installed packages: fn(trajectory, components) -> total over measured components."""
    for (name, version), fn in environments.reward_functions().items():
        if (name, version) in REWARDS:
            continue

        def weigh(trajectory: Trajectory, fn: Callable[..., float] = fn) -> RewardResult:
            components = measure(trajectory)
            if components.get(NOT_TRAINABLE, 0.0):
                return RewardResult(0.0, components)
            return RewardResult(float(fn(trajectory, dict(components))), components)

        register(name, version)(weigh)


# ---- answers -------------------------------------------------------------------------------------------

_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_ANSWER_MARK = re.compile(r"answer\s*(?:is\s*:?|:)", re.IGNORECASE)
_HUGE_POWER = re.compile(r"(?:\^|\*\*)\s*\{?\s*\d{4,}")


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth < 0:
            return text[begin:i]
    return None


def _rest_of_line(text: str, at: int) -> str | None:
    rest = text[at:].split("\n", 1)[0].strip()
    return rest or None


def _after_answer_mark(text: str) -> str | None:
    marks = list(_ANSWER_MARK.finditer(text))
    return _rest_of_line(text, marks[-1].end()) if marks else None


def _after_equals(text: str) -> str | None:
    at = text.rfind("=")
    return _rest_of_line(text, at + 1) if at >= 0 else None


def _last_number(text: str) -> str | None:
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def extract_final_answer(text: str) -> str | None:
    """The final answer of a completion, by the first rule that finds one (see the module docstring)."""
    for finder in (_last_boxed, _after_answer_mark, _after_equals, _last_number):
        found = finder(text)
        if found and found.strip():
            return found.strip()
    return None


def to_number(text: str) -> Fraction | None:
    """A plain number ("1,692", "-0.5", "1/2", "38.25%", "$7.") exactly, else None."""
    cleaned = text.strip().strip("$").rstrip(".").replace("\\%", "%").rstrip("%").strip()
    if not _NUMBER.fullmatch(cleaned):
        return None
    try:
        return Fraction(cleaned.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def _first_number(text: str) -> Fraction | None:
    found = _NUMBER.search(text)
    return to_number(found.group()) if found else None


def _safe_for_sympy(text: str) -> bool:
    powers = text.count("^") + text.count("**")
    return len(text) <= MAX_SYMBOLIC_CHARS and powers <= 1 and "!" not in text and not _HUGE_POWER.search(text)


def math_equivalent(gold: str, candidate: str) -> bool:
    """Exact rational equality for plain numbers, else math-verify equivalence (gold first, as it expects)."""
    gold_number, number = to_number(gold), to_number(candidate)
    if gold_number is not None and number is not None:
        return gold_number == number
    if not _safe_for_sympy(candidate):
        return False
    return bool(verify(parse(gold, parsing_timeout=None), parse(candidate, parsing_timeout=None),
                       timeout_seconds=None))


def table_correct(candidate: str, gold: str, tolerance: float) -> bool:
    """The candidate's number (itself, else its first number) within tolerance of the gold number."""
    value = to_number(candidate)
    value = value if value is not None else _first_number(candidate)
    gold_value = to_number(gold)
    if value is None or gold_value is None:
        return False
    return abs(float(value - gold_value)) <= tolerance + _FLOAT_SLACK


# ---- components ----------------------------------------------------------------------------------------

def _final_text(trajectory: Trajectory) -> str:
    return trajectory.turns[-1].text if trajectory.turns else ""


def _executed(trajectory: Trajectory) -> list[TrajectoryTurn]:
    return [t for t in trajectory.turns if t.outcome]


def _tests_fraction(turn: TrajectoryTurn) -> float:
    if turn.tests_total > 0:
        return min(turn.tests_passed / turn.tests_total, 1.0)
    return 1.0 if turn.outcome == "passed" else 0.0


def code_components(trajectory: Trajectory, spec: Mapping[str, Any]) -> dict[str, float]:
    runs = _executed(trajectory)
    fractions = [_tests_fraction(t) for t in runs]
    syntax_ok = [t.outcome != "syntax_error" for t in runs]
    return {
        OUTCOME_TESTS: fractions[-1] if runs else 0.0,
        PROCESS_SYNTAX: sum(syntax_ok) / len(runs) if runs else 0.0,
        PROCESS_PARTIAL: max(fractions, default=0.0),
    }


def terminal_components(trajectory: Trajectory, spec: Mapping[str, Any]) -> dict[str, float]:
    """From the recorded facts only: each turn's text (the tool call, parsed again) and the sandbox's outcome
    and test counts for the calls that ran."""
    calls = [(_call(turn.text), turn) for turn in trajectory.turns]
    tested = [(c, t) for c, t in calls if c is not None and c.name in ("run_tests", "submit") and t.outcome]
    fractions = [_tests_fraction(t) for _, t in tested]
    last = calls[-1][0] if calls else None
    submitted = last is not None and last.name == "submit" and bool(calls[-1][1].outcome)
    others = [t for c, t in calls if c is not None and c.name in ("run", "read_file", "write_file") and t.outcome]
    writes = [t for c, t in calls if c is not None and c.name == "write_file" and c.arguments["path"].endswith(".py")
              and t.outcome]
    steps, budget = len(trajectory.turns), int(spec.get("max_steps", 8))
    return {
        OUTCOME_TESTS: fractions[-1] if submitted else 0.0,
        PROCESS_PARTIAL: max(fractions, default=0.0),
        PROCESS_GAINED: max(max(fractions) - fractions[0], 0.0) if fractions else 0.0,
        PROCESS_COMMANDS: sum(t.outcome == "passed" for t in others) / len(others) if others else 1.0,
        PROCESS_SYNTAX: sum(t.outcome != "syntax_error" for t in writes) / len(writes) if writes else 1.0,
        PENALTY_TOOL_ERRORS: sum(c is None for c, _ in calls) / steps if steps else 0.0,
        PENALTY_STEPS: min(max(steps - 2, 0) / max(budget - 2, 1), 1.0),  # a write and a submit need two
    }


def _call(text: str) -> ToolCall | None:
    try:
        return parse_call(text)
    except ToolCallError:
        return None


def math_components(trajectory: Trajectory, spec: Mapping[str, Any]) -> dict[str, float]:
    answer = extract_final_answer(_final_text(trajectory))
    correct = answer is not None and math_equivalent(spec["answer"], answer)
    return {OUTCOME_CORRECT: float(correct), PROCESS_ANSWER: float(answer is not None)}


@lru_cache(maxsize=4096)
def _value_pattern(form: str) -> re.Pattern[str]:
    """A cell's value written on its own (not inside a longer number); compiled once per value."""
    return re.compile(rf"(?<![\d,.]){re.escape(form)}(?![\d,]|\.\d)")


def _cell_cited(text: str, lowered: str, cell: Mapping[str, Any]) -> bool:
    value = cell["value"]
    forms = {str(value), f"{value:,}"} if isinstance(value, int) else {str(value)}
    mentions_value = any(_value_pattern(f).search(text) for f in forms)
    return mentions_value or cell["row"].lower() in lowered


def table_components(trajectory: Trajectory, spec: Mapping[str, Any]) -> dict[str, float]:
    answer = extract_final_answer(_final_text(trajectory))
    correct = answer is not None and table_correct(answer, spec["answer"], float(spec["tolerance"]))
    text = "\n".join(t.text for t in trajectory.turns)
    lowered = text.lower()
    cited = [_cell_cited(text, lowered, cell) for cell in spec["cells"]]
    return {OUTCOME_CORRECT: float(correct), PROCESS_ANSWER: float(answer is not None),
            PROCESS_CELLS: sum(cited) / len(cited)}


def text_components(trajectory: Trajectory, spec: Mapping[str, Any]) -> dict[str, float]:
    lines = _final_text(trajectory).strip().splitlines()
    answer, gold = (lines[0].strip() if lines else ""), str(spec["answer"])
    same = sum(a == b for a, b in zip(answer, gold))
    return {OUTCOME_CORRECT: float(answer == gold), PROCESS_ANSWER: float(bool(answer)),
            PROCESS_CHARS: same / max(len(answer), len(gold), 1)}


def environment_components(trajectory: Trajectory, spec: Mapping[str, Any]) -> dict[str, float]:
    """An installed environment's own verifier (schemas.environments) on the recorded spec and last answer."""
    env = _environment(trajectory.domain)
    if spec["env_version"] not in environments.accepted_versions(env):
        raise RewardError(f"environment {trajectory.domain} v{env.version} does not score tasks of its version "
                          f"{spec['env_version']} (it accepts {sorted(environments.accepted_versions(env))})")
    found = dict(env.verify(copy.deepcopy(spec), _final_text(trajectory)))
    if environments.OUTCOME not in found:
        raise RewardError(f"environment {trajectory.domain} verify gave no {environments.OUTCOME}: {sorted(found)}")
    components = {str(k): float(v) for k, v in found.items()}
    bad = {k: v for k, v in components.items() if not 0.0 <= v <= 1.0}
    if bad:
        raise RewardError(f"environment {trajectory.domain} verify gave components outside [0, 1]: {bad}")
    return components


def _environment(domain: str) -> Any:
    name = environments.name_of(domain)
    try:
        if name is None:
            raise ConfigError(f"{domain!r} is no environment domain")
        return environments.load(name)
    except ConfigError as exc:
        raise RewardError(str(exc)) from exc


def reasoning_gym_components(trajectory: Trajectory, spec: Mapping[str, Any]) -> dict[str, float]:
    text = _final_text(trajectory)
    value = reasoning.score(spec, text)
    return {OUTCOME_CORRECT: float(value >= 1.0), PROCESS_PARTIAL: value,
            PROCESS_ANSWER: float(bool(reasoning.answer_text(text)))}


_DOMAIN_COMPONENTS: dict[str, Callable[[Trajectory, Mapping[str, Any]], dict[str, float]]] = {
    "code": code_components, "math": math_components, "table": table_components, "terminal": terminal_components,
    "text": text_components, REASONING_GYM: reasoning_gym_components, ENVIRONMENT: environment_components,
}


def _generated_tokens(turn: TrajectoryTurn) -> int:
    # Token ids are packed int32; without them, UTF-8 bytes (what the byte-level tokenizer sees).
    return len(turn.tokens) // 4 if turn.tokens else len(turn.text.encode())


def penalty_components(trajectory: Trajectory, spec: Mapping[str, Any]) -> dict[str, float]:
    truncated = trajectory.status == "truncated" or any(t.finish_reason == "length" for t in trajectory.turns)
    kind = domain_kind(trajectory.domain) or trajectory.domain
    default = getattr(_environment(trajectory.domain), "length_budget", environments.DEFAULT_LENGTH_BUDGET) \
        if kind == ENVIRONMENT else LENGTH_BUDGET[kind]
    budget = spec.get("length_budget", default)
    used = sum(_generated_tokens(t) for t in trajectory.turns)
    soft = 0.75 * budget
    overlong = min(max((used - soft) / (budget - soft), 0.0), 1.0) if budget > 0 else 0.0
    return {PENALTY_TRUNCATED: float(truncated), PENALTY_OVERLONG: overlong}


def untrainable_components(trajectory: Trajectory) -> dict[str, float] | None:
    """The components of a trajectory that is never trained on, or None if it is trainable."""
    if trajectory.status in UNTRAINABLE_STATUSES:
        return {NOT_TRAINABLE: 1.0}
    if trajectory.status not in TRAINABLE_STATUSES:
        raise RewardError(f"trajectory {trajectory.trajectory_id}: unknown status {trajectory.status!r}")
    runs = _executed(trajectory)
    if trajectory.domain == "code" and runs and runs[-1].outcome == "infra_error":
        return {NOT_TRAINABLE: 1.0, INFRA_ERROR: 1.0}
    return None


def _spec(trajectory: Trajectory) -> dict[str, Any]:
    try:
        return dict(_decoded_spec(trajectory.task_spec, trajectory.domain))
    except TaskSpecError as exc:
        where = f"trajectory {trajectory.trajectory_id} ({trajectory.task_id})"
        raise RewardError(f"{where}: bad task_spec: {exc}") from exc


@lru_cache(maxsize=4096)
def _decoded_spec(text: str, domain: str) -> dict[str, Any]:
    """A group's members share their task's spec: parsed and checked once. Shared between calls: the scorers
    here only read it, and an installed environment's verifier gets a copy of its own."""
    return decode_task_spec(text, domain)


def measure(trajectory: Trajectory) -> dict[str, float]:
    """Every component of a trajectory; the same for all versions (versions only weigh them)."""
    untrainable = untrainable_components(trajectory)
    if untrainable is not None:
        return untrainable
    spec = _spec(trajectory)
    components = _DOMAIN_COMPONENTS[domain_kind(trajectory.domain) or trajectory.domain](trajectory, spec)
    marks = {DEMONSTRATION: 1.0} if is_demonstration(trajectory.turns) else {}
    return {NOT_TRAINABLE: 0.0, **components, **penalty_components(trajectory, spec), **marks}


def weighted(components: Mapping[str, float], weights: Mapping[str, float]) -> RewardResult:
    if components.get(NOT_TRAINABLE, 0.0):
        return RewardResult(0.0, dict(components))
    total = sum(weights.get(name, 0.0) * value for name, value in components.items())
    return RewardResult(total, dict(components))


@register("default", "1")
def default_v1(trajectory: Trajectory) -> RewardResult:
    return weighted(measure(trajectory), WEIGHTS_V1)


@register("default", "2")
def default_v2(trajectory: Trajectory) -> RewardResult:
    return weighted(measure(trajectory), WEIGHTS_V2)


@register("outcome", "1")
def outcome_v1(trajectory: Trajectory) -> RewardResult:
    return weighted(measure(trajectory), WEIGHTS_OUTCOME)
