"""Every training setting is reachable from the learner's command line, and a rebuild passes it on."""
from __future__ import annotations

import dataclasses

import pytest

from learner.service import train_config
from learner.settings import LearnerSettings, from_args, shaping_args
from learner.update import TrainConfig

PER_PHASE = {"algorithm", "lr"}  # set per phase (SFT warm start, then --algorithm) from --algorithm, --lr, --sft-lr
NOT_NEEDED = {"sft_min_reward"}  # checked below separately: SFT only


def test_every_train_config_field_has_a_flag_that_reaches_it() -> None:
    values = {"weight_decay": 0.01, "max_grad_norm": 0.5, "clip_eps": 0.3, "clip_eps_high": 0.28, "dual_clip": 4.0,
              "kl_coef": 0.05, "beta": 0.2, "loss_agg": "seq-mean-token-mean", "temperature": 0.7,
              "max_policy_lag": 3, "lag_mode": "downweight", "lag_decay": 0.25, "max_len": 512,
              "grad_accum": 2, "micro_batch_tokens": 4096, "grad_checkpointing": True, "cpu_bf16": True, "fsdp": True,
              "seed": 7,
              "sft_min_reward": 0.5}
    argv = ["--ns", "wired"]
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        argv += [flag] if value is True else [flag, str(value)]
    settings = from_args(argv)
    config = train_config(settings, "grpo")
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    assert fields - PER_PHASE == set(values)  # a new TrainConfig field must get a flag (and a line here)
    for name, value in values.items():
        if name != "sft_min_reward":
            assert getattr(config, name) == value, name
    assert train_config(settings, "sft").sft_min_reward == 0.5
    assert from_args(["--ns", "wired", *shaping_args(settings)]) == settings  # what a rebuild passes on


def test_every_learner_setting_has_a_flag() -> None:
    from learner.settings import parser

    flags = {a.dest for a in parser()._actions}
    fields = {f.name for f in dataclasses.fields(LearnerSettings)}
    assert fields - flags - {"idle_exit_s"} == set() and "idle_exit" in flags


def test_every_learner_flag_also_reads_its_environment_variable() -> None:
    import argparse

    from learner.settings import ENV_PREFIX, parser
    from schemas.errors import ConfigError

    env, want = {}, {}
    for action in parser({})._actions:
        flag = next((o for o in action.option_strings if o.startswith("--")), None)
        if flag in (None, "--help", "--ns"):
            continue
        name = ENV_PREFIX + flag[2:].replace("-", "_").upper()
        if isinstance(action, argparse._StoreTrueAction):
            env[name], want[action.dest] = "1", True
        elif isinstance(action, argparse._AppendAction):
            env[name], want[action.dest] = "run-a,run-b", ["run-a", "run-b"]
        elif action.choices:
            env[name], want[action.dest] = str(list(action.choices)[-1]), list(action.choices)[-1]
        elif action.type in (int, float):
            env[name], want[action.dest] = "7", action.type("7")
        else:
            env[name], want[action.dest] = "x:v1", "x:v1"
    parsed = vars(parser(env).parse_args(["--ns", "wired"]))
    assert {k: parsed[k] for k in want} == want
    assert {f.name for f in dataclasses.fields(LearnerSettings)} - {"ns", "idle_exit_s"} <= set(want) and "idle_exit" in want
    assert vars(parser(env).parse_args(["--ns", "wired", "--lr", "0.5"]))["lr"] == 0.5  # a flag given wins
    settings = from_args(["--ns", "wired"], env={ENV_PREFIX + "LR": "3e-4", ENV_PREFIX + "CPU_BF16": "yes",
                                                ENV_PREFIX + "LOSS_AGG": "seq-mean-token-sum"})
    assert (settings.lr, settings.cpu_bf16, settings.loss_agg) == (3e-4, True, "seq-mean-token-sum")
    for bad in ({ENV_PREFIX + "LR": "fast"}, {ENV_PREFIX + "LAG_MODE": "sometimes"}, {ENV_PREFIX + "CPU_BF16": "maybe"}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            from_args(["--ns", "wired"], env=bad)


def test_a_learner_with_default_settings_trains_long_trajectories_in_bounded_micro_batches() -> None:
    """64 reasoning-gym trajectories of ~2k tokens made one 130k-token micro-batch by default: 15.5 GB, and the
    supervisor restarted the killed learner into the same batch. By default each part now holds 8192 tokens."""
    import uuid

    from learner.model import build_policy
    from learner.update import Trainer
    from schemas.packing import pack_floats, pack_ids
    from schemas.records import Trajectory, TrajectoryTurn

    def long_trajectory() -> Trajectory:
        turn = TrajectoryTurn(turn=0, policy_version=0, obs_text="", obs_tokens=pack_ids([]), text="",
                              tokens=pack_ids([40] * 32), logprobs=pack_floats([-1.0] * 32), finish_reason="stop")
        return Trajectory(
            trajectory_id=uuid.uuid4().hex, episode_id=uuid.uuid4().hex, group_id="g", task_id="t",
            domain="rg/leg_counting", run="test", status="completed", task_spec="", prompt_text="",
            prompt_tokens=pack_ids([50] * 2000), turns=(turn,), reward=1.0, reward_components={}, reward_fn="rg",
            reward_version="1", advantage=1.0, group_reward_mean=0.0, group_reward_std=0.0, source_topic="t",
            source_offsets=(), started_ts=0, ended_ts=0)

    settings = from_args(["--ns", "defaults"])
    trainer = Trainer(build_policy(layers=1, width=32, heads=2, seed=0), train_config(settings, "grpo"))
    batches, _ = trainer.micro_batches([(long_trajectory(), 1.0) for _ in range(64)])
    assert sum(b.input_ids.shape[0] for b in batches) == 64
    assert max(b.input_ids.numel() for b in batches) <= settings.micro_batch_tokens == 8192


def test_a_resume_says_which_versions_train_again_and_why() -> None:
    """A version that stored the optimizer state but does not verify is trained again too: the resume line
    names it, where it used to call every version after the resume point weights-only."""
    from learner.checkpoint_files import MODEL_FILE, MOMENT_FILES
    from learner.service import replay_line
    from schemas.manifests import CheckpointManifest, FileEntry

    def manifest(version: int, *names: str) -> CheckpointManifest:
        return CheckpointManifest(run="r", version=version, step=version, algorithm="grpo",
                                  files={n: FileEntry("0" * 64, 1) for n in names}, offsets={}, batch_ids=[])

    assert replay_line([]) == ""
    assert replay_line([manifest(5, MODEL_FILE), manifest(6, MODEL_FILE)]) == (
        "; v5..v6 are weights-only: their batches train again")
    line = replay_line([manifest(3, MODEL_FILE), manifest(4, MODEL_FILE, *MOMENT_FILES), manifest(5, MODEL_FILE)])
    assert line == ("; v3..v5 train their batches again: v4 stored the optimizer state but their files do not "
                    "verify, the others are weights-only")


@pytest.mark.parametrize(("argv", "fix"), [
    (["--sft-updates", "10", "--sft-until-match", "1.5"], "give 0 < F <= 1"),
    (["--sft-until-match", "0.6"], "--sft-until-match needs --sft-updates"),
    (["--sft-updates", "10", "--sft-enough-match", "0"], "give 0 < P <= 1"),
    (["--sft-enough-match", "0.55"], "--sft-enough-match needs --sft-updates"),
    (["--rl-updates", "5", "--max-updates", "20"], "not both"),
    (["--rl-updates", "-1"], "--rl-updates must be >= 0"),
])
def test_an_sft_phase_ended_by_its_greedy_match_and_an_rl_phase_counted_from_it_refuse_what_cannot_work(
        argv: list[str], fix: str) -> None:
    from schemas.errors import ConfigError

    with pytest.raises(ConfigError, match=fix):
        from_args(["--ns", "wired", *argv], env={})
    assert from_args(["--ns", "wired", "--sft-updates", "10", "--sft-until-match", "1", "--rl-updates", "0"],
                     env={}).rl_updates == 0


def test_the_sft_phase_is_judged_on_its_weakest_source_pooled_over_the_window() -> None:
    from learner.service import pooled_matches, source_matches, weakest_source

    updates = [source_matches({"sft/greedy_match/reverse-3": 1.0, "sft/greedy_rows/reverse-3": 16.0,
                               "sft/greedy_match/reverse-6": share, "sft/greedy_rows/reverse-6": rows})
               for share, rows in ((0.0, 10.0), (0.5, 30.0))]
    assert pooled_matches(updates) == {"reverse-3": 1.0, "reverse-6": 15 / 40}  # by sequence, not a mean of shares
    assert weakest_source(pooled_matches(updates)) == ("reverse-6", 15 / 40)
    assert weakest_source(pooled_matches([])) is None
    assert weakest_source(pooled_matches([source_matches({"loss/sft": 1.0})])) is None


def test_the_sft_phase_also_ends_once_greedy_decoding_writes_enough_of_all_the_demonstrations() -> None:
    """--sft-enough-match: the short words are solved while the 6-letter ones are still under --sft-until-match;
    the phase ends once the share of all the window's demonstrations reaches the bar, so that the RL phase has room
    to add (a phase that waited for the 6-letter words ended at 0.785 or more held-out, and missed the RL gain)."""
    from learner.service import sft_end_reason, source_matches

    def window(short: float, long: float) -> list[dict[str, list[float]]]:
        metrics = {"sft/greedy_match/reverse-3": short, "sft/greedy_rows/reverse-3": 16.0,
                   "sft/greedy_match/reverse-6": long, "sft/greedy_rows/reverse-6": 32.0}
        return [source_matches(metrics) for _ in range(5)]

    both = from_args(["--ns", "wired", "--sft-updates", "160", "--sft-until-match", "0.2", "--sft-enough-match",
                      "0.55"], env={})
    assert sft_end_reason(both, [], window(1.0, 0.25)) == (
        "greedy decoding wrote 0.250 of reverse-6's demonstrations (the weakest of 2 sources) in the last 5 updates "
        "before training on them, >= 0.2")  # the weakest source decides where both would end the phase
    assert sft_end_reason(both, [], window(1.0, 0.375)).startswith("greedy decoding wrote 0.375 of reverse-6's")
    below = from_args(["--ns", "wired", "--sft-updates", "160", "--sft-until-match", "0.5", "--sft-enough-match",
                       "0.55"], env={})
    assert sft_end_reason(below, [], window(0.9, 0.39)) == (  # (16 * 0.9 + 32 * 0.39) / 48 = 0.56
        "greedy decoding wrote 0.560 of all the demonstrations in the last 5 updates before training on them, >= 0.55")
    assert sft_end_reason(below, [], window(0.9, 0.35)) == ""  # 0.533 of all, 0.35 of the weakest: it goes on
    assert sft_end_reason(below, [], window(1.0, 1.0)[:4]) == ""  # not before a whole window
    alone = from_args(["--ns", "wired", "--sft-updates", "160", "--sft-enough-match", "0.55"], env={})
    assert sft_end_reason(alone, [], window(0.9, 0.39)).startswith("greedy decoding wrote 0.560 of all the")
    assert sft_end_reason(from_args(["--ns", "wired", "--sft-updates", "160"], env={}), [0.1] * 5,
                          window(1.0, 1.0)) == ""  # no bar given: the phase takes --sft-updates
