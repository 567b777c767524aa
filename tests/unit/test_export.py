"""Export formatting: TRL's SFT and DPO row shapes, trainability, thresholds, pairing, JSONL and Parquet."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from consumers.export import ExportStats, dpo_rows, latest_by_id, sft_row, sft_rows, write_rows
from schemas.errors import ConfigError
from tests.taps import trajectory, turn, with_turns


def multi_turn():  # type: ignore[no-untyped-def]
    return with_turns(trajectory("mt", 1.2, domain="code", prompt="def f():\n"),
                      turn("    retrun 1\n"), turn("    return 1\n", obs_text="\nSyntaxError\n"))


def test_sft_completion_trains_on_the_last_turn_given_everything_before_it() -> None:
    row = sft_row(multi_turn())
    assert row == {"prompt": "def f():\n    retrun 1\n\nSyntaxError\n", "completion": "    return 1\n"}


def test_sft_messages_are_a_chat_with_feedback_as_the_user() -> None:
    assert sft_row(multi_turn(), "messages") == {"messages": [
        {"role": "user", "content": "def f():\n"},
        {"role": "assistant", "content": "    retrun 1\n"},
        {"role": "user", "content": "\nSyntaxError\n"},
        {"role": "assistant", "content": "    return 1\n"},
    ]}


def test_sft_keeps_trainable_successes_only() -> None:
    trajs = [trajectory("ok", 1.1), trajectory("low", 0.4), trajectory("trunc", 1.0, status="truncated"),
             trajectory("aborted", 1.5, status="aborted"),
             trajectory("infra", 1.5, components={"status/not_trainable": 1.0, "status/infra_error": 1.0})]
    stats = ExportStats()
    rows = sft_rows(trajs, min_reward=1.0, meta=True, stats=stats)
    assert [r["trajectory_id"] for r in rows] == [trajs[0].trajectory_id, trajs[2].trajectory_id]
    assert (stats.read, stats.untrainable, stats.below_threshold, stats.rows) == (5, 2, 1, 2)
    assert set(rows[0]) == {"prompt", "completion", "trajectory_id", "reward", "domain", "task_id"}


def test_dpo_pairs_best_against_worst_per_group() -> None:
    g1 = [trajectory("a", 0.0, group_id="g1"), trajectory("b", 1.0, group_id="g1", turns=[turn(" 4")]),
          trajectory("c", 0.5, group_id="g1")]
    tie = [trajectory("d", 1.0, group_id="g2"), trajectory("e", 1.0, group_id="g2")]
    alone = [trajectory("f", 1.0, group_id="g3"), trajectory("g", 0.0, group_id="g3", status="error")]
    stats = ExportStats()
    rows = dpo_rows(g1 + tie + alone, meta=True, stats=stats)
    assert len(rows) == 1 and (stats.groups_skipped, stats.untrainable) == (2, 1)
    row = rows[0]
    assert (row["chosen_id"], row["rejected_id"], row["margin"]) == (g1[1].trajectory_id, g1[0].trajectory_id, 1.0)
    assert (row["prompt"], row["chosen"], row["rejected"]) == ("2+2=", " 4", " 4")
    assert dpo_rows(g1, min_margin=1.0) == []


def test_dpo_messages_and_order_independence() -> None:
    a, b = trajectory("a", 0.0, group_id="g"), trajectory("b", 1.0, group_id="g")
    rows = dpo_rows([a, b], style="messages")
    assert rows == dpo_rows([b, a], style="messages")
    assert rows[0] == {"prompt": [{"role": "user", "content": "2+2="}],
                       "chosen": [{"role": "assistant", "content": " 4"}],
                       "rejected": [{"role": "assistant", "content": " 4"}]}


def test_redelivered_trajectories_count_once() -> None:
    first, again = trajectory("a", 0.0), trajectory("a", 1.0)
    assert latest_by_id([first, trajectory("b"), again]) == [again, trajectory("b")]


@pytest.mark.parametrize("style", ["completion", "messages"])
def test_rows_round_trip_through_jsonl_and_parquet(tmp_path: Path, style: str) -> None:
    rows = [sft_row(multi_turn(), style), sft_row(trajectory("x"), style)]
    write_rows(rows, tmp_path / "sft.jsonl")
    assert [json.loads(line) for line in (tmp_path / "sft.jsonl").read_text().splitlines()] == rows
    write_rows(rows, tmp_path / "sft.parquet")
    assert pq.read_table(tmp_path / "sft.parquet").to_pylist() == rows
    with pytest.raises(ConfigError):
        write_rows(rows, tmp_path / "sft.csv")
