"""Settings of a rollout worker, from the command line; invalid combinations are refused with the fix."""
from __future__ import annotations

import argparse
import os
import socket
import zlib
from dataclasses import dataclass, field

from infra.models import resolve_model
from infra.settings import add_ns_argument, parse_weights
from schemas.errors import ConfigError
from schemas.topics import Topics


@dataclass(frozen=True)
class WorkerSettings:
    ns: str
    producer_id: str
    backend: str = "transformers"
    model_dir: str | None = None
    sources: tuple[str, ...] = ("math-easy",)
    weights: dict[str, float] = field(default_factory=dict)
    group_size: int = 4
    prompts_per_step: int = 4
    max_turns: int = 2
    temperature: float = 1.0
    max_new_tokens: int = 48
    max_policy_lag: int = 2
    sandbox: str | None = None
    sandbox_workers: int = 2
    tool_workers: int = 64  # installed environments' feedback calls of one turn made at once (they may wait on I/O)
    episodes: int | None = None  # stop after this many episodes (None: run until SIGTERM)
    seed: int = 0
    follow_checkpoints: bool = True
    curriculum_min_attempts: int = 0  # 0: no curriculum
    curriculum_probe: float = 0.05  # share of draws that ignore the curriculum's verdicts (retired tasks come back)
    max_episodes_per_version: int | None = None  # then wait (bounded) for a newer checkpoint: bounds staleness
    quota_wait_s: float = 60.0
    # versions' quotas a worker may make beyond its current version's: with 1 it makes the next update's
    # data while the learner trains on this version's (data one version older, a batch of it buffered)
    versions_ahead: int = 0
    # Once its quotas are made, a worker waits for a newer version only while the learner holds the batches that
    # version needs; when it is short, after this long (for the batches of episodes already made to arrive) the
    # worker makes the share of a quota it lacks. None: a fixed quota, the wait ends only with a version or
    # --quota-wait-s.
    demand_settle_s: float | None = 1.0
    split: str = "train"  # train | heldout | all: held-out tasks are for evaluation only
    # "NS:VERSION" or "NS:latest": start from that published checkpoint; "NS:V1,V2,...": --episodes with each in
    # turn, the same tasks each (evaluation: one start-up for several versions)
    init_checkpoint: str | None = None
    layers: int = 4  # size of the small model when no --model-dir is given
    own_weights: bool = False  # generate with the worker's own init (data-path tests): no checkpoint names them
    demonstrations: int = 0  # publish this many demonstration episodes (gold completions), then exit
    width: int = 256

    def __post_init__(self) -> None:
        Topics(self.ns)  # validates the namespace
        checks = [
            (self.group_size >= 1, f"--group-size must be >= 1, got {self.group_size}"),
            (self.prompts_per_step >= 1, f"--prompts-per-step must be >= 1, got {self.prompts_per_step}"),
            (self.max_turns >= 1, f"--max-turns must be >= 1, got {self.max_turns}"),
            (self.max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {self.max_new_tokens}"),
            (self.max_policy_lag >= 0, f"--max-policy-lag must be >= 0, got {self.max_policy_lag}"),
            (self.sandbox_workers >= 1, f"--sandbox-workers must be >= 1, got {self.sandbox_workers}"),
            (self.tool_workers >= 1, f"--tool-workers must be >= 1, got {self.tool_workers}"),
            (self.temperature > 0 or not self.follow_checkpoints,
             "--temperature must be > 0 for RL (a greedy policy gives a group no variance); 0 is for evaluation "
             "with --no-follow"),
            (self.episodes is None or self.episodes >= 1, "--episodes must be >= 1 (or omit it to run forever)"),
            (self.backend != "vllm" or self.model_dir is not None, "--backend vllm needs --model-dir DIR"),
            (self.max_episodes_per_version is None or self.max_episodes_per_version >= self.group_size,
             "--max-episodes-per-version must be at least --group-size"),
            (self.versions_ahead >= 0, f"--versions-ahead must be >= 0, got {self.versions_ahead}"),
            (self.demand_settle_s is None or self.demand_settle_s >= 0,
             f"--demand-settle-s must be >= 0, got {self.demand_settle_s}"),
            (self.versions_ahead == 0 or self.max_episodes_per_version is not None,
             "--versions-ahead counts in quotas: give --max-episodes-per-version too"),
            (not (self.own_weights and self.follow_checkpoints),
             "--own-weights is for a worker that does not follow checkpoints: add --no-follow"),
            (self.demonstrations >= 0, f"--demonstrations must be >= 0, got {self.demonstrations}"),
            (0.0 <= self.curriculum_probe <= 1.0, f"--curriculum-probe must be in [0, 1], got {self.curriculum_probe}"),
            (len(self.init_checkpoints) < 2 or (not self.follow_checkpoints and self.episodes is not None),
             "--init-checkpoint with several versions plays --episodes with each in turn: add --no-follow and "
             "--episodes N"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    @property
    def topics(self) -> Topics:
        return Topics(self.ns)

    @property
    def init_checkpoints(self) -> list[str]:
        """--init-checkpoint as one NS:VERSION per version: 'run:3,5,latest' -> ['run:3', 'run:5', 'run:latest']."""
        if not self.init_checkpoint:
            return []
        ns, _, versions = self.init_checkpoint.rpartition(":")
        parts = [v.strip() for v in versions.split(",")]
        if not ns or not all(v == "latest" or v.isdigit() for v in parts):
            raise ConfigError(f"--init-checkpoint {self.init_checkpoint!r}: write NS:VERSION, NS:latest or "
                              "NS:V1,V2,... (evaluation, each in turn)")
        return [f"{ns}:{v}" for v in parts]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m producers", description="A rollout worker: tasks -> policy -> sandbox -> events.")
    add_ns_argument(p)
    p.add_argument("--producer-id", default=f"{socket.gethostname()}-{os.getpid()}")
    p.add_argument("--backend", default="transformers", choices=["transformers", "vllm"])
    p.add_argument("--model-dir", "--model", dest="model_dir", default=None,
                   help="a local Hugging Face checkpoint dir, or a converted pretrained model by name "
                        "(smollm2-135m); default: the small model")
    p.add_argument("--sources", default="math-easy",
                   help="comma-separated: add, humaneval, math, math-easy, reverse, table, rg:<dataset> (a reasoning-gym "
                        "dataset), rg:* (every one that verifies), env:<name> (an installed environment), env:* "
                        "(every installed one)")
    p.add_argument("--weights", default="", help="sampling weights per source or domain, e.g. code=1,math=3")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--max-turns", type=int, default=2)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--max-policy-lag", type=int, default=2)
    p.add_argument("--sandbox", default=None, help="docker | bwrap | subprocess (default: the best available)")
    p.add_argument("--sandbox-workers", type=int, default=2)
    p.add_argument("--tool-workers", type=int, default=64,
                   help="installed environments' feedback calls of one turn made at once, each in a thread: a "
                        "feedback that waits on a remote tool or checker waits once a turn, not once an episode")
    p.add_argument("--episodes", type=int, default=None)
    p.add_argument("--seed", type=int, default=None,
                   help="tasks drawn and sampling (default: from --producer-id, so replicas started alike draw "
                        "different tasks; give it to repeat a worker's draws)")
    p.add_argument("--no-follow", action="store_true", help="do not hot-load published checkpoints")
    p.add_argument("--curriculum", type=int, default=0, help="skip tasks always/never solved after N attempts")
    p.add_argument("--curriculum-probe", type=float, default=0.05,
                   help="share of draws that ignore the curriculum, so a task or domain the policy learns later "
                        "comes back; when every task is retired, every draw is a probe (0: stop instead)")
    p.add_argument("--max-episodes-per-version", type=int, default=None,
                   help="episodes generated with one policy version before waiting for a newer one")
    p.add_argument("--quota-wait-s", type=float, default=60.0,
                   help="longest wait for a newer version once the quota is used (no deadlock on a stalled learner)")
    p.add_argument("--versions-ahead", type=int, default=0,
                   help="quotas a worker may generate beyond its current version's: with 1, the next update's data "
                        "is made while the learner trains (a batch buffered, one version older); 0: wait for each "
                        "version once its quota is made")
    p.add_argument("--demand-settle-s", type=float, default=1.0,
                   help="once the quota is made, wait for a newer version only while the learner holds the batches "
                        "it needs for it (its checkpoint says how many); when it is short after this many seconds "
                        "(for the batches of the episodes already made to arrive), make the share of a quota it "
                        "lacks")
    p.add_argument("--fixed-quota", action="store_true",
                   help="ignore the learner's demand: after the quota, wait for a newer version or --quota-wait-s")
    p.add_argument("--split", default="train", choices=["train", "heldout", "all"],
                   help="which side of the stable task split to draw from (heldout: evaluation)")
    p.add_argument("--init-checkpoint", default=None,
                   help="NS:VERSION or NS:latest, loaded and verified at start; NS:V1,V2,... (with --no-follow and "
                        "--episodes N): N episodes with each version in turn, the same tasks each (one start-up for an "
                        "evaluation of several versions)")
    p.add_argument("--layers", type=int, default=4, help="layers of the small model (without --model-dir)")
    p.add_argument("--width", type=int, default=256, help="width of the small model (without --model-dir)")
    p.add_argument("--own-weights", action="store_true",
                   help="with --no-follow: generate with this worker's own initial weights (data-path tests only; "
                        "no checkpoint names them, so nothing should train on the result)")
    p.add_argument("--demonstrations", type=int, default=0,
                   help="publish N demonstration episodes (the tasks' gold completions, for SFT), then exit")
    return p


def from_args(argv: list[str] | None = None) -> WorkerSettings:
    args = parser().parse_args(argv)
    if not args.ns:
        raise ConfigError("--ns is required (or set TRAJPIPE_NS)")
    return WorkerSettings(
        ns=args.ns, producer_id=args.producer_id, backend=args.backend,
        model_dir=resolve_model(args.model_dir) if args.model_dir else None,
        sources=tuple(s.strip() for s in args.sources.split(",") if s.strip()), weights=parse_weights(args.weights),
        group_size=args.group_size, prompts_per_step=args.prompts_per_step, max_turns=args.max_turns,
        temperature=args.temperature, max_new_tokens=args.max_new_tokens, max_policy_lag=args.max_policy_lag,
        sandbox=args.sandbox, sandbox_workers=args.sandbox_workers,
        tool_workers=args.tool_workers, episodes=args.episodes,
        seed=args.seed if args.seed is not None else zlib.crc32(args.producer_id.encode()) % 2**31,
        follow_checkpoints=not args.no_follow, curriculum_min_attempts=args.curriculum,
        curriculum_probe=args.curriculum_probe,
        max_episodes_per_version=args.max_episodes_per_version, quota_wait_s=args.quota_wait_s,
        versions_ahead=args.versions_ahead, demand_settle_s=None if args.fixed_quota else args.demand_settle_s,
        split=args.split, init_checkpoint=args.init_checkpoint, layers=args.layers, width=args.width,
        own_weights=args.own_weights, demonstrations=args.demonstrations,
    )
