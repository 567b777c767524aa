"""`python -m learner.eval` against the real broker and store: published checkpoints play held-out tasks through a
streams worker of their own, several evaluation workers at once."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from infra.kafka import admin
from infra.objectstore import ObjectStore
from infra.settings import Settings
from schemas.topics import Topics
from tests.integration.test_learner_service import ROOT, publish_batches, run_learner

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def evaluate(stack: Settings, ns: str, *argv: str) -> tuple[list[dict[str, Any]], str]:
    env = {**os.environ, **stack.as_env(), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "learner.eval", "--ns", ns, "--sources", "reverse", "--episodes", "8",
                           "--timeout", "240", "--json", *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_evaluation_workers_side_by_side_report_every_version_and_mode_as_one_worker_playing_them_in_turn_does(
        stack: Settings, topics: Topics, store: ObjectStore, tmp_path: Path) -> None:
    publish_batches(stack, store, topics, 2)
    trained = run_learner(stack, topics.ns, tmp_path, None, "--updates-per-checkpoint", "1", "--max-policy-lag", "99")
    assert trained.returncode == 0, trained.stderr[-3000:]

    together, log = evaluate(stack, topics.ns, "--versions", "0,2", "--modes", "greedy,sampled", "--parallel", "3")
    assert [(r["version"], r["mode"], r["episodes"]) for r in together] == \
        [(0, "greedy", 8), (0, "sampled", 8), (2, "greedy", 8), (2, "sampled", 8)]  # three at once, then one
    assert log.count("8 held-out episodes each in") == 4
    # One worker alone on the cores, playing v0 then v2 (one start-up for both), measures each as a worker of its
    # own, sharing the cores, did: the same held-out tasks, decoded greedily by the same weights.
    in_turn, log = evaluate(stack, topics.ns, "--versions", "0,2", "--modes", "greedy", "--parallel", "1")
    assert in_turn == [r for r in together if r["mode"] == "greedy"] and "v0, v2 greedy" in log
    left = [t for t in admin(stack).list_topics(timeout=10).topics if t.startswith(f"{topics.ns}-eval-")]
    assert not left  # each evaluation's namespace is deleted
    # A version never announced is named before any worker starts (it was a worker's failure, without a reason).
    env = {**os.environ, **stack.as_env(), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "learner.eval", "--ns", topics.ns, "--versions", "0,9,latest"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and f"{topics.checkpoints} announced no v9 (it announced 3: v0..v2)" in proc.stderr
