"""Settings of the learner service, from the command line; bad combinations are refused with the fix."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

from infra.models import resolve_model
from infra.settings import add_ns_argument, cache_dir
from learner.losses import LOSS_AGGS
from schemas.errors import ConfigError
from schemas.topics import Topics

# Padded tokens per micro-batch unless --micro-batch-tokens says otherwise. One GRPO batch of 64 reasoning-gym
# trajectories (~2k byte-level tokens each) in one piece took the small model 15.5 GB and 72 s here, and the
# learner was killed and restarted into it again; in parts of 8192 tokens 2.5 GB and 42 s. The demo's own
# batches (a few dozen tokens a row) are split into a handful of parts at most.
DEFAULT_MICRO_BATCH_TOKENS = 8192
SFT_LOSS_WINDOW = 5  # --sft-until-loss compares the mean SFT loss of this many latest updates
SFT_MATCH_WINDOW = 5  # --sft-until-match: each task source's greedy match over this many latest SFT updates


@dataclass(frozen=True)
class LearnerSettings:
    ns: str
    algorithm: str = "grpo"
    sft_updates: int = 0  # warm start: this many SFT updates before `algorithm`
    # End the SFT phase early once the mean SFT loss of the last SFT_LOSS_WINDOW updates is at or under this
    # (None: always sft_updates); sft_updates stays the most it takes
    sft_until_loss: float | None = None
    # ... or once greedy decoding wrote this share of every task source's demonstrations of the last SFT_MATCH_WINDOW
    # updates token for token before training on them (an estimate of greedy success on unseen tasks, per source;
    # None: not judged)
    sft_until_match: float | None = None
    # ... or once it wrote this share of all the demonstrations of those updates, every source together: the policy
    # already solves so much that an RL phase after it has little room to add (None: not judged)
    sft_enough_match: float | None = None
    lr: float = 1e-4
    sft_lr: float | None = None  # learning rate of the SFT warm start (None: lr)
    warmup_updates: int = 0  # linear learning-rate warmup over the run's first N updates
    updates_per_checkpoint: int = 2
    sft_updates_per_checkpoint: int | None = None  # during the SFT phase (None: updates_per_checkpoint)
    rl_batches_per_update: int = 1  # shards merged into one policy-gradient update
    max_updates: int | None = None
    rl_updates: int | None = None  # stop this many updates after the SFT phase ends (an early end or not)
    idle_exit_s: float | None = None  # stop after this long without data (None: wait forever)
    max_policy_lag: int = 4
    lag_mode: str = "drop"
    temperature: float = 1.0
    kl_coef: float = 0.0
    clip_eps: float = 0.2
    dual_clip: float | None = 3.0
    reference_version: int = 0  # the checkpoint KL and DPO anchor to, loaded from the store after a restart
    grad_accum: int = 1
    micro_batch_tokens: int = DEFAULT_MICRO_BATCH_TOKENS
    max_len: int = 2048
    layers: int = 4
    width: int = 256
    model_dir: str | None = None
    seed: int = 0
    prefetch: int = 2
    cache_dir: str = str(cache_dir() / "shards")
    cache_bytes: int = 2 << 30
    grad_checkpointing: bool = False
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    clip_eps_high: float | None = None  # None: symmetric clipping
    beta: float = 0.1  # DPO temperature
    loss_agg: str = "token-mean"
    lag_decay: float = 0.5  # --lag-mode downweight: weight = lag_decay ** (lag - max_policy_lag)
    sft_min_reward: float = 1.0  # a scored trajectory SFT imitates needs at least this reward
    cpu_bf16: bool = False
    fsdp: bool = False  # under torchrun: FSDP2 shards weights, gradients and Adam moments over the ranks
    device: str = "auto"  # auto: cuda when available, else cpu
    init: str | None = None  # "RUN:vK": start from run RUN's checkpoint K; its trajectories' lag counts from there
    init_moments: bool = False  # with init: carry that checkpoint's Adam moments too (else a fresh optimizer)
    replica_of: tuple[str, ...] = ()  # runs whose versions are this run's own (a rebuild of them)
    keep_last: int = 0  # retention: keep the files of the last K versions (0: keep every version)
    keep_every: int = 0  # ... and of every N-th one (0: none besides v0 and the reference)
    foreground_checkpoints: bool = False  # store+announce+commit before the next update (default: overlapping it)
    broadcast_bf16: bool = False  # each version also carries bfloat16 weights, what following rollout workers load
    moments_every: int = 1  # the optimizer's moments in every K-th version (and v0 and a clean stop's); others weights-only

    def __post_init__(self) -> None:
        Topics(self.ns)
        if self.init is not None:
            parse_init(self.init, self.ns)
        checks = [
            (not self.init_moments or self.init is not None, "--init-moments carries the moments of --init's "
                                                             "checkpoint: give --init RUN:vK too"),
            (self.updates_per_checkpoint >= 1, "--updates-per-checkpoint must be >= 1"),
            (self.sft_updates_per_checkpoint is None or self.sft_updates_per_checkpoint >= 1,
             "--sft-updates-per-checkpoint must be >= 1 (or omit it)"),
            (self.rl_batches_per_update >= 1, "--rl-batches-per-update must be >= 1"),
            (self.max_updates is None or self.max_updates >= 1, "--max-updates must be >= 1 (or omit it)"),
            (self.sft_updates >= 0, "--sft-updates must be >= 0"),
            (self.sft_until_loss is None or self.sft_until_loss > 0, "--sft-until-loss must be > 0 (or omit it)"),
            (self.sft_until_loss is None or self.sft_updates > 0, "--sft-until-loss needs --sft-updates (the most "
                                                                  "the SFT phase takes)"),
            (self.sft_until_match is None or 0 < self.sft_until_match <= 1,
             "--sft-until-match is a share of the demonstrations: give 0 < F <= 1 (or omit it)"),
            (self.sft_until_match is None or self.sft_updates > 0, "--sft-until-match needs --sft-updates (the most "
                                                                   "the SFT phase takes)"),
            (self.sft_enough_match is None or 0 < self.sft_enough_match <= 1,
             "--sft-enough-match is a share of the demonstrations: give 0 < P <= 1 (or omit it)"),
            (self.sft_enough_match is None or self.sft_updates > 0, "--sft-enough-match needs --sft-updates (the most "
                                                                    "the SFT phase takes)"),
            (self.rl_updates is None or self.rl_updates >= 0, "--rl-updates must be >= 0 (0: stop when the SFT phase "
                                                               "ends; or omit it)"),
            (self.rl_updates is None or self.max_updates is None,
             "give --max-updates (updates in all) or --rl-updates (updates after the SFT phase), not both"),
            (self.algorithm in ("grpo", "ppo", "sft", "dpo"), f"--algorithm {self.algorithm!r}: grpo, ppo, sft or dpo"),
            (self.lr > 0, "--lr must be > 0"),
            (self.sft_lr is None or self.sft_lr > 0, "--sft-lr must be > 0 (or omit it to use --lr)"),
            (self.warmup_updates >= 0, "--warmup-updates must be >= 0"),
            (self.dual_clip is None or self.dual_clip > 1, "--dual-clip must be > 1 (e.g. 3), or 0 to turn it off"),
            (self.reference_version >= 0, "--reference-version must be >= 0"),
            (self.keep_last == 0 or self.keep_last >= 2, "--keep-last must be 0 (keep every version) or >= 2: a "
                                                          "broken newest version falls back to the one before"),
            (self.keep_every >= 0, "--keep-every must be >= 0"),
            (self.moments_every >= 1, "--moments-every must be >= 1 (1: every version carries the optimizer state)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    @property
    def init_from(self) -> tuple[str, int] | None:
        return parse_init(self.init, self.ns) if self.init is not None else None

    @property
    def topics(self) -> Topics:
        return Topics(self.ns)

    @property
    def group(self) -> str:
        return f"{self.ns}.learner"


def parse_init(value: str, ns: str) -> tuple[str, int]:
    """ "RUN:vK" (or "RUN:K") -> (RUN, K)."""
    run, sep, version = value.rpartition(":")
    version = version[1:] if version.startswith("v") else version
    if not sep or not run or not version.isdigit():
        raise ConfigError(f"--init {value!r}: give a run and a checkpoint version, e.g. --init prod:v0")
    if run == ns:
        raise ConfigError(f"--init {value!r}: a run resumes from its own checkpoints by itself; name another run")
    return run, int(version)


ENV_PREFIX = "TRAJPIPE_LEARNER_"  # TRAJPIPE_LEARNER_<FLAG>: every flag's default, e.g. TRAJPIPE_LEARNER_LR=3e-4
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def parser(env: Mapping[str, str] = os.environ) -> argparse.ArgumentParser:
    """The CLI; every flag also reads TRAJPIPE_LEARNER_<FLAG> from `env` (a flag given wins)."""
    p = argparse.ArgumentParser(prog="python -m learner", description="Train on scored batches, publish checkpoints. "
                                "Every flag's default can be set as TRAJPIPE_LEARNER_<FLAG> (e.g. "
                                "TRAJPIPE_LEARNER_MAX_POLICY_LAG=2); a flag given on the command line wins.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_ns_argument(p, env=env)
    p.add_argument("--algorithm", default="grpo")
    p.add_argument("--sft-updates", type=int, default=0, help="SFT warm-start updates before --algorithm")
    p.add_argument("--sft-until-loss", type=float, default=None, metavar="L",
                   help=f"end the SFT phase early once the mean SFT loss of its last {SFT_LOSS_WINDOW} updates is at or "
                        "under L (--sft-updates stays the most it takes)")
    p.add_argument("--sft-until-match", type=float, default=None, metavar="F",
                   help=f"end the SFT phase early once greedy decoding wrote a share F of every task source's "
                        f"demonstrations of its last {SFT_MATCH_WINDOW} updates token for token before training on them: "
                        "greedy success on tasks it has not seen, for exact-match tasks, judged on the weakest source "
                        "(--sft-updates stays the most it takes)")
    p.add_argument("--sft-enough-match", type=float, default=None, metavar="P",
                   help=f"end the SFT phase early once greedy decoding wrote a share P of all the demonstrations of its "
                        f"last {SFT_MATCH_WINDOW} updates, every source together: the policy solves so much already that "
                        "an RL phase would have little left to add (--sft-updates stays the most it takes)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--sft-lr", type=float, default=None, help="learning rate of the SFT warm start (default: --lr)")
    p.add_argument("--warmup-updates", type=int, default=0, metavar="N",
                   help="raise the learning rate linearly over the run's first N updates (a fresh Adam's first steps "
                        "move every weight by about the learning rate)")
    p.add_argument("--updates-per-checkpoint", type=int, default=2)
    p.add_argument("--rl-batches-per-update", type=int, default=1,
                   help="shards merged into one GRPO/PPO/DPO update (a less noisy policy gradient)")
    p.add_argument("--sft-updates-per-checkpoint", type=int, default=None,
                   help="checkpoint interval of the SFT phase (default: --updates-per-checkpoint); its end always is one")
    p.add_argument("--max-updates", type=int, default=None)
    p.add_argument("--rl-updates", type=int, default=None, metavar="N",
                   help="stop N updates after the SFT phase ends, however early it ends (instead of --max-updates)")
    p.add_argument("--idle-exit", type=float, default=None, help="stop after S seconds without a batch")
    p.add_argument("--max-policy-lag", type=int, default=4)
    p.add_argument("--lag-mode", default="drop", choices=["drop", "downweight"])
    p.add_argument("--temperature", type=float, default=1.0, help="the rollout temperature (for the ratios)")
    p.add_argument("--kl-coef", type=float, default=0.0)
    p.add_argument("--clip-eps", type=float, default=0.2)
    p.add_argument("--dual-clip", type=float, default=3.0,
                   help="bound a negative-advantage token's loss at C*|A| however stale its ratio (0: off)")
    p.add_argument("--reference-version", type=int, default=0,
                   help="checkpoint version the KL / DPO reference is (read from the store after a restart)")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--micro-batch-tokens", type=int, default=DEFAULT_MICRO_BATCH_TOKENS,
                   help="split micro-batches until each holds at most this many padded tokens (0: off): bounds "
                        "the learner's memory; a pretrained model's logits take ~vocabulary x 12 bytes a token")
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--model-dir", "--model", dest="model_dir", default=None,
                   help="a local Hugging Face checkpoint dir, or a converted pretrained model by name (smollm2-135m)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--cache-dir", default=str(cache_dir() / "shards"))
    p.add_argument("--cache-bytes", type=int, default=2 << 30, help="the shard cache's size on disk")
    p.add_argument("--grad-checkpointing", action="store_true")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping norm")
    p.add_argument("--clip-eps-high", type=float, default=None, help="upper PPO clip (default: --clip-eps)")
    p.add_argument("--beta", type=float, default=0.1, help="DPO temperature")
    p.add_argument("--loss-agg", default="token-mean", choices=LOSS_AGGS, help="how token losses are averaged")
    p.add_argument("--lag-decay", type=float, default=0.5,
                   help="--lag-mode downweight: weight = lag_decay ** (lag - max_policy_lag)")
    p.add_argument("--sft-min-reward", type=float, default=1.0, help="reward a trajectory needs for SFT")
    p.add_argument("--cpu-bf16", action="store_true", help="bfloat16 autocast on the CPU")
    p.add_argument("--foreground-checkpoints", action="store_true",
                   help="write, store, announce and commit each checkpoint before the next update starts "
                        "(default: its weights and moments are copied at once, then written, stored and announced "
                        "by a background thread while the next update trains; at most one in flight, same order, "
                        "same resume point)")
    p.add_argument("--broadcast-bf16", action="store_true",
                   help="each version also carries its weights rounded to bfloat16 (model.bf16.safetensors, half "
                        "the float32 file): rollout workers following the learner download and generate with "
                        "those, so every worker moves half the bytes per version, and the learner stores 1.5x the "
                        "weights; the behaviour log-probs then come from the rounded weights (the importance "
                        "ratio absorbs it). Eval, export and a resume read the float32 weights")
    p.add_argument("--moments-every", type=int, default=1, metavar="K",
                   help="store the optimizer's moments (twice the weights' size with Adam) in every K-th version "
                        "only, and in v0 and the version a clean stop writes; the versions between are weights-only, "
                        "all rollout workers need. A restart resumes from the newest version with moments and "
                        "trains the later announced versions' batches again, in the order they were read, to reach "
                        "the newest (the same weights: on CPU bit for bit). --fsdp stores them in every version")
    p.add_argument("--fsdp", action="store_true",
                   help="under torchrun: shard weights, gradients and Adam moments over the ranks (FSDP2), for a "
                        "model that does not fit one device; checkpoints stay whole")
    p.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda or cuda:N")
    p.add_argument("--init", default=None, metavar="RUN:vK",
                   help="start from run RUN's checkpoint K (retraining from its history): the policy lag of RUN's "
                        "trajectories is measured from there, by the versions that generated them")
    p.add_argument("--init-moments", action="store_true",
                   help="with --init: also carry that checkpoint's Adam moments (under this run's --lr), as the "
                        "demo carries them from SFT into RL; default: a fresh optimizer")
    p.add_argument("--keep-last", type=int, default=0, metavar="K",
                   help="retention: delete the weights and optimizer of versions older than the last K (0: keep all); "
                        "v0, the reference, every --keep-every-th and each manifest stay")
    p.add_argument("--keep-every", type=int, default=0, metavar="N", help="with --keep-last: also keep every N-th version")
    p.add_argument("--replica-of", action="append", default=[], metavar="RUN",
                   help="the data's versions of run RUN are this run's own (learner.rebuild sets it)")
    _env_defaults(p, env)
    return p


def _env_defaults(p: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """Each flag's default from TRAJPIPE_LEARNER_<FLAG> where set; a bad value is a ConfigError naming it."""
    for action in p._actions:
        flag = next((o for o in action.option_strings if o.startswith("--")), None)
        if flag is None or flag == "--help" or action.dest == "ns":
            continue
        name = ENV_PREFIX + flag[2:].replace("-", "_").upper()
        if name not in env:
            continue
        text = env[name].strip()
        try:
            if isinstance(action, argparse._StoreTrueAction):
                if text.lower() not in TRUE + FALSE:
                    raise ValueError("expected 1/0, true/false, yes/no")
                value: Any = text.lower() in TRUE
            elif isinstance(action, argparse._AppendAction):
                value = [part for part in text.split(",") if part]
            else:
                value = action.type(text) if callable(action.type) else text
                if action.choices is not None and value not in action.choices:
                    raise ValueError(f"choose one of {', '.join(map(str, action.choices))}")
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{name}={env[name]!r} is no value for {flag}: {exc}") from None
        action.default = value


def from_args(argv: list[str] | None = None, env: Optional[Mapping[str, str]] = None) -> LearnerSettings:
    a = parser(os.environ if env is None else env).parse_args(argv)
    if not a.ns:
        raise ConfigError("--ns is required (or set TRAJPIPE_NS)")
    return LearnerSettings(
        ns=a.ns, algorithm=a.algorithm, sft_updates=a.sft_updates, sft_until_loss=a.sft_until_loss,
        sft_until_match=a.sft_until_match, sft_enough_match=a.sft_enough_match, lr=a.lr,
        sft_lr=a.sft_lr,
        warmup_updates=a.warmup_updates,
        updates_per_checkpoint=a.updates_per_checkpoint, sft_updates_per_checkpoint=a.sft_updates_per_checkpoint,
        rl_batches_per_update=a.rl_batches_per_update,
        max_updates=a.max_updates, rl_updates=a.rl_updates, idle_exit_s=a.idle_exit,
        max_policy_lag=a.max_policy_lag, lag_mode=a.lag_mode, temperature=a.temperature, kl_coef=a.kl_coef,
        clip_eps=a.clip_eps, dual_clip=a.dual_clip or None, reference_version=a.reference_version,
        grad_accum=a.grad_accum, micro_batch_tokens=a.micro_batch_tokens, max_len=a.max_len, layers=a.layers,
        width=a.width,
        model_dir=resolve_model(a.model_dir) if a.model_dir else None, seed=a.seed, prefetch=a.prefetch, cache_dir=str(Path(a.cache_dir)),
        cache_bytes=a.cache_bytes, grad_checkpointing=a.grad_checkpointing, weight_decay=a.weight_decay, max_grad_norm=a.max_grad_norm,
        clip_eps_high=a.clip_eps_high, beta=a.beta, loss_agg=a.loss_agg, lag_decay=a.lag_decay,
        sft_min_reward=a.sft_min_reward, cpu_bf16=a.cpu_bf16, fsdp=a.fsdp, device=a.device, init=a.init,
        init_moments=a.init_moments,
        replica_of=tuple(a.replica_of), keep_last=a.keep_last, keep_every=a.keep_every,
        foreground_checkpoints=a.foreground_checkpoints, moments_every=a.moments_every,
        broadcast_bf16=a.broadcast_bf16,
    )


def shaping_args(s: LearnerSettings) -> list[str]:
    """The options that decide the weights a run makes from its batches, as `python -m learner` takes them:
    recorded in every checkpoint, so `learner.rebuild` can train the same lineage again."""
    args = ["--algorithm", s.algorithm, "--sft-updates", str(s.sft_updates), "--lr", repr(s.lr),
            "--updates-per-checkpoint", str(s.updates_per_checkpoint),
            "--rl-batches-per-update", str(s.rl_batches_per_update), "--max-policy-lag", str(s.max_policy_lag),
            "--lag-mode", s.lag_mode, "--temperature", repr(s.temperature), "--kl-coef", repr(s.kl_coef),
            "--clip-eps", repr(s.clip_eps), "--dual-clip", repr(s.dual_clip or 0.0),
            "--reference-version", str(s.reference_version), "--grad-accum", str(s.grad_accum),
            "--max-len", str(s.max_len), "--seed", str(s.seed)]
    args += ["--micro-batch-tokens", str(s.micro_batch_tokens)]  # the same gradient, summed in another order
    if s.sft_lr is not None:
        args += ["--sft-lr", repr(s.sft_lr)]
    if s.sft_until_loss is not None:
        args += ["--sft-until-loss", repr(s.sft_until_loss)]
    if s.sft_until_match is not None:
        args += ["--sft-until-match", repr(s.sft_until_match)]
    if s.sft_enough_match is not None:
        args += ["--sft-enough-match", repr(s.sft_enough_match)]
    if s.warmup_updates:
        args += ["--warmup-updates", str(s.warmup_updates)]
    if s.sft_updates_per_checkpoint is not None:
        args += ["--sft-updates-per-checkpoint", str(s.sft_updates_per_checkpoint)]
    args += ["--model", s.model_dir] if s.model_dir else ["--layers", str(s.layers), "--width", str(s.width)]
    if s.grad_checkpointing:
        args.append("--grad-checkpointing")
    args += ["--weight-decay", repr(s.weight_decay), "--max-grad-norm", repr(s.max_grad_norm), "--beta", repr(s.beta),
             "--loss-agg", s.loss_agg, "--lag-decay", repr(s.lag_decay), "--sft-min-reward", repr(s.sft_min_reward)]
    if s.clip_eps_high is not None:
        args += ["--clip-eps-high", repr(s.clip_eps_high)]
    if s.cpu_bf16:
        args.append("--cpu-bf16")
    if s.fsdp:  # the same weights as without it (within float tolerance); one process ignores it
        args.append("--fsdp")
    if s.init is not None:
        args += ["--init", s.init]
    if s.init_moments:
        args.append("--init-moments")
    for run in s.replica_of:
        args += ["--replica-of", run]
    return args
