"""The benchmark report: figures recorded by the benchmarks, one table, and the README's table generated from them."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from tests.benchmarks import report
from tests.benchmarks.report import Figure

ROOT = Path(__file__).resolve().parents[2]
BENCHES = sorted((ROOT / "tests" / "benchmarks").glob("bench_*.py"))


def test_recorded_figures_become_one_table_with_ratios_goals_and_the_machine(tmp_path: Path) -> None:
    report.record("bench_a", "workload A", [Figure("events/s", 9400.0, "events/s", 0.22, "ceiling", "≥ 0.5", False),
                                            Figure("p50", 184.0, "ms")], directory=tmp_path)
    report.record("bench_b", "workload B", [Figure("speed-up", 2.5, "x", 2.5, "baseline", "≥ 2", True)],
                  directory=tmp_path)
    doc = json.loads((tmp_path / "bench_a.json").read_text())
    assert doc["machine"]["cores"] >= 1 and doc["machine"]["packages"]["fastavro"]

    docs = report.load(tmp_path)
    text = report.report(docs, tmp_path)
    assert "| `bench_a.py` | workload A | events/s | 9,400 events/s | ×0.22 vs ceiling | ≥ 0.5: not met |" in text
    assert "|  |  | p50 | 184 ms |  |  |" in text
    assert "≥ 2: met" in text and "Goals met: 1 of 2." in text
    assert f"{doc['machine']['cores']} cores" in text
    assert report.plot_goals(docs, tmp_path / "goals.png") and (tmp_path / "goals.png").stat().st_size > 1000


def test_the_readme_table_is_replaced_between_its_markers_and_a_missing_marker_is_an_error(tmp_path: Path) -> None:
    report.record("bench_a", "w", [Figure("x", 1.5, "s")], directory=tmp_path)
    docs = report.load(tmp_path)
    text = f"intro\n{report.README_START}\nold | table\n{report.README_END}\nafter\n"
    out = report.with_table(text, docs)
    assert out.startswith("intro\n") and out.endswith(f"{report.README_END}\nafter\n")
    assert "old | table" not in out and "| `bench_a.py` | w | x | 1.5 s |" in out
    assert report.with_table(out, docs) == out  # regenerating is stable
    with pytest.raises(SystemExit, match="no generated benchmark table"):
        report.with_table("no markers here", docs)


def test_the_readme_table_is_the_one_the_published_figures_render() -> None:
    """No hand-copied numbers: the README's table is exactly what docs/bench/*.json renders."""
    published = report.load(report.PUBLISHED)
    assert published, "docs/bench/ holds the published figures (make bench && make bench-publish)"
    readme = (ROOT / "README.md").read_text()
    assert report.with_table(readme, published) == readme


@pytest.mark.parametrize("bench", BENCHES, ids=lambda p: p.stem)
def test_every_benchmark_records_its_figures_for_the_report(bench: Path) -> None:
    tree = ast.parse(bench.read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "record"]
    assert calls, f"{bench.name} prints figures the report never sees: end it with record(...)"
    names = [c.args[0].value if isinstance(c.args[0], ast.Constant) else None for c in calls]
    # Each names its script; a second mode of the script (bench_learning --init) adds a suffix.
    assert bench.stem in names and all(isinstance(n, str) and n.startswith(bench.stem) for n in names), names


def test_each_sft_length_of_bench_learning_warms_up_as_told_else_over_a_tenth_of_it() -> None:
    import argparse

    from tests.benchmarks.bench_learning import length_args

    base = dict(sft_updates=100, rl_updates=80, sft_lengths=[100, 140])
    told = argparse.Namespace(**base, warmup_updates=7)
    assert [(a.sft_updates, a.warmup_updates) for a in (length_args(told, n) for n in (100, 140))] == [(100, 7), (140, 7)]
    untold = argparse.Namespace(**base, warmup_updates=None)
    assert [(a.sft_updates, a.warmup_updates) for a in (length_args(untold, n) for n in (100, 140))] == \
        [(100, 10), (140, 14)]
    assert told.sft_updates == 100 and told.warmup_updates == 7  # the caller's arguments are left as they were
