"""The rollout worker loop: draw tasks, run their episodes, publish facts, follow checkpoints, stop cleanly.

    python -m producers --ns demo --sources math-easy,table,humaneval --group-size 4
"""
from __future__ import annotations

import json
import logging
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from infra.objectstore import ObjectStore
from infra.settings import Settings
from producers.checkpoints import CheckpointFollower, fetch_verified, find_announcement
from producers.episodes import EpisodeRunner, StepSummary
from producers.feeds import TaskStatsFollower
from producers.policy import make_backend
from producers.policy.interface import PolicyBackend
from producers.publishing import EventSink
from producers.sandbox_runner import SandboxCodeRunner
from producers.settings import WorkerSettings
from producers.tasks import Curriculum, TaskMixer
from producers.tasks.sources import seeded_source
from producers.tasks.split import SplitSource
from schemas.errors import ConfigError
from schemas.models import tiny_llama_config
from schemas.topics import Topics

log = logging.getLogger(__name__)


@dataclass
class WorkerStats:
    steps: int = 0
    episodes: int = 0
    tokens: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    generate_s: float = 0.0
    sandbox_s: float = 0.0
    paused_s: float = 0.0
    versions_loaded: list[int] = field(default_factory=list)

    def add(self, s: StepSummary) -> None:
        self.steps += 1
        self.episodes += s.episodes
        self.tokens += s.tokens
        self.generate_s += s.generate_s
        self.sandbox_s += s.sandbox_s
        for k, v in s.statuses.items():
            self.statuses[k] = self.statuses.get(k, 0) + v


def context_limit(backend: PolicyBackend, default: int = 2048) -> int:
    config = getattr(getattr(backend, "model", None), "config", None)
    return int(getattr(config, "max_position_embeddings", default) or default)


class RolloutWorker:
    def __init__(self, settings: WorkerSettings, platform: Settings,
                 backend: Optional[PolicyBackend] = None) -> None:
        self.settings = settings
        self.store = ObjectStore(platform, retry_for_s=600.0)
        self.sink = EventSink(platform, settings.topics, self.store)
        self.backend = backend or self._backend()
        self.code_runner = SandboxCodeRunner(settings.sandbox, settings.sandbox_workers)
        self.mixer = self._mixer()
        self.follower = CheckpointFollower(platform, settings.topics, self.store)
        self.task_feed = TaskStatsFollower(platform, settings.topics, self.mixer.stats)
        self.runner = EpisodeRunner(self.backend, self.code_runner, self.sink.emit, settings, self.stopping,
                                    max_context=context_limit(self.backend))
        self.stats = WorkerStats()
        self.episodes_this_version = 0
        self._stop = False
        if settings.init_checkpoint:
            self.load_initial(platform, settings.init_checkpoint)

    def _backend(self) -> PolicyBackend:
        s = self.settings
        if s.model_dir is not None:
            return make_backend(s.backend, s.model_dir, seed=s.seed)
        return make_backend(s.backend, None, seed=s.seed, config=tiny_llama_config(layers=s.layers, width=s.width))

    def _mixer(self) -> TaskMixer:
        s = self.settings
        sources = [SplitSource(seeded_source(name, s.seed), s.split) for name in s.sources]
        curriculum = Curriculum(s.curriculum_min_attempts) if s.curriculum_min_attempts else None
        return TaskMixer(sources, s.weights or None, seed=s.seed, curriculum=curriculum)

    def load_initial(self, platform: Settings, spec: str) -> None:
        """Start from a published checkpoint (evaluation of a version, or a warm fleet restart)."""
        ns, _, version = spec.rpartition(":")
        if not ns:
            raise ConfigError(f"--init-checkpoint {spec!r}: write NS:VERSION or NS:latest")
        event = find_announcement(platform, Topics(ns), None if version == "latest" else int(version))
        ready = fetch_verified(self.store, event)
        self.backend.load_weights(ready.weights, ready.version)
        self.stats.versions_loaded.append(ready.version)

    def stopping(self) -> bool:
        return self._stop

    def request_stop(self, *_: Any) -> None:
        self._stop = True

    def maybe_load_checkpoint(self) -> None:
        ready = self.follower.take_ready()
        # The first checkpoint is loaded even at the same version: it replaces this worker's own init.
        if ready is not None and (ready.version > self.backend.version or not self.stats.versions_loaded):
            self.backend.load_weights(ready.weights, ready.version)
            self.stats.versions_loaded.append(ready.version)
            self.episodes_this_version = 0
            print(f"[{self.settings.producer_id}] loaded policy v{ready.version}", file=sys.stderr, flush=True)

    def wait_until_fresh(self) -> None:
        """Pause generation while this policy is more than max_policy_lag versions behind (no wasted rollouts)."""
        started = time.monotonic()
        while not self._stop and self.follower.latest_published - self.backend.version > self.settings.max_policy_lag:
            self.maybe_load_checkpoint()
            time.sleep(0.2)
        self.stats.paused_s += time.monotonic() - started

    def wait_for_quota(self) -> None:
        """After max_episodes_per_version episodes of this version, wait (bounded) for a newer one.

        The log would otherwise fill with rollouts the learner can only drop as stale: producers
        outrun a learner on these machines by an order of magnitude.
        """
        quota = self.settings.max_episodes_per_version
        if quota is None or self.episodes_this_version < quota:
            return
        started, version = time.monotonic(), self.backend.version
        while not self._stop and self.backend.version == version:
            if time.monotonic() - started > self.settings.quota_wait_s:
                break
            self.maybe_load_checkpoint()
            time.sleep(0.2)
        self.stats.paused_s += time.monotonic() - started
        self.episodes_this_version = 0

    def step(self) -> None:
        self.maybe_load_checkpoint()
        if self.settings.follow_checkpoints:
            self.wait_until_fresh()
            self.wait_for_quota()
        if self._stop:
            return
        budget = self.remaining_prompts()
        tasks = [self.mixer.next() for _ in range(min(self.settings.prompts_per_step, budget))]
        summary = self.runner.run_step(tasks)
        self.episodes_this_version += summary.episodes
        self.stats.add(summary)
        self.progress(summary)

    def remaining_prompts(self) -> int:
        if self.settings.episodes is None:
            return self.settings.prompts_per_step
        left = self.settings.episodes - self.stats.episodes
        return max(1, -(-left // self.settings.group_size))

    def done(self) -> bool:
        return self._stop or (self.settings.episodes is not None and self.stats.episodes >= self.settings.episodes)

    def progress(self, s: StepSummary) -> None:
        rate = s.tokens / s.generate_s if s.generate_s else 0.0
        print(f"[{self.settings.producer_id}] step {self.stats.steps}: {s.episodes} episodes {s.statuses} "
              f"v{self.backend.version} {rate:.0f} tok/s, sandbox {s.sandbox_s:.1f}s, "
              f"events {self.sink.stats['delivered']}/{self.sink.stats['sent']} delivered",
              file=sys.stderr, flush=True)

    def run(self) -> dict[str, Any]:
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        if self.settings.follow_checkpoints:
            self.follower.start()
        if self.settings.curriculum_min_attempts:
            self.task_feed.start()
        try:
            while not self.done():
                self.step()
        finally:
            self.sink.close()  # flush: every event acknowledged before exit
            self.code_runner.close()
        return self.report()

    def report(self) -> dict[str, Any]:
        return {"producer_id": self.settings.producer_id, "episodes": self.stats.episodes, "steps": self.stats.steps,
                "statuses": self.stats.statuses, "tokens": self.stats.tokens, "events": self.sink.stats,
                "generate_s": round(self.stats.generate_s, 2), "sandbox_s": round(self.stats.sandbox_s, 2),
                "paused_s": round(self.stats.paused_s, 2), "versions_loaded": self.stats.versions_loaded,
                "checkpoints_refused": self.follower.refused, "curriculum_skips": dict(self.mixer.skips)}


def main(argv: Optional[Sequence[str]] = None) -> int:
    from producers.settings import from_args
    from schemas.errors import PipelineError

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    try:
        settings = from_args(list(argv) if argv is not None else None)
        report = RolloutWorker(settings, Settings.from_env()).run()
    except PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report))
    return 0
