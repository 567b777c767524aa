"""The learner service: batches in, updates, checkpoints out; a restart neither repeats nor skips a batch.

    python -m learner --ns demo --sft-updates 4 --algorithm grpo --updates-per-checkpoint 2

Resume: the newest *announced* checkpoint is the truth. Its manifest records the batch-topic offsets
after its data and the batch ids trained so far, so a crash mid-update, after a save before its
announcement, or after the announcement before the offset commit, all restart from exactly there.

With --moments-every K the versions between every K-th carry no optimizer state. A restart then resumes
from the newest version that does and trains the batches of the versions announced after it again, in the
order their manifests recorded (`read_order`), without announcing them again: it reaches the newest
announced version with the same weights (on CPU bit for bit), and goes on from there.
"""
from __future__ import annotations

import dataclasses
import signal
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from statistics import fmean as mean
from typing import Any, Optional

import torch

from consumers.batch_reader import BatchReader, LoadedBatch, ShardCache
from infra.kafka import Publisher
from infra.objectstore import ObjectStore
from infra.settings import Settings
from learner import checkpoint_store, sharding
from learner.checkpoint_files import (
    CheckpointState,
    file_entries,
    load_model_tensors,
    model_tensors,
    read_checkpoint,
    unflatten_optimizer_state,
    write_checkpoint,
)
from infra.faults import fault_point
from learner.distributed import SAVE, START, STOP, TRAIN, World, join, pack, rank_device, unpack
from learner.model import build_policy, frozen_reference
from learner.settings import SFT_LOSS_WINDOW, SFT_MATCH_WINDOW, LearnerSettings, shaping_args
from learner.update import GREEDY_MATCH, ROWS, Lineage, TrainConfig, Trainer, select_trajectories
from schemas.codec import codec
from schemas.manifests import LEARNER_FINISHED_LINE, SFT_PHASE_ENDS_LINE, CheckpointManifest
from schemas.errors import CheckpointError, ConfigError, PipelineError
from schemas.records import PipelineMetric, Trajectory

STALE_UNFETCHED = "stale: not fetched (every turn of its batch was over --max-policy-lag versions behind)"
# An update reads on past stale data to fill --rl-batches-per-update with trainable trajectories, but holds at most
# this many times that many batches' trajectories (a backlog of data just over the lag is dropped in pieces).
MAX_READ_FACTOR = 4
KEEP_IDS = 1000  # batch ids carried from checkpoint to checkpoint (plus the newest per source partition)


def train_config(s: LearnerSettings, algorithm: str) -> TrainConfig:
    rl = algorithm in ("grpo", "ppo")
    lr = s.sft_lr if algorithm == "sft" and s.sft_lr is not None else s.lr
    return TrainConfig(algorithm=algorithm, lr=lr, grad_accum=s.grad_accum, micro_batch_tokens=s.micro_batch_tokens,
                       clip_eps=s.clip_eps,
                       dual_clip=s.dual_clip, kl_coef=s.kl_coef if rl else 0.0,
                       temperature=s.temperature if rl else 1.0,
                       max_policy_lag=s.max_policy_lag, lag_mode=s.lag_mode if algorithm in ("grpo", "ppo") else "drop",
                       max_len=s.max_len, grad_checkpointing=s.grad_checkpointing, seed=s.seed,
                       weight_decay=s.weight_decay, max_grad_norm=s.max_grad_norm, clip_eps_high=s.clip_eps_high,
                       beta=s.beta, loss_agg=s.loss_agg, lag_decay=s.lag_decay, sft_min_reward=s.sft_min_reward,
                       cpu_bf16=s.cpu_bf16, fsdp=s.fsdp)


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


class PolicyHolder:
    """What every rank holds: the policy, its trainer and KL/DPO anchor, and the version it is at."""

    def __init__(self, settings: LearnerSettings, platform: Settings, world: World) -> None:
        judged = (settings.sft_until_loss, settings.sft_until_match, settings.sft_enough_match)
        if any(bar is not None for bar in judged) and world.distributed:
            # the other ranks learn the phase from the update count rank 0 sends, not from its figures
            raise ConfigError("--sft-until-loss, --sft-until-match and --sft-enough-match run in one learner process: "
                              "under torchrun give --sft-updates alone")
        self.s = settings
        self.platform = platform
        self.world = world
        self.store = ObjectStore(platform, retry_for_s=600.0)
        torch.manual_seed(settings.seed)
        device = rank_device(settings.device, world)
        self.device = torch.device(device if device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
        self.model: Any = None
        self.version = 0
        self.updates = 0
        # --sft-until-loss / --sft-until-match: the update count at which the SFT phase ended early (None: not yet,
        # or not early), and the latest SFT losses and greedy matches it is judged on; all saved with every checkpoint
        self.sft_end: Optional[int] = None
        self.sft_losses: list[float] = []
        self.sft_matches: list[dict[str, list[float]]] = []  # per update: task source -> [written, sequences]
        self.reference: Any = None  # the KL / DPO anchor: checkpoint v{reference_version}, never the restored policy
        # Whose versions the data's turns count in: set from the store in resume() (a run started with --init)
        self.lineage = Lineage(run=settings.ns, replicates=settings.replica_of)
        self.trainer: Trainer

    def sft_updates(self) -> int:
        """Updates of the SFT phase: --sft-updates, or fewer where --sft-until-loss/--sft-until-match ended it early."""
        return self.s.sft_updates if self.sft_end is None else self.sft_end

    def last_update(self) -> Optional[int]:
        """The update count the run stops at: --max-updates, or --rl-updates after the SFT phase (None: never)."""
        return self.sft_updates() + self.s.rl_updates if self.s.rl_updates is not None else self.s.max_updates

    def phase_algorithm(self, updates: int) -> str:
        return "sft" if updates < self.sft_updates() else self.s.algorithm

    def judge_sft(self, metrics: dict[str, float]) -> None:
        """After an SFT update: end the phase once `sft_end_reason` gives one."""
        if self.sft_end is not None or "loss/sft" not in metrics:
            return
        self.sft_losses = [*self.sft_losses, metrics["loss/sft"]][-SFT_LOSS_WINDOW:]
        self.sft_matches = [*self.sft_matches, source_matches(metrics)][-SFT_MATCH_WINDOW:]
        why = sft_end_reason(self.s, self.sft_losses, self.sft_matches)
        if why and self.updates < self.s.sft_updates:
            self.sft_end = self.updates
            if self.world.leader:
                print(f"{SFT_PHASE_ENDS_LINE} {self.updates} of at most {self.s.sft_updates} updates: {why}",
                      file=sys.stderr, flush=True)

    def make_trainer(self, algorithm: str) -> Trainer:
        config = train_config(self.s, algorithm)
        return Trainer(self.model, config, reference=self.reference_model() if config.needs_reference else None,
                       lineage=self.lineage, world=self.world)

    def reference_model(self) -> Any:
        """Checkpoint v{reference_version} as stored, loaded once: the same anchor before and after a restart."""
        if self.reference is None:
            if self.s.reference_version == 0 and self.version == 0 and self.updates == 0:
                self.reference = frozen_reference(self.model)  # fresh: the initial weights are v0
            else:
                loaded = checkpoint_store.load_version(self.store, self.s.ns, self.s.reference_version)
                state = read_checkpoint(loaded.files)
                stored = model_from_config(state.model_config)
                load_model_tensors(stored, state.model)
                self.reference = frozen_reference(stored.to(self.device))
            if self.world.leader:
                print(f"KL/DPO reference: v{self.s.reference_version}", file=sys.stderr, flush=True)
        return self.reference

    def restore(self, loaded: checkpoint_store.LoadedCheckpoint) -> dict[str, Any]:
        """Weights, optimizer moments and counters of a verified checkpoint; returns its trainer state."""
        state = read_checkpoint(loaded.files)
        self.updates = int(state.trainer.get("updates", 0))
        end = state.trainer.get("sft_end")
        self.sft_end = None if end is None else int(end)
        self.sft_losses = [float(x) for x in state.trainer.get("sft_losses", [])]
        self.sft_matches = [{str(k): [float(x) for x in v] for k, v in update.items()}
                            for update in state.trainer.get("sft_matches", [])]
        self.model = model_from_config(state.model_config).to(self.device)
        self.version = loaded.manifest.version
        self.trainer = self.make_trainer(self.phase_algorithm(self.updates))
        self.trainer.load_checkpoint_state(state.model, state.moments(), state.trainer)
        return state.trainer

    def follow_lineage(self) -> None:
        """The runs this one descends from, as its v0 recorded them: a restart needs no --init to keep them."""
        self.lineage = Lineage(self.s.ns, self.s.replica_of, tuple(checkpoint_store.ancestors(self.store, self.s.ns)))
        self.trainer.lineage = self.lineage
        if self.lineage.ancestors and self.world.leader:
            print("lineage: " + " <- ".join([f"{self.s.ns}:v0", *(f"{r}:v{v}" for r, v in self.lineage.ancestors)]),
                  file=sys.stderr, flush=True)

    def maybe_switch_phase(self) -> None:
        algorithm = self.phase_algorithm(self.updates)
        if algorithm != self.trainer.config.algorithm:
            previous = self.trainer
            self.trainer = self.make_trainer(algorithm)
            self.trainer.load_optimizer_state(previous.optimizer.state_dict())  # see Trainer.load_optimizer_state
            self.trainer.step_count = previous.step_count
            if self.world.leader:
                print(f"switching to {algorithm} after {self.updates} updates", file=sys.stderr, flush=True)

    def warm_lr(self) -> None:
        """The next update's learning rate: the phase's, raised linearly over the run's first --warmup-updates
        (from the update count, so a resumed or a follower rank sets the same)."""
        if self.s.warmup_updates:
            share = min(1.0, (self.updates + 1) / self.s.warmup_updates)
            self.trainer.set_lr(self.trainer.config.lr * share)


class Follower(PolicyHolder):
    """A rank other than 0 under torchrun: starts from the version rank 0 resumed at (loaded and verified from
    the store), then trains its share of every batch rank 0 sends, until rank 0 says stop."""

    def run(self) -> dict[str, Any]:
        kind, version, _, _ = self.world.receive()
        if kind != START:
            raise PipelineError(f"rank {self.world.rank}: expected rank 0 to start, got command {kind}")
        self.restore(checkpoint_store.load_version(self.store, self.s.ns, version))
        self.follow_lineage()
        started, trained = version, 0
        while True:
            kind, version, updates, payload = self.world.receive()
            if kind == STOP:
                break
            if kind == SAVE:  # rank 0 writes a checkpoint of sharded weights: every rank gathers them
                self.trainer.state_dict_for_checkpoint()
                continue
            if kind != TRAIN:
                continue
            self.version, self.updates = version, updates
            self.maybe_switch_phase()
            self.warm_lr()
            trajectories = [codec.decode(record, Trajectory) for record in unpack(payload)]
            self.trainer.step(trajectories, current_version=version)
            fault_point("mid_update")
            trained += 1
        print(f"{self.world.describe()}: trained its share of {trained} updates from v{started}", file=sys.stderr,
              flush=True)
        return {"rank": self.world.rank, "updates": trained}


class LearnerService(PolicyHolder):
    """Rank 0 (or the only process): reads batches, trains, writes and announces checkpoints, commits offsets."""

    def __init__(self, settings: LearnerSettings, platform: Settings, world: Optional[World] = None) -> None:
        super().__init__(settings, platform, world or World())
        self.topics = settings.topics
        self.publisher = Publisher(platform)  # metrics, from this thread
        self.announcer = Publisher(platform)  # checkpoint announcements, from the publishing thread
        self.background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self.publishing: Optional[Future[None]] = None
        self.reader = BatchReader(platform, settings.ns, settings.group, ShardCache(settings.cache_dir, settings.cache_bytes),
                                  prefetch=settings.prefetch, store=self.store)
        model: Any = build_policy(settings.model_dir, layers=settings.layers, width=settings.width, seed=settings.seed)
        self.model = model.to(self.device)
        self.trained_ids: list[str] = []
        self.pending_ids: list[str] = []
        self.skipped: dict[str, str] = {}  # batch id -> why it trained nothing, since the last checkpoint
        self.untrained: dict[str, str] = {}  # trajectory id -> why it did not train, since the last checkpoint
        self.trainer = self.make_trainer(self.phase_algorithm(0))
        # checkpoint_s: the update loop's own time on checkpoints (its wait for the previous one included);
        # publish_s: storing and announcing them, in the background unless --foreground-checkpoints
        self.timing = {"wait_s": 0.0, "compute_s": 0.0, "checkpoint_s": 0.0, "publish_s": 0.0, "publish_wait_s": 0.0}
        self._stop = False
        self.published_bytes = 0  # checkpoint files stored by this process
        self.resume_version = 0  # the newest announced version with the optimizer state: retention keeps it
        self.replaying: list[CheckpointManifest] = []  # announced versions after it, to train again on resume

    # ---- resume --------------------------------------------------------------------------------
    def resume(self) -> str:
        point = checkpoint_store.resume_point(self.platform, self.topics, self.store, run=self.s.ns)
        if point is None:
            how = self.start_from_init() if self.s.init_from else "the initial weights"
            self.checkpoint(initial=True)
            self.follow_lineage()
            return f"fresh: published {how} as v0"
        loaded, self.replaying = point
        trainer_state = self.restore(loaded)
        self.resume_version = self.version
        self.trained_ids = list(trainer_state.get("trained_batch_ids", []))
        self.reader.seek(loaded.manifest.offsets)
        self.reader.mark_seen(self.trained_ids)
        self.follow_lineage()
        return (f"resumed v{self.version} after {self.updates} updates, at offsets {loaded.manifest.offsets}"
                f"{replay_line(self.replaying)}")

    def replay(self, timeout_s: float = 120.0) -> None:
        """Train the batches of the announced weights-only versions after the resume point again, each version's
        in the order it read them and grouped as it trained them, and take each version as announced."""
        for manifest in self.replaying:
            wanted, gathered = list(manifest.read_order), []
            while wanted:
                deadline = time.monotonic() + timeout_s
                batch = None
                while batch is None and time.monotonic() < deadline:
                    batch = self.reader.next_batch(timeout=1.0)
                if batch is None or batch.manifest.batch_id != wanted[0]:
                    found = "nothing" if batch is None else f"batch {batch.manifest.batch_id}"
                    raise CheckpointError(f"training v{manifest.version} again (it is weights-only): its batch "
                                          f"{wanted[0]} was next, {self.topics.batches} gave {found}: resume needs "
                                          "the batches topic to keep what the versions after the resume point read")
                gathered.append(batch)
                wanted.pop(0)
                if self.update_full(gathered) or not wanted:
                    self.update(gathered)
                    self.maybe_switch_phase()
                    gathered = []
            self.adopt(manifest)
        self.replaying = []

    def adopt(self, manifest: CheckpointManifest) -> None:
        """A version trained again: the same batches and update count as announced, and the announced weights.
        A version whose stored files do not verify any more is stored again, made from what was trained."""
        if self.pending_ids != manifest.read_order or self.updates != manifest.step:
            raise CheckpointError(f"v{manifest.version} trained again does not match its announcement: batches "
                                  f"{self.pending_ids} and {self.updates} updates, not {manifest.read_order} and "
                                  f"{manifest.step}")
        announced = None
        if not sharding.is_sharded(self.trainer.model):
            try:
                # its manifest, read and verified against the announcement by resume_point: not read again
                announced = read_checkpoint(checkpoint_store.load_files(self.store, self.s.ns, manifest).files).model
            except CheckpointError as exc:
                print(f"v{manifest.version} trained again: {exc}; storing it again", file=sys.stderr, flush=True)
                self.checkpoint()  # the next version is this one: its batches, update count and offsets
                return
        self.version = manifest.version
        self.trained_ids = carried_ids(self.trained_ids, self.pending_ids)
        self.pending_ids, self.skipped, self.untrained = [], {}, {}
        if not self.lineage.ancestors:
            self.reader.set_policy_version(self.version)
        verdict = "not compared (sharded)"
        if announced is not None:
            ours = model_tensors(self.trainer.model)
            diff = max(float((ours[k] - announced[k]).abs().max()) for k in ours)
            verdict = "the announced weights, bit for bit"
            if diff and self.world.distributed:  # every rank holds the weights it trained: they stay alike
                verdict = f"max |diff| {diff:.3g} from the announced weights"
            elif diff:
                verdict = f"max |diff| {diff:.3g} from the announced weights, which it takes"
                load_model_tensors(self.trainer.model, announced)
        batches = len(manifest.read_order)
        print(f"v{manifest.version} trained again ({batches} batch{'es' if batches != 1 else ''}, "
              f"{self.updates} updates): {verdict}", file=sys.stderr, flush=True)

    def start_from_init(self) -> str:
        """--init RUN:vK: that checkpoint's weights (verified) become this run's v0, with a fresh optimizer, or
        with --init-moments its Adam moments under this run's learning rate (v0 stores them: other ranks and a
        resume read them there)."""
        run, version = self.s.init_from or ("", 0)
        state = read_checkpoint(checkpoint_store.load_version(self.store, run, version).files)
        if self.s.init_moments and state.optimizer is None:
            raise CheckpointError(f"--init-moments: {run}:v{version} carries no optimizer state (a weights-only "
                                  "version, --moments-every): name a version that does, or drop --init-moments")
        self.model = model_from_config(state.model_config).to(self.device)
        load_model_tensors(self.model, state.model)
        self.reference = None  # the anchor is v0: these weights, not the ones built before
        self.trainer = self.make_trainer(self.phase_algorithm(0))
        if self.s.init_moments:
            self.trainer.load_optimizer_state(unflatten_optimizer_state(state.moments()))
            return f"the weights and Adam moments of {run}:v{version}"
        return f"the weights of {run}:v{version}"

    # ---- checkpoints ---------------------------------------------------------------------------
    def checkpoint(self, initial: bool = False, final: bool = False) -> None:
        """Copy the next version's state now, then write, store, announce and commit it: in a background
        thread that overlaps the next update (one in flight at most, so versions are announced in order), or
        here with --foreground-checkpoints. Either way a crash before the announcement resumes from the
        version before, which is what a crash mid-update does."""
        started = time.monotonic()
        self.finish_publishing()  # the previous version announced (or its failure raised) before this one
        if not initial:
            self.version += 1
        offsets = self.reader.positions()
        self.trained_ids = carried_ids(self.trained_ids, self.pending_ids)
        if sharding.is_sharded(self.trainer.model):
            self.world.send(SAVE, self.version, self.updates)
        moments = initial or final or self.version % self.s.moments_every == 0
        state = self.trainer.state_dict_for_checkpoint(moments=moments)
        state.trainer.update(updates=self.updates, version=self.version, trained_batch_ids=self.trained_ids,
                             learner_args=shaping_args(self.s), sft_end=self.sft_end, sft_losses=self.sft_losses,
                             sft_matches=self.sft_matches)
        # The manifest now, without its files: their bytes and sha256 are written in publish, off the update loop
        # (a fifth of the learner's main thread on the tiny model); `state` is a copy the next update cannot change.
        manifest = CheckpointManifest(
            run=self.s.ns, version=self.version, step=self.updates, algorithm=self.trainer.config.algorithm,
            files={}, offsets=offsets, batch_ids=[b for b in self.pending_ids if b not in self.skipped],
            model_config=state.model_config, created_ts=int(time.time() * 1000), skipped_batches=dict(self.skipped),
            base_model=self.s.model_dir or "", untrained=dict(self.untrained),
            init_from=f"{self.s.init_from[0]}:v{self.s.init_from[1]}" if self.s.init_from and initial else "",
            read_order=list(self.pending_ids), next_batches=self.next_version_batches())
        self.pending_ids = []
        self.skipped = {}
        self.untrained = {}
        if not self.lineage.ancestors:  # the reader's test counts in this run's versions only
            self.reader.set_policy_version(self.version)
        if initial or self.s.foreground_checkpoints:
            self.publish(state, manifest)
        else:
            self.publishing = self.background.submit(self.publish, state, manifest)
        self.timing["checkpoint_s"] += time.monotonic() - started

    def publish(self, state: CheckpointState, manifest: CheckpointManifest) -> None:
        """Write the version's files, store them (each verified) with the manifest that lists them, announce the
        version, commit the batch offsets it consumed, prune."""
        started = time.monotonic()
        files = write_checkpoint(state, moments=state.optimizer is not None, broadcast_bf16=self.s.broadcast_bf16)
        manifest = dataclasses.replace(manifest, files=file_entries(files))
        key, sha = checkpoint_store.store_files(self.store, self.s.ns, manifest.version, files, manifest)
        fault_point("after_save")
        checkpoint_store.announce(self.announcer, self.topics, self.store, manifest, key, sha)
        fault_point("after_publish")
        if manifest.offsets:
            self.reader.commit(manifest.offsets)
        self.let_go(manifest.version, manifest.has_moments)
        self.timing["publish_s"] += time.monotonic() - started
        self.published_bytes += sum(len(data) for data in files.values())
        print(f"checkpoint v{manifest.version} stored, announced, offsets committed ({len(manifest.batch_ids)} "
              "batches)", file=sys.stderr, flush=True)

    def finish_publishing(self) -> None:
        """Wait for the checkpoint in flight, if any; a failure to store or announce it is raised here."""
        if self.publishing is not None:
            waited = time.monotonic()
            try:
                self.publishing.result()
            finally:
                self.publishing = None
                self.timing["publish_wait_s"] += time.monotonic() - waited

    def let_go(self, version: int, moments: bool) -> None:
        """Retention (--keep-last, --keep-every): the version that just left the last K loses its files; the
        newest version with the optimizer state (a restart resumes there) keeps them until a newer one has it."""
        previous, keep = self.resume_version, self.s.keep_last
        if moments:
            self.resume_version = version
        protected = {0, self.s.reference_version, self.resume_version}
        olds = [checkpoint_store.prunable(version, keep, self.s.keep_every, protected)]
        if moments and keep and previous + keep < version:  # it left the last K while a restart needed it
            olds.append(checkpoint_store.prunable(previous + keep, keep, self.s.keep_every, protected))
        for old in olds:
            if old is not None:
                freed = checkpoint_store.prune(self.store, self.s.ns, old)
                print(f"retention: v{old}'s files deleted ({freed / 1e6:.0f} MB), its manifest kept", file=sys.stderr,
                      flush=True)

    # ---- updates -------------------------------------------------------------------------------
    def checkpoint_due(self, updates: Optional[int] = None) -> bool:
        """Every --updates-per-checkpoint updates; during SFT every --sft-updates-per-checkpoint, since no
        rollout worker waits for those versions; and always at the end of the SFT phase."""
        updates = self.updates if updates is None else updates
        if updates == self.sft_updates():
            return True
        every = self.s.sft_updates_per_checkpoint if updates < self.sft_updates() else self.s.updates_per_checkpoint
        return updates % (every or self.s.updates_per_checkpoint) == 0

    def batches_per_update(self, updates: Optional[int] = None) -> int:
        """Shards merged into one update: 1 while imitating, --rl-batches-per-update for policy gradients
        (their estimate is noisy; more groups per step is what made RL raise held-out success here)."""
        sft = self.phase_algorithm(self.updates if updates is None else updates) == "sft"
        return 1 if sft else self.s.rl_batches_per_update

    def counted_batches(self, batches: list[LoadedBatch]) -> float:
        """What `batches` count for against --rl-batches-per-update. In a policy-gradient phase a batch counts for
        the share of its trajectories that can train at this version (the rest over --max-policy-lag, or its
        shard unreadable), so an update reads on past stale data until it holds as many trainable trajectories
        as the setting says: counted as whole batches, a default demo's updates trained 381 of their 512 on
        average and some 16, a strictly on-policy one's 174. The count depends only on the batches and the
        version, so a resume that trains them again groups them the same."""
        if self.trainer.config.algorithm not in ("grpo", "ppo"):
            return float(len(batches))
        config, lineage = self.trainer.config, self.trainer.lineage
        return sum(len(select_trajectories(b.trajectories, self.version, config, lineage).kept) / len(b.trajectories)
                   for b in batches if b.trajectories)

    def untrainable(self, batches: list[LoadedBatch]) -> dict[str, str]:
        """The batches none of whose trajectories could train at this version, each with why (an update of
        others trained them with it, counting them for nothing)."""
        config, lineage = self.trainer.config, self.trainer.lineage
        selections = {b.manifest.batch_id: select_trajectories(b.trajectories, self.version, config, lineage)
                      for b in batches}
        return {b: skip_reason(selection.counts) for b, selection in selections.items() if not selection.kept}

    def update_full(self, batches: list[LoadedBatch]) -> bool:
        wanted = self.batches_per_update()
        held = sum(1 for b in batches if b.trajectories)
        return held >= MAX_READ_FACTOR * wanted or self.counted_batches(batches) >= wanted

    def next_version_batches(self) -> int:
        """The batches the next version trains on (when none is skipped): what its checkpoint tells rollout
        workers the learner still needs, so that they wait only while it has them."""
        updates, needed = self.updates, 0
        while True:
            needed += self.batches_per_update(updates)
            updates += 1
            last = self.last_update()
            if self.checkpoint_due(updates) or (last is not None and updates >= last):
                return needed

    def update(self, batches: list[LoadedBatch]) -> dict[str, float]:
        self.maybe_switch_phase()
        self.warm_lr()
        started = time.monotonic()
        trajectories = [t for batch in batches for t in batch.trajectories]
        self.world.send(TRAIN, self.version, self.updates, pack([codec.encode(t) for t in trajectories]))
        metrics = self.trainer.step(trajectories, current_version=self.version)
        fault_point("mid_update")
        self.timing["compute_s"] += time.monotonic() - started
        ids = [batch.manifest.batch_id for batch in batches]
        self.pending_ids += ids  # consumed either way: committed with the next checkpoint
        # Per batch, why none of it trained when that is so regardless of the update: its shard, or staleness.
        unfetched = {b.manifest.batch_id: b.problem or STALE_UNFETCHED for b in batches if b.problem or b.stale}
        updated = bool(metrics.get("train/updated", 0.0))
        if updated:
            self.updates += 1
            self.judge_sft(metrics)
            self.skipped.update(unfetched)
            self.skipped.update(self.untrainable([b for b in batches if b.manifest.batch_id not in unfetched]))
            self.untrained.update(self.trainer.last_dropped)
        else:
            self.skipped.update({b: unfetched.get(b) or skip_reason(metrics) for b in ids})
        for batch in batches:
            batch_id = batch.manifest.batch_id
            if batch_id in unfetched or not updated:
                why = unfetched.get(batch_id) or f"its batch trained nothing: {self.skipped[batch_id]}"
                self.untrained.update(dict.fromkeys(batch.manifest.trajectory_ids, why))
        metrics.update({"time/wait_data_s": sum(b.wait_s for b in batches), "time/compute_s": time.monotonic() - started,
                        "train/version": float(self.version)})
        return metrics

    def train_on(self, batches: list[LoadedBatch]) -> None:
        metrics = self.update(batches)
        self.publish_metrics(metrics)
        self.progress(metrics, [b.manifest.batch_id for b in batches])
        if metrics.get("train/updated") and self.checkpoint_due():
            self.checkpoint()
        self.maybe_switch_phase()  # announce the next phase now: a demo starts its rollout workers on it

    def publish_metrics(self, metrics: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        for name, value in metrics.items():
            if value == value:  # NaN figures are not published
                metric = PipelineMetric(source="learner", name=name, value=float(value),
                                        labels={"algorithm": self.trainer.config.algorithm, "version": str(self.version)},
                                        window_start=now, window_end=now)
                self.publisher.send(self.topics.metrics, name.encode(), codec.encode(metric))
        self.publisher.poll(0)

    def progress(self, metrics: dict[str, float], batch_ids: list[str]) -> None:
        last = self.last_update()
        total = f"/{last}" if last else ""
        for batch_id in batch_ids:
            if batch_id in self.skipped:
                print(f"batch {batch_id} skipped [{self.trainer.config.algorithm}] v{self.version}: "
                      f"{self.skipped[batch_id]}", file=sys.stderr, flush=True)
        if not metrics.get("train/updated"):
            return
        share = self.timing["wait_s"] / max(1e-9, self.timing["wait_s"] + self.timing["compute_s"])
        match = f" greedy match {metrics[GREEDY_MATCH]:.2f}" if GREEDY_MATCH in metrics else ""
        pooled = pooled_matches([source_matches(metrics)])
        weakest = weakest_source(pooled)
        if weakest is not None and len(pooled) > 1:
            match += f" (weakest {weakest[0]} {weakest[1]:.2f})"
        print(f"update {self.updates}{total} [{self.trainer.config.algorithm}] v{self.version} "
              f"loss {metrics.get('loss/total', float('nan')):.4f} reward {metrics.get('rollout/reward_mean', 0):.3f} "
              f"clip {metrics.get('stats/clip_frac', 0):.3f} grad {metrics.get('stats/grad_norm', 0):.2f} "
              f"waiting {share:.0%}{match}", file=sys.stderr, flush=True)

    # ---- loop ----------------------------------------------------------------------------------
    def request_stop(self, *_: Any) -> None:
        self._stop = True

    def done(self, idle_since: float) -> bool:
        last = self.last_update()
        if self._stop or (last is not None and self.updates >= last):
            return True
        return self.s.idle_exit_s is not None and time.monotonic() - idle_since > self.s.idle_exit_s

    def run(self) -> dict[str, Any]:
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        print(self.resume(), file=sys.stderr, flush=True)
        self.world.send(START, self.version, self.updates)  # the other ranks load this version from the store
        self.replay()
        idle_since = time.monotonic()
        gathered: list[LoadedBatch] = []
        try:
            while not self.done(idle_since):
                waited = time.monotonic()
                batch = self.reader.next_batch(timeout=1.0)
                self.timing["wait_s"] += time.monotonic() - waited
                if batch is None:
                    self.world.heartbeat()
                    continue
                idle_since = time.monotonic()
                gathered.append(batch)
                if self.update_full(gathered):
                    self.train_on(gathered)
                    gathered = []
            if gathered:
                self.train_on(gathered)  # read means consumed: a stop mid-gathering still trains them once
            if any(b not in self.skipped for b in self.pending_ids):
                self.checkpoint(final=True)  # a clean stop keeps every trained batch, and the moments
            self.finish_publishing()
            last = self.last_update()
            if last is not None and self.updates >= last:
                print(f"{LEARNER_FINISHED_LINE} {last} at v{self.version}", file=sys.stderr,
                      flush=True)
            self.world.send(STOP)
        finally:
            if self.publishing is not None and not self.publishing.done():
                wait([self.publishing])  # on a failure too: an announcement is never cut off
            self.background.shutdown()
            self.reader.close()
            self.publisher.close()
            self.announcer.close()
        return self.report()

    def report(self) -> dict[str, Any]:
        return {"version": self.version, "updates": self.updates, **{k: round(v, 2) for k, v in self.timing.items()},
                "published_mb": round(self.published_bytes / 1e6, 1), "reader": self.reader.metrics()}


def sft_end_reason(s: LearnerSettings, losses: list[float], matches: list[dict[str, list[float]]]) -> str:
    """Why the SFT phase ends after the updates of which `losses` and `matches` are the latest ("": it goes on): the
    mean of its latest losses reached --sft-until-loss, greedy decoding wrote --sft-until-match of the weakest source's
    demonstrations, or --sft-enough-match of all of them (the RL phase needs room to add to what SFT taught)."""
    why = ""
    if s.sft_until_loss is not None and len(losses) == SFT_LOSS_WINDOW and mean(losses) <= s.sft_until_loss:
        why = f"mean loss of the last {SFT_LOSS_WINDOW} {mean(losses):.4f} <= {s.sft_until_loss}"
    if len(matches) < SFT_MATCH_WINDOW:
        return why
    overall = overall_match(matches)
    if s.sft_enough_match is not None and overall is not None and overall >= s.sft_enough_match:
        why = (f"greedy decoding wrote {overall:.3f} of all the demonstrations in the last {SFT_MATCH_WINDOW} updates "
               f"before training on them, >= {s.sft_enough_match}")
    pooled = pooled_matches(matches)
    weakest = weakest_source(pooled)
    if s.sft_until_match is not None and weakest is not None and weakest[1] >= s.sft_until_match:
        source, share = weakest
        of = f"{source}'s demonstrations" + (f" (the weakest of {len(pooled)} sources)" if len(pooled) > 1 else "")
        why = (f"greedy decoding wrote {share:.3f} of {of} in the last {SFT_MATCH_WINDOW} updates before training on "
               f"them, >= {s.sft_until_match}")
    return why


def source_matches(metrics: dict[str, float]) -> dict[str, list[float]]:
    """An SFT update's greedy match per task source: source -> [sequences greedy decoding wrote, sequences]."""
    rows = {k[len(ROWS) + 1:]: n for k, n in metrics.items() if k.startswith(ROWS + "/")}
    return {source: [metrics.get(f"{GREEDY_MATCH}/{source}", 0.0) * n, n] for source, n in rows.items()}


def pooled_matches(window: list[dict[str, list[float]]]) -> dict[str, float]:
    """Each source's share of written demonstrations over the updates of `window`."""
    totals: dict[str, list[float]] = {}
    for update in window:
        for source, (written, n) in update.items():
            total = totals.setdefault(source, [0.0, 0.0])
            total[0], total[1] = total[0] + written, total[1] + n
    return {source: written / n for source, (written, n) in sorted(totals.items()) if n}


def overall_match(window: list[dict[str, list[float]]]) -> Optional[float]:
    """The share of all the demonstrations of `window` that greedy decoding wrote, every source together (None: none)."""
    written = sum(w for update in window for w, _ in update.values())
    n = sum(k for update in window for _, k in update.values())
    return written / n if n else None


def weakest_source(pooled: dict[str, float]) -> Optional[tuple[str, float]]:
    """The source of `pooled_matches` greedy decoding wrote the smallest share of, with that share (None: none)."""
    return min(pooled.items(), key=lambda item: item[1]) if pooled else None


def replay_line(replaying: list[CheckpointManifest]) -> str:
    """What a resume trains again: "; v5..v6 are weights-only: their batches train again", or, where some of
    them stored the optimizer state but their files do not verify, which ones."""
    if not replaying:
        return ""
    span = f"v{replaying[0].version}..v{replaying[-1].version}"
    broken = [f"v{m.version}" for m in replaying if m.has_moments]
    if not broken:
        return f"; {span} are weights-only: their batches train again"
    return (f"; {span} train their batches again: {', '.join(broken)} stored the optimizer state but "
            "their files do not verify, the others are weights-only")


def skip_reason(metrics: dict[str, float]) -> str:
    """Why an update trained nothing, from its counters: e.g. "no trainable tokens (stale/dropped=64)"."""
    if metrics.get("train/nonfinite_grad"):
        return "non-finite gradient"
    counted = [f"{k}={v:.0f}" for k, v in sorted(metrics.items())
               if v and k.startswith(("skipped/", "stale/dropped"))]
    return f"no trainable tokens ({', '.join(counted) or 'empty batch'})"


def main(argv: Optional[list[str]] = None) -> int:
    import json

    from learner.settings import from_args

    settings = from_args(argv)
    world = join(settings.device)
    try:
        if not world.leader:
            Follower(settings, Settings.from_env(), world).run()
            return 0
        report = LearnerService(settings, Settings.from_env(), world).run()
    except PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        world.close()
    print(json.dumps(report))
    return 0


__all__ = ["Follower", "LearnerService", "main"]
