"""The rollout worker loop: draw tasks, run their episodes, publish facts, follow checkpoints, stop cleanly.

    python -m producers --ns demo --sources math-easy,table,humaneval --group-size 4
"""
from __future__ import annotations

import json
import logging
import math
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence

from infra.kafka import Publisher
from infra.metrics import Metrics, publish
from infra.objectstore import ObjectStore
from infra.settings import Settings
from producers.checkpoints import CheckpointFollower, fetch_verified, find_announcement
from producers.demand import LearnerDemand
from producers.demonstrations import DemonstrationBackend, DemonstrationRunner, publish_demonstrations
from producers.episodes import EpisodeRunner, StepSummary
from producers.feeds import TaskStatsFollower
from producers.policy import make_backend
from producers.policy.interface import PolicyBackend
from producers.publishing import EventSink
from producers.sandbox_runner import NoCodeRunner, SandboxCodeRunner
from producers.settings import WorkerSettings
from producers.tasks import Curriculum, TaskMixer, TaskSource
from producers.tasks import environments
from producers.tasks.reasoning_gym import expand
from producers.tasks.sources import seeded_source
from producers.tasks.split import SplitSource
from schemas.errors import CheckpointError, ConfigError
from schemas.manifests import CheckpointManifest
from schemas.models import tiny_llama_config
from schemas.topics import Topics

log = logging.getLogger(__name__)
# A worker with quota left pauses while the batches topic holds the learner's next this-many versions: the one
# it trains now and the one after, which the rollouts made meanwhile fill (each at most 2 versions old then).
QUEUED_VERSIONS = 2
KEEP_VERSIONS_LOADED = 100  # the newest versions a worker's report lists
QUEUE_POLL_S = 0.5  # how often a paused worker asks the broker again


@dataclass
class WorkerStats:
    steps: int = 0
    episodes: int = 0
    tokens: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    generate_s: float = 0.0
    sandbox_s: float = 0.0
    paused_s: float = 0.0
    quota_waits: int = 0  # times its quota was used up and it waited for a newer version
    demand_steps: int = 0  # of those waits, the ones it ended with another step because the learner was short
    queue_waits: int = 0  # times it waited with quota left: the learner already held its next versions' batches
    # The newest versions loaded (the first one too: whether any was), and how many in all: a run lasts days.
    versions_loaded: deque[int] = field(default_factory=lambda: deque(maxlen=KEEP_VERSIONS_LOADED))
    checkpoints_loaded: int = 0
    checkpoint_bytes: int = 0  # weights downloaded to follow the learner (half with its --broadcast-bf16)
    # (version, seconds from its announcement to this worker generating with it), not yet published
    load_latencies: list[tuple[int, float]] = field(default_factory=list)

    def loaded(self, version: int) -> None:
        self.versions_loaded.append(version)
        self.checkpoints_loaded += 1

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


def task_mixer(s: WorkerSettings, sources: Optional[Sequence[TaskSource]] = None) -> TaskMixer:
    """The tasks a worker with these settings draws, in its order: its sources' side of the split, seeded by its
    --seed (an evaluation worker's held-out tasks are the first --episodes of them). Given the sources it made
    before, the same draws again from the first."""
    if sources is None:
        sources = [SplitSource(seeded_source(name, s.seed), s.split)
                   for name in environments.expand(expand(list(s.sources)))]
    curriculum = Curriculum(s.curriculum_min_attempts, 4 * s.curriculum_min_attempts, s.curriculum_probe) \
        if s.curriculum_min_attempts else None
    return TaskMixer(sources, s.weights or None, seed=s.seed, curriculum=curriculum)


class RolloutWorker:
    def __init__(self, settings: WorkerSettings, platform: Settings,
                 backend: Optional[PolicyBackend] = None) -> None:
        self.settings = settings
        self.store = ObjectStore(platform, retry_for_s=600.0)
        self.sink = EventSink(platform, settings.topics, self.store)
        self.backend = backend or self._backend()
        self.mixer = self._mixer()
        # Its own producer: the event sink's delivery counts stay counts of events.
        self.metrics, self.metrics_out = Metrics("rollout"), Publisher(platform)
        self.window_start = int(time.time() * 1000)
        # Only code tasks run model-written code: a worker of other domains needs no sandbox (and the
        # sandbox refuses to start without isolation, see producers.sandbox.selection).
        needs_sandbox = any(source.domain in ("code", "terminal") for source in self.mixer.sources)
        self.code_runner = (SandboxCodeRunner(settings.sandbox, settings.sandbox_workers) if needs_sandbox
                            else NoCodeRunner())
        self.follower = CheckpointFollower(platform, settings.topics, self.store)
        self.demand = LearnerDemand(platform, settings.topics)
        self.manifest: Optional[CheckpointManifest] = None  # of the version it generates with
        self.task_feed = TaskStatsFollower(platform, settings.topics, self.mixer.stats)
        self.runner = EpisodeRunner(self.backend, self.code_runner, self.sink.emit, settings, self.stopping,
                                    max_context=context_limit(self.backend), flush=self.sink.flush)
        self.stats = WorkerStats()
        # Episodes it may still make before it waits for a newer version (--max-episodes-per-version): a
        # quota each version, up to --versions-ahead more of them in reserve.
        self.credit = 0
        # Where this version's episodes and the learner's batches stood when it was loaded: what the episodes
        # made since have added to the batches topic says how many episodes a batch now takes.
        self.yield_mark: Optional[tuple[int, int]] = None
        self._stop = False
        self.platform = platform
        self.episodes_goal = settings.episodes  # of the version it plays: one --episodes more per version in turn
        if settings.init_checkpoints:
            self.load_initial(platform, settings.init_checkpoints[0])

    def _backend(self) -> PolicyBackend:
        s = self.settings
        if s.model_dir is not None:
            return make_backend(s.backend, s.model_dir, seed=s.seed)
        return make_backend(s.backend, None, seed=s.seed, config=tiny_llama_config(layers=s.layers, width=s.width))

    def _mixer(self) -> TaskMixer:
        return task_mixer(self.settings)

    def load_initial(self, platform: Settings, spec: str) -> None:
        """Start from a published checkpoint (evaluation of a version, or a warm fleet restart)."""
        ns, _, version = spec.rpartition(":")
        event = find_announcement(platform, Topics(ns), None if version == "latest" else int(version))
        ready = fetch_verified(self.store, event, broadcast=False)  # eval measures the weights themselves
        self.backend.load_weights(ready.weights, ready.version)
        self.stats.loaded(ready.version)

    def stopping(self) -> bool:
        return self._stop

    def request_stop(self, *_: Any) -> None:
        self._stop = True

    def wait_for_published_weights(self) -> None:
        """Generate only with weights a checkpoint names: the newest announced one, v0 from a fresh learner.

        The worker's own initial weights are no version at all: rollouts made with them and stamped v0
        would carry log-probs of another network than the learner's v0, and wrong importance ratios.
        """
        started, said = time.monotonic(), 0.0
        while not self._stop and not (self.stats.versions_loaded and self.follower.caught_up.is_set()):
            if self.follower.caught_up.is_set():
                self.maybe_load_checkpoint()
            if time.monotonic() - said >= 10:
                said = time.monotonic()
                print(f"[{self.settings.producer_id}] waiting for a published checkpoint on "
                      f"{self.settings.topics.checkpoints} (a learner publishes v0 when it starts; "
                      f"{self.follower.refused_count} refused so far)", file=sys.stderr, flush=True)
            time.sleep(0.2)
        self.stats.paused_s += time.monotonic() - started

    def maybe_load_checkpoint(self) -> None:
        ready = self.follower.take_ready()
        # The first checkpoint is loaded even at the same version: it replaces this worker's own init.
        if ready is not None and (ready.version > self.backend.version or not self.stats.versions_loaded):
            previous = self.backend.version
            try:
                self.backend.load_weights(ready.weights, ready.version)
            except CheckpointError as exc:  # verified, but made for another model: keep the weights it has
                self.follower.refuse(f"checkpoint v{ready.version} verifies but does not fit this worker's model "
                                     f"(--model/--layers/--width must match the learner's): {exc}")
                return
            self.grant(ready.version - previous if self.stats.versions_loaded else None)
            self.manifest = ready.manifest
            self.mark_yield()
            self.stats.loaded(ready.version)
            self.stats.checkpoint_bytes += ready.size
            # generation with it starts now: the step that follows this call
            self.stats.load_latencies.append((ready.version, max(0.0, time.time() - ready.event.ts / 1000)))
            print(f"[{self.settings.producer_id}] loaded policy v{ready.version} ({ready.file}, "
                  f"{ready.size / 1e6:.1f} MB)", file=sys.stderr, flush=True)

    def wait_until_fresh(self) -> None:
        """Pause generation while this policy is more than max_policy_lag versions behind (no wasted rollouts)."""
        started = time.monotonic()
        while not self._stop and self.follower.latest_published - self.backend.version > self.settings.max_policy_lag:
            self.maybe_load_checkpoint()
            time.sleep(0.2)
        self.stats.paused_s += time.monotonic() - started

    def grant(self, versions: Optional[int]) -> None:
        """A quota for each of `versions` newer versions (None: the first one loaded, which starts with every
        quota it may hold), never more than 1 + --versions-ahead quotas held at once."""
        quota = self.settings.max_episodes_per_version
        if quota is None:
            return
        most = quota * (1 + self.settings.versions_ahead)
        self.credit = most if versions is None else min(self.credit + quota * versions, most)

    def wait_for_quota(self) -> None:
        """Once the quota of this version is made (and any held ahead), wait (bounded) for a newer one, but
        only while the learner has the batches that version needs.

        The log would otherwise fill with rollouts the learner can only drop as stale: producers
        outrun a learner on these machines by an order of magnitude. A fixed quota alone stalls the other way:
        once most groups teach nothing (all right) and are dropped upstream, a quota no longer fills an update
        and the worker waited for a version the learner could not make.
        """
        if self.settings.max_episodes_per_version is None:
            return
        if self.credit > 0:
            self.wait_for_queue()
            return
        started, version = time.monotonic(), self.backend.version
        self.stats.quota_waits += 1
        while not self._stop and self.backend.version == version:
            waited = time.monotonic() - started
            if waited > self.settings.quota_wait_s:
                self.grant(1)  # no newer version in time: a stalled learner must not stall the fleet forever
                break
            lacking = self.episodes_the_learner_lacks(waited)
            if lacking > 0:
                self.stats.demand_steps += 1
                self.credit = lacking
                break
            self.maybe_load_checkpoint()
            time.sleep(0.2)
        self.stats.paused_s += time.monotonic() - started

    def learner_queue_full(self) -> bool:
        """True while the batches topic holds, past this version's offsets, rollouts for the learner's next
        QUEUED_VERSIONS versions (and for the versions held ahead): more episodes now would queue behind them and
        reach the learner stale. Batches of demonstrations left over from an SFT phase do not count: the learner
        skips them, and a worker that waited for it to read them would wait for a version that cannot come
        without its rollouts. Never with --fixed-quota or a manifest that does not say what it needs."""
        s, manifest = self.settings, self.manifest
        if s.demand_settle_s is None or manifest is None or manifest.next_batches <= 0:
            return False
        queued = self.demand.rollouts_since(manifest.offsets)
        return queued is not None and queued >= manifest.next_batches * (QUEUED_VERSIONS + s.versions_ahead)

    def wait_for_queue(self) -> None:
        """With quota left, wait while the learner's queue is full, until it reads (a newer version) or runs low.

        A quota is a bound, not a rate: where fewer groups than it allows for are dropped upstream, a quota
        fills more batches than a version trains on. The surplus queued up and reached the learner stale: a
        default demo made 1,024 episodes every version and its learner skipped 227 whole batches as stale
        against 400 it trained on."""
        if not self.learner_queue_full():
            return
        started, version = time.monotonic(), self.backend.version
        self.stats.queue_waits += 1
        checked = started
        while not self._stop and self.backend.version == version:
            if time.monotonic() - checked >= QUEUE_POLL_S:
                checked = time.monotonic()
                if not self.learner_queue_full():
                    break
            self.maybe_load_checkpoint()
            time.sleep(0.1)
        self.stats.paused_s += time.monotonic() - started

    def mark_yield(self) -> None:
        """Remember the episodes made and the batches the learner holds toward the version after the one just
        loaded (a broker round trip, only where the worker follows the learner's demand)."""
        self.yield_mark = None
        if self.settings.demand_settle_s is None or not self.settings.max_episodes_per_version or self.manifest is None:
            return
        held = self.demand.rollouts_since(self.manifest.offsets)
        if held is not None:
            self.yield_mark = (self.stats.episodes, held)

    def episodes_the_learner_lacks(self, waited_s: float) -> int:
        """Episodes to make for the batches the learner lacks for the version after this worker's, at least a
        step and at most a quota; 0 while it has them, before the batches of the episodes already made had
        --demand-settle-s to arrive, with --fixed-quota or an older learner.

        How many episodes a batch takes is measured: the episodes made with this version over the batches they
        added. Groups that teach nothing (all right or all wrong) are dropped upstream, so once the policy
        solves most tasks a batch takes several times the episodes it took at first. Estimated as the share of
        a quota a version's batches are (the measurement's fallback), each wait made a fraction of what the
        learner lacked and waited again: a demo whose policy solved 95% of its tasks paused its worker 324 s in
        220 waits while the learner waited for data 62% of its time."""
        settle, manifest = self.settings.demand_settle_s, self.manifest
        if settle is None or waited_s < settle or manifest is None:
            return 0
        short = self.demand.shortfall(manifest)
        if short is None or short <= 0:
            return 0
        quota = self.settings.max_episodes_per_version or 0
        per_batch = quota / manifest.next_batches
        if self.yield_mark is not None:
            made, added = self.stats.episodes - self.yield_mark[0], manifest.next_batches - short - self.yield_mark[1]
            if made > 0:
                per_batch = made / max(added, 1)
        step = self.settings.prompts_per_step * self.settings.group_size
        return max(step, min(quota, math.ceil(short * per_batch)))

    def step(self) -> None:
        self.maybe_load_checkpoint()
        paused = self.stats.paused_s
        if self.settings.follow_checkpoints:
            self.wait_until_fresh()
            self.wait_for_quota()
        if self._stop:
            return
        budget = min(self.remaining_prompts(), self.quota_prompts())
        tasks = [self.mixer.next() for _ in range(min(self.settings.prompts_per_step, budget))]
        summary = self.runner.run_step(tasks)
        self.credit -= summary.episodes
        self.stats.add(summary)
        self.progress(summary)
        self.publish_metrics(summary, self.stats.paused_s - paused)

    def publish_metrics(self, s: StepSummary, paused_s: float) -> None:
        """The step's figures on <ns>.pipeline.metrics (source "rollout", labelled with this worker's id)."""
        m, worker = self.metrics, self.settings.producer_id
        for status, n in s.statuses.items():
            m.count("rollout/episodes", n, producer=worker, status=status)
        m.count("rollout/tokens", s.tokens, producer=worker)
        for name, seconds in (("generate", s.generate_s), ("sandbox", s.sandbox_s), ("paused", paused_s)):
            m.gauge(f"rollout/{name}_s", seconds, producer=worker)
        m.gauge("rollout/tokens_per_s", s.tokens / s.generate_s if s.generate_s else 0.0, producer=worker)
        m.gauge("rollout/policy_version", float(self.backend.version), producer=worker)
        m.gauge("rollout/checkpoints_loaded", float(self.stats.checkpoints_loaded), producer=worker)
        m.gauge("rollout/checkpoints_refused", float(self.follower.refused_count), producer=worker)
        m.gauge("rollout/checkpoint_bytes", float(self.stats.checkpoint_bytes), producer=worker)
        for source, n in self.mixer.drawn.items():  # tasks drawn per source since the start: the mix as it ran
            m.gauge("rollout/tasks_drawn", float(n), producer=worker, source=source)
        if self.mixer.curriculum is not None:
            for reason, n in self.mixer.skips.items():
                m.gauge("rollout/curriculum_skips", float(n), producer=worker, reason=reason)
            m.gauge("rollout/curriculum_probes", float(self.mixer.probes), producer=worker)
            m.gauge("rollout/curriculum_exhausted", float(self.mixer.exhausted), producer=worker)
        for version, seconds in self.stats.load_latencies:
            m.gauge("rollout/checkpoint_latency_s", seconds, producer=worker, version=str(version))
        self.stats.load_latencies.clear()
        now = int(time.time() * 1000)
        publish(self.metrics_out, self.settings.topics.metrics, m.flush(self.window_start, now))
        self.window_start = now

    def remaining_prompts(self) -> int:
        if self.episodes_goal is None:
            return self.settings.prompts_per_step
        return self.prompts_for(self.episodes_goal - self.stats.episodes)

    def quota_prompts(self) -> int:
        """The prompts left of the quota it holds: the last step before a wait makes what is left, not a whole
        step beyond it."""
        if self.settings.max_episodes_per_version is None or not self.settings.follow_checkpoints:
            return self.settings.prompts_per_step
        return self.prompts_for(self.credit)

    def prompts_for(self, episodes: int) -> int:
        """Prompts whose groups make `episodes` episodes, rounded up to whole groups, at least one."""
        return max(1, -(-episodes // self.settings.group_size))

    def done(self) -> bool:
        return self._stop or (self.episodes_goal is not None and self.stats.episodes >= self.episodes_goal)

    def play_each_version(self) -> None:
        """--init-checkpoint NS:V1,V2,...: --episodes with each version in turn, each drawing the same tasks in the
        same order (a fresh mixer on the same sources and seed), in one process: an evaluation of several versions
        starts Python, torch and the task split once."""
        s = self.settings
        assert s.episodes is not None  # the settings refuse several versions without --episodes
        for turn, spec in enumerate(s.init_checkpoints):
            if turn:
                self.load_initial(self.platform, spec)
                self.mixer = task_mixer(s, self.mixer.sources)
                self.episodes_goal = s.episodes * (turn + 1)
            started = time.monotonic()
            while not self.done():
                self.step()
            if self._stop:
                return
            print(f"[{s.producer_id}] v{self.backend.version}: {s.episodes} episodes in "
                  f"{time.monotonic() - started:.1f}s", file=sys.stderr, flush=True)

    def progress(self, s: StepSummary) -> None:
        rate = s.tokens / s.generate_s if s.generate_s else 0.0
        print(f"[{self.settings.producer_id}] step {self.stats.steps}: {s.episodes} episodes {s.statuses} "
              f"v{self.backend.version} {rate:.0f} tok/s, sandbox {s.sandbox_s:.1f}s, "
              f"events {self.sink.stats['delivered']}/{self.sink.stats['sent']} delivered",
              file=sys.stderr, flush=True)

    def publish_demonstrations(self) -> dict[str, Any]:
        """The tasks' gold completions as demonstration episodes (for the SFT warm start), then done."""
        s = self.settings
        tasks = (self.mixer.next() for _ in range(s.demonstrations))
        played = DemonstrationRunner(DemonstrationBackend(self.backend.tokenizer), self.code_runner, self.sink.emit,
                                     replace(s, group_size=1), max_context=context_limit(self.backend),
                                     flush=self.sink.flush)
        try:
            self.stats.episodes = publish_demonstrations(tasks, self.backend.tokenizer, s.ns, s.producer_id,
                                                         self.sink.emit, played)
        finally:
            self.sink.close()
            self.code_runner.close()
        print(f"[{s.producer_id}] published {self.stats.episodes} demonstrations", file=sys.stderr, flush=True)
        return self.report()

    def run(self) -> dict[str, Any]:
        if self.settings.demonstrations:
            return self.publish_demonstrations()
        if threading.current_thread() is threading.main_thread():  # embedded in a thread, the host owns signals
            signal.signal(signal.SIGTERM, self.request_stop)
            signal.signal(signal.SIGINT, self.request_stop)
        if self.settings.follow_checkpoints:
            self.follower.start()
            self.wait_for_published_weights()
        elif not self.stats.versions_loaded and not self.settings.own_weights:
            raise ConfigError("a worker that does not follow checkpoints needs --init-checkpoint NS:VERSION "
                              "(or --own-weights for a data-path test that trains nothing)")
        if self.settings.own_weights:
            log.warning("generating with this worker's own initial weights, which no checkpoint names: "
                        "for data-path tests only, never for training")
        if self.settings.curriculum_min_attempts:
            self.task_feed.start()
        try:
            if len(self.settings.init_checkpoints) > 1:
                self.play_each_version()
            while not self.done():
                self.step()
        finally:
            self.sink.close()  # flush: every event acknowledged before exit
            self.metrics_out.close()
            self.code_runner.close()
            self.demand.close()
        return self.report()

    def report(self) -> dict[str, Any]:
        return {"producer_id": self.settings.producer_id, "episodes": self.stats.episodes, "steps": self.stats.steps,
                "statuses": self.stats.statuses, "tokens": self.stats.tokens, "events": self.sink.stats,
                "generate_s": round(self.stats.generate_s, 2), "sandbox_s": round(self.stats.sandbox_s, 2),
                "paused_s": round(self.stats.paused_s, 2), "quota_waits": self.stats.quota_waits,
                "queue_waits": self.stats.queue_waits,
                "demand_steps": self.stats.demand_steps,
                "checkpoints_loaded": self.stats.checkpoints_loaded,
                "versions_loaded": list(self.stats.versions_loaded),
                "checkpoint_bytes": self.stats.checkpoint_bytes, "checkpoints_refused": self.follower.refused_count,
                "refusals": list(self.follower.refused), "curriculum_skips": dict(self.mixer.skips),
                "curriculum_probes": self.mixer.probes, "curriculum_exhausted": self.mixer.exhausted}


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
