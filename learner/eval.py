"""Evaluates published checkpoints on held-out tasks, through the pipeline itself.

    python -m learner.eval --ns demo --versions 0,latest --sources math-easy --episodes 64

For each version: a fresh namespace, a rollout worker pinned to that checkpoint drawing held-out tasks
only, and a streams worker scoring them with the same reward function the training used. Reports
single-step success (the first attempt), multi-turn success (any attempt, code repairs included),
end-to-end success (the scored outcome) and the mean reward.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Optional

from infra.bootstrap import bootstrap
from infra.kafka import end_offsets, read_topic
from infra.objectstore import ObjectStore
from infra.settings import Settings
from learner import checkpoint_store
from schemas.codec import codec
from schemas.errors import CheckpointError, PipelineError
from schemas.manifests import CheckpointManifest
from schemas.records import Trajectory
from schemas.topics import Topics


@dataclass(frozen=True)
class EvalResult:
    version: int
    episodes: int
    single_step: float
    multi_turn: float
    end_to_end: float
    reward_mean: float


def first_attempt_ok(t: Trajectory) -> bool:
    if t.domain == "code":
        return bool(t.turns) and t.turns[0].outcome == "passed"
    return t.reward_components.get("outcome/correct", 0.0) >= 1.0


def any_attempt_ok(t: Trajectory) -> bool:
    if t.domain == "code":
        return any(turn.outcome == "passed" for turn in t.turns)
    return first_attempt_ok(t)


def outcome_ok(t: Trajectory) -> bool:
    return max(t.reward_components.get("outcome/correct", 0.0), t.reward_components.get("outcome/tests_passed", 0.0)) >= 1.0


def summarise(version: int, trajectories: list[Trajectory]) -> EvalResult:
    n = max(1, len(trajectories))
    return EvalResult(version=version, episodes=len(trajectories),
                      single_step=sum(map(first_attempt_ok, trajectories)) / n,
                      multi_turn=sum(map(any_attempt_ok, trajectories)) / n,
                      end_to_end=sum(map(outcome_ok, trajectories)) / n,
                      reward_mean=sum(t.reward for t in trajectories) / n)


def resolve_versions(settings: Settings, topics: Topics, wanted: str) -> list[int]:
    announced = sorted({e.version for e in checkpoint_store.published(settings, topics)})
    if not announced:
        raise CheckpointError(f"{topics.checkpoints} has no checkpoint to evaluate")
    out = []
    for part in wanted.split(","):
        part = part.strip()
        out.append(announced[-1] if part == "latest" else announced[0] if part == "first" else int(part))
    return list(dict.fromkeys(out))


def model_shape(store: ObjectStore, settings: Settings, topics: Topics, version: int) -> tuple[int, int]:
    event = next(e for e in checkpoint_store.published(settings, topics) if e.version == version)
    config = CheckpointManifest.from_json(store.get(event.manifest_key, sha256=event.manifest_sha256)).model_config
    return int(config["num_hidden_layers"]), int(config["hidden_size"])


def count(settings: Settings, topic: str) -> int:
    return sum(hi - lo for lo, hi in end_offsets(settings, topic).values())


class Evaluation:
    def __init__(self, settings: Settings, args: argparse.Namespace) -> None:
        self.settings, self.args = settings, args
        self.topics = Topics(args.ns)
        self.store = ObjectStore(settings)
        self.env = {**os.environ, **settings.as_env()}

    def spawn(self, module: str, *argv: str) -> subprocess.Popen[bytes]:
        log = open(os.devnull, "wb") if not self.args.verbose else None
        return subprocess.Popen([sys.executable, "-m", module, *argv], env=self.env, stdout=log, stderr=log)

    def run_version(self, version: int) -> EvalResult:
        a = self.args
        ns = f"{a.ns}-eval-v{version}-{uuid.uuid4().hex[:6]}"
        bootstrap(self.settings, ns)
        layers, width = model_shape(self.store, self.settings, self.topics, version)
        worker = self.spawn("producers", "--ns", ns, "--init-checkpoint", f"{a.ns}:{version}", "--split", "heldout",
                            "--sources", a.sources, "--episodes", str(a.episodes), "--group-size", str(a.group_size),
                            "--no-follow", "--max-new-tokens", str(a.max_new_tokens), "--temperature",
                            str(a.temperature), "--layers", str(layers), "--width", str(width), "--seed", str(a.seed))
        streams = self.spawn("streams", "--ns", ns)
        try:
            if worker.wait(timeout=a.timeout) != 0:
                raise PipelineError(f"the evaluation worker for v{version} failed (rc {worker.returncode})")
            self.wait_for(Topics(ns).trajectories, a.episodes)
        finally:
            streams.send_signal(signal.SIGTERM)
            streams.wait(timeout=60)
        trajs = [codec.decode(m.value() or b"", expect=Trajectory) for m in read_topic(self.settings, Topics(ns).trajectories)]
        unique = {t.trajectory_id: t for t in trajs}  # at-least-once upstream: dedupe by id
        return summarise(version, list(unique.values()))

    def wait_for(self, topic: str, n: int) -> None:
        deadline = time.monotonic() + self.args.timeout
        while count(self.settings, topic) < n:
            if time.monotonic() > deadline:
                raise PipelineError(f"only {count(self.settings, topic)}/{n} trajectories scored in time")
            time.sleep(1.0)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m learner.eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ns", required=True, help="the namespace whose checkpoints to evaluate")
    p.add_argument("--versions", default="first,latest", help="comma-separated versions, 'first' or 'latest'")
    p.add_argument("--sources", default="math-easy")
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--verbose", action="store_true")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = parser().parse_args(argv)
    try:
        settings = Settings.from_env()
        ev = Evaluation(settings, args)
        results = [ev.run_version(v) for v in resolve_versions(settings, ev.topics, args.versions)]
    except PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([asdict(r) for r in results]))
    else:
        print(f"{'version':>8} {'episodes':>9} {'single-step':>12} {'multi-turn':>11} {'end-to-end':>11} {'reward':>8}")
        for r in results:
            print(f"{r.version:>8} {r.episodes:>9} {r.single_step:>12.3f} {r.multi_turn:>11.3f} "
                  f"{r.end_to_end:>11.3f} {r.reward_mean:>8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
