"""The learner service: batches in, updates, checkpoints out; a restart neither repeats nor skips a batch.

    python -m learner --ns demo --sft-updates 4 --algorithm grpo --updates-per-checkpoint 2

Resume: the newest *announced* checkpoint is the truth. Its manifest records the batch-topic offsets
after its data and the batch ids trained so far, so a crash mid-update, after a save before its
announcement, or after the announcement before the offset commit, all restart from exactly there.
"""
from __future__ import annotations

import signal
import sys
import time
from typing import Any, Optional

import torch

from consumers.batch_reader import BatchReader, LoadedBatch, ShardCache
from infra.kafka import Publisher
from infra.objectstore import ObjectStore
from infra.settings import Settings
from learner import checkpoint_store
from learner.checkpoint_files import file_entries, read_checkpoint, write_checkpoint
from learner.faults import fault_point
from learner.model import build_policy
from learner.settings import LearnerSettings
from learner.update import TrainConfig, Trainer
from schemas.codec import codec
from schemas.manifests import CheckpointManifest
from schemas.records import PipelineMetric

KEEP_IDS = 1000  # batch ids carried from checkpoint to checkpoint (plus the newest per source partition)


def train_config(s: LearnerSettings, algorithm: str) -> TrainConfig:
    return TrainConfig(algorithm=algorithm, lr=s.lr, grad_accum=s.grad_accum, clip_eps=s.clip_eps,
                       kl_coef=s.kl_coef, temperature=s.temperature if algorithm in ("grpo", "ppo") else 1.0,
                       max_policy_lag=s.max_policy_lag, lag_mode=s.lag_mode if algorithm in ("grpo", "ppo") else "drop",
                       max_len=s.max_len, grad_checkpointing=s.grad_checkpointing, seed=s.seed)


def model_from_config(config: dict[str, Any]) -> Any:
    """The architecture a checkpoint was written from (its weights are loaded by the trainer)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(config)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    model.train()
    return model


def carried_ids(previous: list[str], new: list[str]) -> list[str]:
    """The ids a checkpoint carries: the last KEEP_IDS, and the newest of each source partition."""
    ids = previous + new
    newest: dict[str, str] = {}
    for bid in ids:
        source, _, span = bid.rpartition(":")
        if source not in newest or int(span.split("-")[1]) > int(newest[source].rpartition(":")[2].split("-")[1]):
            newest[source] = bid
    return list(dict.fromkeys(ids[-KEEP_IDS:] + sorted(newest.values())))


class LearnerService:
    def __init__(self, settings: LearnerSettings, platform: Settings) -> None:
        self.s = settings
        self.platform = platform
        self.topics = settings.topics
        self.store = ObjectStore(platform, retry_for_s=600.0)
        self.publisher = Publisher(platform)
        self.reader = BatchReader(platform, settings.ns, settings.group, ShardCache(settings.cache_dir, settings.cache_bytes),
                                  prefetch=settings.prefetch, store=self.store)
        torch.manual_seed(settings.seed)
        self.model = build_policy(settings.model_dir, layers=settings.layers, width=settings.width, seed=settings.seed)
        self.version = 0
        self.updates = 0
        self.trained_ids: list[str] = []
        self.pending_ids: list[str] = []
        self.trainer = Trainer(self.model, train_config(settings, self.phase_algorithm(0)))
        self.timing = {"wait_s": 0.0, "compute_s": 0.0, "checkpoint_s": 0.0}
        self._stop = False

    def phase_algorithm(self, updates: int) -> str:
        return "sft" if updates < self.s.sft_updates else self.s.algorithm

    # ---- resume --------------------------------------------------------------------------------
    def resume(self) -> str:
        loaded = checkpoint_store.newest(self.platform, self.topics, self.store, run=self.s.ns)
        if loaded is None:
            self.checkpoint(initial=True)
            return "fresh: published the initial weights as v0"
        state = read_checkpoint(loaded.files)
        self.updates = int(state.trainer.get("updates", 0))
        self.model = model_from_config(state.model_config)
        self.trainer = Trainer(self.model, train_config(self.s, self.phase_algorithm(self.updates)))
        self.trainer.load_checkpoint_state(state.model, state.optimizer, state.trainer)
        self.version = loaded.manifest.version
        self.trained_ids = list(state.trainer.get("trained_batch_ids", []))
        self.reader.seek(loaded.manifest.offsets)
        self.reader.mark_seen(self.trained_ids)
        return f"resumed v{self.version} after {self.updates} updates, at offsets {loaded.manifest.offsets}"

    # ---- checkpoints ---------------------------------------------------------------------------
    def checkpoint(self, initial: bool = False) -> None:
        started = time.monotonic()
        if not initial:
            self.version += 1
        offsets = self.reader.positions()
        self.trained_ids = carried_ids(self.trained_ids, self.pending_ids)
        state = self.trainer.state_dict_for_checkpoint()
        state.trainer.update(updates=self.updates, version=self.version, trained_batch_ids=self.trained_ids)
        files = write_checkpoint(state)
        manifest = CheckpointManifest(
            run=self.s.ns, version=self.version, step=self.updates, algorithm=self.trainer.config.algorithm,
            files=file_entries(files), offsets=offsets, batch_ids=list(self.pending_ids),
            model_config=state.model_config, created_ts=int(time.time() * 1000))
        key, sha = checkpoint_store.store_files(self.store, self.s.ns, self.version, files, manifest)
        fault_point("after_save")
        checkpoint_store.announce(self.publisher, self.topics, self.store, manifest, key, sha)
        fault_point("after_publish")
        if offsets:
            self.reader.commit(offsets)
        self.pending_ids = []
        self.reader.set_policy_version(self.version)
        self.timing["checkpoint_s"] += time.monotonic() - started
        print(f"checkpoint v{self.version} stored, announced, offsets committed ({len(manifest.batch_ids)} batches)",
              file=sys.stderr, flush=True)

    # ---- updates -------------------------------------------------------------------------------
    def maybe_switch_phase(self) -> None:
        algorithm = self.phase_algorithm(self.updates)
        if algorithm != self.trainer.config.algorithm:
            optimizer_state = self.trainer.optimizer.state_dict()
            step = self.trainer.step_count
            self.trainer = Trainer(self.model, train_config(self.s, algorithm))
            self.trainer.optimizer.load_state_dict(optimizer_state)
            self.trainer.step_count = step
            print(f"switching to {algorithm} after {self.updates} updates", file=sys.stderr, flush=True)

    def update(self, batch: LoadedBatch) -> dict[str, float]:
        self.maybe_switch_phase()
        started = time.monotonic()
        metrics = self.trainer.step(list(batch.trajectories), current_version=self.version)
        fault_point("mid_update")
        self.timing["compute_s"] += time.monotonic() - started
        self.updates += 1
        self.pending_ids.append(batch.manifest.batch_id)
        metrics.update({"time/wait_data_s": batch.wait_s, "time/compute_s": time.monotonic() - started,
                        "train/version": float(self.version)})
        return metrics

    def publish_metrics(self, metrics: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        for name, value in metrics.items():
            if value == value:  # NaN figures are not published
                metric = PipelineMetric(source="learner", name=name, value=float(value),
                                        labels={"algorithm": self.trainer.config.algorithm, "version": str(self.version)},
                                        window_start=now, window_end=now)
                self.publisher.send(self.topics.metrics, name.encode(), codec.encode(metric))
        self.publisher.poll(0)

    def progress(self, metrics: dict[str, float]) -> None:
        total = f"/{self.s.max_updates}" if self.s.max_updates else ""
        share = self.timing["wait_s"] / max(1e-9, self.timing["wait_s"] + self.timing["compute_s"])
        print(f"update {self.updates}{total} [{self.trainer.config.algorithm}] v{self.version} "
              f"loss {metrics.get('loss/total', float('nan')):.4f} reward {metrics.get('rollout/reward_mean', 0):.3f} "
              f"clip {metrics.get('stats/clip_frac', 0):.3f} grad {metrics.get('stats/grad_norm', 0):.2f} "
              f"waiting {share:.0%}", file=sys.stderr, flush=True)

    # ---- loop ----------------------------------------------------------------------------------
    def request_stop(self, *_: Any) -> None:
        self._stop = True

    def done(self, idle_since: float) -> bool:
        if self._stop or (self.s.max_updates is not None and self.updates >= self.s.max_updates):
            return True
        return self.s.idle_exit_s is not None and time.monotonic() - idle_since > self.s.idle_exit_s

    def run(self) -> dict[str, Any]:
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        print(self.resume(), file=sys.stderr, flush=True)
        idle_since = time.monotonic()
        try:
            while not self.done(idle_since):
                waited = time.monotonic()
                batch = self.reader.next_batch(timeout=1.0)
                self.timing["wait_s"] += time.monotonic() - waited
                if batch is None:
                    continue
                idle_since = time.monotonic()
                metrics = self.update(batch)
                self.publish_metrics(metrics)
                self.progress(metrics)
                if self.updates % self.s.updates_per_checkpoint == 0:
                    self.checkpoint()
            if self.pending_ids:
                self.checkpoint()  # a clean stop keeps every trained batch
        finally:
            self.reader.close()
            self.publisher.close()
        return self.report()

    def report(self) -> dict[str, Any]:
        return {"version": self.version, "updates": self.updates, **{k: round(v, 2) for k, v in self.timing.items()},
                "reader": self.reader.metrics()}


def main(argv: Optional[list[str]] = None) -> int:
    import json

    from learner.settings import from_args
    from schemas.errors import PipelineError

    try:
        report = LearnerService(from_args(argv), Settings.from_env()).run()
    except PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report))
    return 0


__all__ = ["LearnerService", "main"]
