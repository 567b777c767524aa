"""Evaluates published checkpoints on held-out tasks, through the pipeline itself, with 95% confidence intervals.

    python -m learner.eval --ns demo --versions first,latest --sources reverse --episodes 256

For each version: a rollout worker pinned to that checkpoint draws held-out tasks only, once greedily (one
sample per task) and once sampled at the training temperature, into a fresh namespace where a streams worker
scores them with the reward function the training used. Reports the success rate of each mode with its
Wilson interval, single-step and multi-turn success (code repairs), and the mean reward. Drawing from several
sources, it reports each source's success too: `--sources reverse-3,reverse-4,reverse-5,reverse-6` says where a
policy stands on each word length.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import IO, Optional

from infra.bootstrap import bootstrap, delete_topics
from infra.kafka import end_offsets, read_topic
from infra.objectstore import ObjectStore
from infra.settings import Settings, add_ns_argument
from learner import checkpoint_store
from learner.batching import task_source
from schemas.codec import codec
from schemas.errors import CheckpointError, ConfigError, PipelineError
from schemas.manifests import CheckpointManifest
from schemas.records import Trajectory
from schemas.topics import Topics

Z95 = 1.959964
EVAL_SEED = 1234  # the evaluation worker's seed: which held-out tasks it draws, in which order


def wilson(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a success rate: sound near 0 and 1, where the normal one is not."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass(frozen=True)
class EvalResult:
    version: int
    mode: str               # "greedy" or "sampled"
    episodes: int
    successes: int
    success: float          # end to end: the scored outcome solved the task
    ci_low: float
    ci_high: float
    single_step: float
    multi_turn: float
    reward_mean: float
    by_source: dict[str, list[int]] = field(default_factory=dict)  # task source -> [successes, episodes]

    def line(self) -> str:
        sources = "" if len(self.by_source) < 2 else "; " + ", ".join(
            f"{name} {wins / n:.2f} ({wins}/{n})" for name, (wins, n) in self.by_source.items())
        return (f"v{self.version} {self.mode:>7}: success {self.success:.3f} "
                f"[{self.ci_low:.3f}, {self.ci_high:.3f}] ({self.successes}/{self.episodes}), "
                f"reward {self.reward_mean:.3f}{sources}")


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


def summarise(version: int, mode: str, trajectories: list[Trajectory]) -> EvalResult:
    """Success and its Wilson interval. Several samples of one task are not independent draws: with more than
    one episode a task (sampled mode's --group-size > 1) the interval counts tasks, not episodes (at the rate the
    episodes give), which never claims more certainty than the tasks hold."""
    n = len(trajectories)
    by_source: dict[str, list[int]] = {}
    for t in trajectories:
        counts = by_source.setdefault(task_source(t), [0, 0])
        counts[0] += outcome_ok(t)
        counts[1] += 1
    wins = sum(solved for solved, _ in by_source.values())
    tasks = len({t.task_id for t in trajectories})
    low, high = wilson(wins * tasks / max(1, n), tasks)  # one episode a task: wilson(wins, n)
    share = 1 / max(1, n)
    return EvalResult(version=version, mode=mode, episodes=n, successes=wins, success=wins * share, ci_low=low,
                      ci_high=high, single_step=sum(map(first_attempt_ok, trajectories)) * share,
                      multi_turn=sum(map(any_attempt_ok, trajectories)) * share,
                      reward_mean=sum(t.reward for t in trajectories) * share, by_source=dict(sorted(by_source.items())))


def named(versions: list[int]) -> str:
    """[0, 7] -> 'v0, v7'."""
    return ", ".join(f"v{v}" for v in versions)


def resolve_versions(settings: Settings, topics: Topics, wanted: str) -> list[int]:
    announced = sorted({e.version for e in checkpoint_store.published(settings, topics)})
    if not announced:
        raise CheckpointError(f"{topics.checkpoints} has no checkpoint to evaluate")
    out = []
    for part in filter(None, (p.strip() for p in wanted.split(","))):
        if part not in ("latest", "first") and not part.isdigit():
            raise ConfigError(f"--versions {wanted!r}: write version numbers, 'first' or 'latest', comma-separated")
        out.append(announced[-1] if part == "latest" else announced[0] if part == "first" else int(part))
    missing = [v for v in out if v not in announced]
    if missing:
        raise CheckpointError(f"{topics.checkpoints} announced no {named(missing)} (it announced "
                              f"{len(announced)}: v{announced[0]}..v{announced[-1]})")
    return list(dict.fromkeys(out))


def model_args(store: ObjectStore, ns: str, version: int) -> list[str]:
    """The rollout worker's model flags for a checkpoint: its own directory's model, or the tiny model's shape."""
    manifest = checkpoint_store.read_manifest(store, ns, version)  # the flags only: the worker fetches weights
    config = manifest.model_config
    if manifest.base_model:
        return ["--model-dir", manifest.base_model]
    return ["--layers", str(config["num_hidden_layers"]), "--width", str(config["hidden_size"])]


def count(settings: Settings, topic: str) -> int:
    return sum(hi - lo for lo, hi in end_offsets(settings, topic).values())


@dataclass
class Worker:
    """An evaluation worker process: one mode, its versions in turn."""
    mode: str
    versions: list[int]
    proc: subprocess.Popen[bytes]
    log: Optional[IO[bytes]] = None  # its output, unless --verbose let it through
    started: float = field(default_factory=time.monotonic)

    @property
    def name(self) -> str:
        return named(self.versions)

    def last_words(self, limit: int = 1500) -> str:
        """The end of its output: why it failed, in its own words."""
        if self.log is None:
            return ""
        self.log.seek(0)
        text = self.log.read().decode(errors="replace").strip()
        return f"; its last output:\n{text[-limit:]}" if text else ""

    def elapsed(self) -> float:
        return time.monotonic() - self.started


class Evaluation:
    def __init__(self, settings: Settings, args: argparse.Namespace) -> None:
        self.settings, self.args = settings, args
        self.topics = Topics(args.ns)
        self.store = ObjectStore(settings)
        self.env = {**os.environ, **settings.as_env()}

    def spawn(self, module: str, *argv: str, threads: Optional[int] = None,
              log: Optional[IO[bytes]] = None) -> subprocess.Popen[bytes]:
        """A process of the pipeline; its output goes to `log` (default: nowhere), or to this terminal with
        --verbose."""
        out: Optional[IO[bytes]] = None if self.args.verbose else log or open(os.devnull, "wb")
        env = self.env if threads is None else {**self.env, "OMP_NUM_THREADS": str(threads)}
        return subprocess.Popen([sys.executable, "-m", module, *argv], env=env, stdout=out, stderr=out)

    def worker(self, ns: str, versions: list[int], mode: str) -> list[str]:
        """A rollout worker's flags to play the held-out tasks with each of `versions` in turn, in one mode."""
        a = self.args
        greedy = mode == "greedy"
        group = 1 if greedy else a.group_size
        return ["--ns", ns, "--init-checkpoint", f"{a.ns}:{','.join(map(str, versions))}", "--split", "heldout",
                "--sources", a.sources, "--episodes", str(a.episodes), "--group-size", str(group),
                "--prompts-per-step", str(max(1, a.episodes_per_step // group)),
                "--no-follow", "--max-new-tokens", str(a.max_new_tokens), "--temperature",
                "0" if greedy else str(a.temperature), "--seed", str(a.seed),
                "--producer-id", f"eval-{mode}-v{'-'.join(map(str, versions))}", *model_args(self.store, a.ns, versions[0])]

    def plan(self, jobs: dict[str, list[int]]) -> list[tuple[str, list[int]]]:
        """The worker processes: each mode's versions dealt into --parallel of them (a process starts Python, torch
        and the task split once for all its versions; with 11 versions and modes that start was most of the time)."""
        at_once = max(1, self.args.parallel)
        return [(mode, versions[k::at_once]) for mode, versions in jobs.items() for k in range(min(at_once, len(versions)))]

    def run(self, jobs: dict[str, list[int]]) -> list[EvalResult]:
        """Every version in its modes (mode -> versions), in one throwaway namespace scored by one streams worker."""
        ns = f"{self.args.ns}-eval-{uuid.uuid4().hex[:6]}"
        bootstrap(self.settings, ns)
        streams = self.spawn("streams", "--ns", ns)
        try:
            self.play(ns, self.plan(jobs))
            self.wait_for(Topics(ns).trajectories, sum(len(v) for v in jobs.values()) * self.args.episodes)
            trajectories = [codec.decode(m.value() or b"", expect=Trajectory)
                            for m in read_topic(self.settings, Topics(ns).trajectories)]
        finally:
            streams.send_signal(signal.SIGTERM)
            streams.wait(timeout=60)
            if not self.args.keep:
                delete_topics(self.settings, [spec.name for spec in Topics(ns).specs()])
        unique = {t.trajectory_id: t for t in trajectories}  # at-least-once upstream: dedupe by id
        order = list(dict.fromkeys(v for versions in jobs.values() for v in versions))
        return [summarise(v, mode, [t for t in unique.values() if self.of(t, v, mode)])
                for v in order for mode, versions in jobs.items() if v in versions]

    def play(self, ns: str, queue: list[tuple[str, list[int]]]) -> None:
        """Runs the evaluation workers, --parallel at once (the next starts as soon as one has finished, the cores
        shared among them); one that fails or overruns stops the others and is an error."""
        at_once = min(self.args.parallel, len(queue)) or 1
        threads = max(1, len(os.sched_getaffinity(0)) // at_once) if at_once > 1 else None
        queue, running = list(queue), list[Worker]()
        try:
            while queue or running:
                while queue and len(running) < at_once:
                    mode, versions = queue.pop(0)
                    log = tempfile.TemporaryFile()
                    running.append(Worker(mode, versions, self.spawn("producers", *self.worker(ns, versions, mode),
                                                                     threads=threads, log=log), log))
                done = next((w for w in running if w.proc.poll() is not None), None)
                if done is None:
                    for w in running:
                        if w.elapsed() > self.args.timeout * len(w.versions):
                            self.overdue(w)
                    time.sleep(0.1)
                    continue
                running.remove(done)
                if done.proc.returncode != 0:
                    raise PipelineError(f"the evaluation worker for {done.name} ({done.mode}) failed with exit code "
                                        f"{done.proc.returncode}{done.last_words()}")
                if done.log is not None:
                    done.log.close()
                print(f"{done.name} {done.mode}: {self.args.episodes} held-out episodes each in {done.elapsed():.0f}s",
                      file=sys.stderr, flush=True)
        finally:
            for w in running:  # a failed one's partners are not left generating
                if w.proc.poll() is None:
                    w.proc.kill()
                    w.proc.wait()

    def overdue(self, w: "Worker") -> None:
        """Past --timeout a version, a worker is stopped (never left generating), and that is an error."""
        w.proc.kill()
        w.proc.wait()
        raise PipelineError(f"the evaluation worker for {w.name} ({w.mode}) did not finish {self.args.episodes} "
                            f"episodes a version within --timeout {self.args.timeout:.0f} s and was stopped: raise "
                            "--timeout (a pretrained model's multi-turn episodes take minutes on a CPU)"
                            f"{w.last_words()}")

    @staticmethod
    def of(t: Trajectory, version: int, mode: str) -> bool:
        """Whether a trajectory was this version's, in this mode: the turns say both (version, temperature)."""
        greedy = all(turn.temperature == 0 for turn in t.turns)
        return all(turn.policy_version == version for turn in t.turns) and greedy == (mode == "greedy")

    def wait_for(self, topic: str, n: int) -> None:
        deadline = time.monotonic() + self.args.timeout
        while count(self.settings, topic) < n:
            if time.monotonic() > deadline:
                raise PipelineError(f"only {count(self.settings, topic)}/{n} trajectories scored in time")
            time.sleep(1.0)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m learner.eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_ns_argument(p, help="the namespace whose checkpoints to evaluate")
    p.add_argument("--versions", default="first,latest", help="comma-separated versions, 'first' or 'latest'")
    p.add_argument("--modes", default="greedy,sampled", help="greedy (one sample per task), sampled, or both")
    p.add_argument("--sources", default="reverse")
    p.add_argument("--episodes", type=int, default=256, help="held-out episodes per version and mode")
    p.add_argument("--group-size", type=int, default=1,
                   help="samples per task in sampled mode (1: the greedy mode's tasks, each once; more: fewer tasks, "
                        "and the interval counts tasks)")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0, help="of sampled mode: the training temperature")
    p.add_argument("--seed", type=int, default=EVAL_SEED, help="which held-out tasks are drawn (both modes draw the same)")
    p.add_argument("--sampled-versions", default=None,
                   help="the versions sampled mode evaluates, when not --versions (the demo samples v0, post-SFT and "
                        "the final one, and draws its curve greedily)")
    p.add_argument("--episodes-per-step", type=int, default=32,
                   help="episodes an evaluation worker generates at once (with 32, a worker played 256 held-out "
                        "episodes of the default model in 0.73 of the time 4 at once took, its start included)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a version may take: a worker past it times its versions is stopped, an error")
    p.add_argument("--parallel", type=int, default=2,
                   help="evaluation workers generating at once, the cores shared among them (1: one after another)")
    p.add_argument("--keep", action="store_true", help="keep the evaluation namespace's topics (default: deleted)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--verbose", action="store_true")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = parser().parse_args(argv)
    if not args.ns:
        print("error: --ns is required (or set TRAJPIPE_NS)", file=sys.stderr)
        return 2
    for flag in ("parallel", "episodes_per_step"):
        if getattr(args, flag) < 1:
            print(f"error: --{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}", file=sys.stderr)
            return 2
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or not set(modes) <= {"greedy", "sampled"}:
        print(f"error: --modes {args.modes!r}: greedy, sampled or both", file=sys.stderr)
        return 2
    try:
        settings = Settings.from_env()
        ev = Evaluation(settings, args)
        jobs = {mode: resolve_versions(settings, ev.topics, args.sampled_versions if mode == "sampled" and
                                       args.sampled_versions else args.versions) for mode in modes}
        results = ev.run(jobs)
    except PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([asdict(r) for r in results]))
    else:
        for r in results:
            print(r.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
