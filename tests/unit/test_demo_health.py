"""The demo's verdict: held-out success with Wilson intervals, the versions on its learning curve."""
from __future__ import annotations

import argparse
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from infra.demo import (PRESETS, Run, apply_preset, curve_versions, free_port, goals, healthy, learning_section, main, parser,
                        plan, sft_phase_end, sft_version)
from learner.eval import Evaluation, wilson
from schemas.errors import PipelineError


def test_wilson_intervals_match_the_formula_and_stay_in_bounds() -> None:
    low, high = wilson(38, 256)
    p, n, z = 38 / 256, 256, 1.959964
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    assert (low, high) == pytest.approx((centre - half, centre + half))
    assert wilson(0, 256)[0] == 0.0 and 0.0 < wilson(0, 256)[1] < 0.02 and wilson(256, 256)[1] == 1.0


def test_the_curve_covers_both_phases_and_ends_at_the_final_version() -> None:
    assert curve_versions(final=63, sft=13, points=4) == [0, 4, 9, 13, 25, 38, 51, 63]
    assert curve_versions(final=5, sft=13, points=4) == [0, 2, 3, 5]   # a run stopped inside SFT
    args = parser().parse_args(["--sft-updates", "260", "--sft-updates-per-checkpoint", "20"])
    assert sft_version(args) == 13


def _result(version: int, mode: str, wins: int, n: int = 256) -> dict[str, object]:
    low, high = wilson(wins, n)
    return {"version": version, "mode": mode, "success": wins / n, "ci_low": low, "ci_high": high}


def _args() -> argparse.Namespace:
    return parser().parse_args(["--sft-updates", "40", "--sft-updates-per-checkpoint", "20", "--rl-updates", "4"])


def test_a_run_is_healthy_when_held_out_success_rose_significantly() -> None:
    results = [_result(0, m, 0) for m in ("greedy", "sampled")] + [_result(2, m, 100) for m in ("greedy", "sampled")]
    results += [_result(6, "greedy", 110), _result(6, "sampled", 95)]
    run = argparse.Namespace(services=[])
    assert healthy(run, results, "learner finished", _args()) == []  # type: ignore[arg-type]


def test_no_significant_gain_or_an_rl_phase_that_hurt_is_unhealthy() -> None:
    flat = [_result(v, m, 3) for v in (0, 2, 6) for m in ("greedy", "sampled")]
    run = argparse.Namespace(services=[])
    assert any("not significantly above" in p for p in healthy(run, flat, "learner finished", _args()))  # type: ignore[arg-type]
    hurt = [_result(0, m, 0) for m in ("greedy", "sampled")] + [_result(2, m, 150) for m in ("greedy", "sampled")]
    hurt += [_result(6, "greedy", 90), _result(6, "sampled", 148)]
    problems = healthy(run, hurt, "learner finished", _args())  # type: ignore[arg-type]
    assert problems == ["the RL phase lowered greedy held-out success significantly below the post-SFT policy's"]
    assert "run ended by time limit" in healthy(run, hurt, "time limit", _args())  # type: ignore[arg-type]


def test_an_sft_phase_ended_early_by_its_loss_target_is_judged_from_the_version_that_ended_it() -> None:
    """--sft-until-loss ended the SFT phase at v1 where --sft-updates alone would have ended it at v2: the RL gain
    is measured from v1, the last version an SFT update made."""
    from infra.demo import post_sft_version
    from schemas.manifests import CheckpointManifest

    args = parser().parse_args(["--sft-updates", "40", "--sft-updates-per-checkpoint", "20", "--sft-until-loss",
                                "0.5"])
    learner = next(s for s in plan(args, "demo") if s.name == "learner")
    assert learner.argv[learner.argv.index("--sft-until-loss") + 1] == "0.5"
    manifests = {v: CheckpointManifest(run="demo", version=v, step=v, algorithm="sft" if v <= 1 else "grpo", files={},
                                       offsets={}, batch_ids=[], model_config={}, created_ts=v) for v in range(4)}
    assert post_sft_version(manifests, args) == 1
    phase = {0: "initial", 1: "sft", 2: "rl", 3: "rl"}
    results = [{**_result(v, "greedy", wins), "phase": phase[v]} for v, wins in ((0, 0), (1, 100), (2, 130), (3, 160))]
    assert goals(results, args)[0].startswith("greedy: final held-out success 0.625 (goal 0.8: NOT met), RL gain over "
                                              "post-SFT +0.234")  # from v1 (0.391); from v2 it would be +0.117


def test_the_demo_ends_its_sft_phase_by_the_greedy_match_and_counts_the_rl_phase_from_there() -> None:
    from infra.demo import RL_UPDATES, SFT_ENOUGH_MATCH, SFT_MOST, SFT_UNTIL_MATCH, SFT_UPDATES

    def learner_flags(argv: list[str]) -> dict[str, str]:
        learner = next(s for s in plan(parser().parse_args(argv), "ns") if s.name == "learner").argv
        return {flag: learner[i + 1] for i, flag in enumerate(learner) if flag.startswith("--") and i + 1 < len(learner)}

    flags = learner_flags([])
    assert flags["--sft-updates"] == str(SFT_MOST) and flags["--sft-until-match"] == str(SFT_UNTIL_MATCH)
    assert flags["--sft-enough-match"] == str(SFT_ENOUGH_MATCH)
    assert flags["--rl-updates"] == str(RL_UPDATES) and "--max-updates" not in flags  # however early SFT ends
    assert flags["--warmup-updates"] == str(SFT_UPDATES // 10)  # a tenth of where it was calibrated, not of the most
    demos = next(s for s in plan(parser().parse_args([]), "ns") if s.name == "demonstrations").argv
    assert demos[demos.index("--demonstrations") + 1] == str(SFT_MOST * 64)  # enough for the longest phase
    fixed = learner_flags(["--sft-until-match", "0", "--sft-enough-match", "0", "--sft-updates", "200"])
    assert "--sft-until-match" not in fixed and "--sft-enough-match" not in fixed and fixed["--warmup-updates"] == "20"
    enough_alone = learner_flags(["--sft-until-match", "0", "--sft-updates", "200"])
    assert "--sft-until-match" not in enough_alone and enough_alone["--warmup-updates"] == str(SFT_UPDATES // 10)


def test_rollout_workers_start_with_the_rl_phase_and_at_once_without_an_sft_phase() -> None:
    def starts(argv: list[str]) -> dict[str, str]:
        args = apply_preset(parser().parse_args(argv), argv)
        return {s.name: s.when for s in plan(args, "ns") if s.name.startswith("producer")}

    assert starts([]) == {"producer-0": "rl"}  # after the SFT phase's demonstrations trained
    assert PRESETS["smollm2"]["sft_updates"] == 0
    assert starts(["--preset", "smollm2"]) == {"producer-0": "start"}  # else nothing would ever start them


def test_a_busy_monitor_port_is_replaced_by_a_free_one() -> None:
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        other = free_port(taken)
        assert other != taken and free_port(other) == other


def test_a_pretrained_run_without_sft_is_judged_by_its_gain_over_v0_in_time() -> None:
    args = apply_preset(parser().parse_args(["--preset", "smollm2"]), ["--preset", "smollm2"])
    results = [{**_result(0, "greedy", 38, 128), "seconds": 0.0}, {**_result(50, "greedy", 94, 128), "seconds": 2177.0}]
    assert goals(results, args) == ["greedy: held-out success 0.297 -> 0.734, gain +0.438 in 36 min of training "
                                    "(goal +0.1 within 45 min: met)"]
    slow = [results[0], {**results[1], "seconds": 50 * 60.0}]
    assert goals(slow, args)[0].endswith("NOT met)")


def test_the_demo_passes_its_curriculum_to_the_rollout_workers_only() -> None:
    argv = ["--sources", "rg:*", "--curriculum", "4"]
    args = apply_preset(parser().parse_args(argv), argv)
    for worker in [s for s in plan(args, "ns") if s.name.startswith("producer")]:
        assert worker.argv[worker.argv.index("--sources") + 1] == "rg:*"
        assert worker.argv[worker.argv.index("--curriculum") + 1] == "4"
    demos = next(s for s in plan(args, "ns") if s.name == "demonstrations").argv
    assert "--curriculum" not in demos  # demonstrations are gold answers: nothing to retire
    from infra.demo import CURRICULUM

    assert apply_preset(parser().parse_args([]), []).curriculum == CURRICULUM > 0  # each word length retired once learned
    assert apply_preset(parser().parse_args(["--preset", "smollm2"]), ["--preset", "smollm2"]).curriculum == 0


def test_an_evaluation_worker_past_its_timeout_is_stopped_and_named() -> None:
    """A held-out run that outlasts --timeout (a version each) is an error that says what to raise, and its workers
    are killed (left running, they went on generating on the machine's cores after the evaluation had failed)."""
    evaluation = Evaluation.__new__(Evaluation)
    evaluation.args = argparse.Namespace(timeout=0.5, episodes=16, parallel=2)
    started: list[subprocess.Popen[bytes]] = []

    def spawn(module: str, *argv: str, **_: object) -> subprocess.Popen[bytes]:
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
        return started[-1]

    evaluation.spawn = spawn  # type: ignore[method-assign]
    evaluation.worker = lambda ns, versions, mode: []  # type: ignore[method-assign]
    try:
        with pytest.raises(PipelineError, match=r"v3, v5 \(greedy\) did not finish 16 episodes a version.*raise --timeout"):
            evaluation.play("ns", [("greedy", [3, 5]), ("sampled", [3, 5, 7])])
        assert len(started) == 2 and all(p.poll() is not None for p in started)  # both stopped, the first at 1 s
    finally:
        for p in started:
            p.kill()


def test_an_evaluation_worker_that_fails_says_why_in_its_own_words() -> None:
    """Its output went nowhere: a failed evaluation said only which worker failed, never why."""
    evaluation = Evaluation.__new__(Evaluation)
    evaluation.args = argparse.Namespace(timeout=120, episodes=16, parallel=1, verbose=False)
    evaluation.env = dict(os.environ)
    evaluation.worker = lambda ns, versions, mode: ["--ns", ns, "--init-checkpoint", "run:7,8"]  # type: ignore
    with pytest.raises(PipelineError, match=r"v7, v8 \(greedy\) failed with exit code 2; its last output:\n(.|\n)*"
                                            r"error: --init-checkpoint with several versions .* add --no-follow"):
        evaluation.play("ns", [("greedy", [7, 8])])


def test_a_demo_started_from_a_checkpoint_hands_it_to_the_learner() -> None:
    argv = ["--init", "demo1:v85", "--sft-updates", "0", "--sources", "reverse,rg:*", "--curriculum", "2"]
    services = {s.name: s for s in plan(apply_preset(parser().parse_args(argv), argv), "ns")}
    learner = services["learner"].argv
    assert learner[learner.index("--init") + 1] == "demo1:v85"
    assert "demonstrations" not in services and services["producer-0"].when == "start"
    default = {s.name: s for s in plan(apply_preset(parser().parse_args([]), []), "ns")}
    assert "--init" not in default["learner"].argv
    assert "--init-moments" not in learner and "--init-moments" not in default["learner"].argv


def test_a_demo_asked_to_carry_the_moments_hands_the_flag_to_the_learner_and_refuses_it_without_init(
        capsys: pytest.CaptureFixture[str]) -> None:
    from infra.demo import main
    from learner.settings import parser as learner_parser

    argv = ["--init", "demo1:v5", "--init-moments", "--sft-updates", "0"]
    learner = {s.name: s for s in plan(apply_preset(parser().parse_args(argv), argv), "ns")}["learner"].argv
    assert learner_parser({}).parse_args(learner[1:]).init_moments
    with pytest.raises(SystemExit) as exit_:
        main(["--init-moments", "--sft-updates", "0"])
    assert exit_.value.code == 2 and "give --init RUN:vK too" in capsys.readouterr().err


def test_a_demos_policy_lag_bounds_the_learner_and_pauses_the_rollout_workers_a_version_earlier() -> None:
    from learner.settings import parser as learner_parser
    from producers.settings import parser as producer_parser

    lags = (([], 2, 1), (["--max-policy-lag", "0"], 0, 0), (["--max-policy-lag", "1"], 1, 0))
    for argv, learner_lag, worker_lag in lags:
        services = {s.name: s for s in plan(apply_preset(parser().parse_args(argv), argv), "ns")}
        assert learner_parser({}).parse_args(services["learner"].argv[1:]).max_policy_lag == learner_lag
        assert producer_parser().parse_args(services["producer-0"].argv[1:]).max_policy_lag == worker_lag


def test_the_pretrained_preset_stores_the_optimizer_in_every_fifth_checkpoint_only() -> None:
    """SmolLM2's moments are 1.1 GB of its 1.6 GB checkpoint: its demo stores them every 5th version; the
    default demo in every one. Both learner command lines parse with the learner's own parser."""
    from learner.settings import parser as learner_parser

    for argv, every in ((["--preset", "smollm2"], 5), ([], 1)):
        learner = next(s for s in plan(apply_preset(parser().parse_args(argv), argv), "ns") if s.name == "learner")
        assert learner.argv[learner.argv.index("--moments-every") + 1] == str(every)
        assert learner_parser({}).parse_args(learner.argv[1:]).moments_every == every


def test_a_demo_asked_for_a_bf16_broadcast_hands_it_to_the_learner_and_not_by_default() -> None:
    from learner.settings import parser as learner_parser

    for argv, wanted in ((["--broadcast-bf16"], True), ([], False)):
        learner = next(s for s in plan(apply_preset(parser().parse_args(argv), argv), "ns") if s.name == "learner")
        assert learner_parser({}).parse_args(learner.argv[1:]).broadcast_bf16 is wanted


def test_the_learning_curve_adds_a_panel_per_task_source_where_the_evaluation_drew_from_several(tmp_path: Path) -> None:
    from PIL import Image

    from infra.curves import plot_learning_curve

    def point(version: int, mode: str, by_source: dict[str, list[int]]) -> dict[str, object]:
        wins, n = sum(w for w, _ in by_source.values()), sum(n for _, n in by_source.values())
        low, high = wilson(wins, n)
        return {"version": version, "mode": mode, "success": wins / n, "ci_low": low, "ci_high": high,
                "seconds": 10.0 * version, "by_source": by_source}

    lengths = [point(v, "greedy", {"builtin:reverse-3": [v * 10, 64], "builtin:reverse-6": [v, 64]}) for v in (0, 3, 6)]
    one = [point(v, "greedy", {"builtin:reverse": [v * 10, 64]}) for v in (0, 3, 6)]
    widths = [Image.open(plot_learning_curve(points, 3, tmp_path / f"{i}.png")).size[0]
              for i, points in enumerate((lengths, one))]
    assert widths[0] == widths[1] * 3 // 2  # three panels against two: the same width each


def test_a_demo_with_an_sft_phase_says_its_time_against_the_goal_and_a_pretrained_one_leaves_it_to_its_training() -> None:
    from infra.demo import GOAL_MINUTES, time_goal

    args = parser().parse_args([])
    assert time_goal(11.44, args)[0].startswith(f"time: 11.4 min from the servers up to the held-out figures (goal "
                                                f"{GOAL_MINUTES} min on 2 cores: met;")
    assert "NOT met" in time_goal(GOAL_MINUTES + 0.1, args)[0]
    pretrained = apply_preset(parser().parse_args(["--preset", "smollm2"]), ["--preset", "smollm2"])
    assert time_goal(30.0, pretrained) == []  # judged by its minutes of training (goals)


def test_the_demo_draws_twice_the_6_letter_demonstrations_and_the_rollouts_alike() -> None:
    from collections import Counter

    from infra.demo import DEMONSTRATION_WEIGHTS, SOURCES
    from producers.settings import WorkerSettings, parse_weights
    from producers.worker import task_mixer

    def argvs(argv: list[str]) -> dict[str, list[str]]:
        return {s.name: s.argv for s in plan(apply_preset(parser().parse_args(argv), argv), "ns")}

    default = argvs([])
    teacher = default["demonstrations"]
    assert teacher[teacher.index("--weights") + 1] == DEMONSTRATION_WEIGHTS
    assert "--weights" not in default["producer-0"]  # rollouts: every length alike, the curriculum retires them
    assert "--weights" not in argvs(["--sources", "reverse"])["demonstrations"]  # the mix names the default's sources
    assert "--weights" not in argvs(["--demonstration-weights", ""])["demonstrations"]
    mine = argvs(["--demonstration-weights", "reverse-5=3"])["demonstrations"]
    assert mine[mine.index("--weights") + 1] == "reverse-5=3"
    # what the teacher then draws: two of every five demonstrations a 6-letter word
    mixer = task_mixer(WorkerSettings(ns="ns", producer_id="demonstrations", sources=tuple(SOURCES.split(",")),
                                      weights=parse_weights(DEMONSTRATION_WEIGHTS)))
    drawn = Counter(len(mixer.next().spec["answer"]) for _ in range(2000))
    assert 0.36 < drawn[6] / 2000 < 0.44 and all(0.16 < drawn[n] / 2000 < 0.24 for n in (3, 4, 5))


def test_a_malformed_demonstration_mix_is_refused_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    for bad, why in (("reverse-6", "write NAME=NUMBER"), ("reverse-6=x", "write NAME=NUMBER"),
                     ("reverse-6=-1", "none negative"), ("reverse-3=0,reverse-6=0", "one at least positive")):
        with pytest.raises(SystemExit) as stopped:
            main(["--demonstration-weights", bad])
        assert stopped.value.code == 2 and why in capsys.readouterr().err


def test_the_gpu_script_runs_the_demo_with_options_the_demo_has() -> None:
    """tests/gpu/smollm2_pipeline.sh never runs here (no GPU): its demo command must still parse, with the preset
    applied and its own values winning over the preset's."""
    script = (Path(__file__).resolve().parents[1] / "gpu" / "smollm2_pipeline.sh").read_text()
    command = script.split('-m infra demo', 1)[1].split("||", 1)[0].replace("\\\n", " ")
    argv = [word.strip('"') for word in command.split()]
    argv = [{"$NS": "gpu-check", "$backend": "vllm", "${UPDATES:-60}": "60"}.get(word, word) for word in argv]
    assert not [word for word in argv if "$" in word], argv
    args = apply_preset(parser().parse_args(argv), argv)
    assert (args.model, args.backend, args.learner_device, args.rl_updates) == ("smollm2-135m", "vllm", "cuda", 60)
    assert args.batch_trajectories == 64 and args.sources == PRESETS["smollm2"]["sources"]


def test_the_runs_report_ends_with_its_held_out_evaluation_and_where_the_sft_phase_ended(tmp_path: Path) -> None:
    """summary.md (the monitor's report of the topics) gains the demo's own verdict: the learning curve, every
    version evaluated with its interval and per-source success, the learner's line on the SFT phase's end, the
    goals, and what made a run unhealthy."""
    from infra.settings import Settings
    from infra.supervisor import Supervisor
    from schemas.manifests import SFT_PHASE_ENDS_LINE

    settings = Settings("127.0.0.1:1", "http://127.0.0.1:1", "key", "secret")
    run = Run("ns", tmp_path, settings, Supervisor(settings, tmp_path / "logs"))
    assert sft_phase_end(run) == ""  # no learner log (yet)
    (tmp_path / "logs").mkdir(exist_ok=True)
    ended = (f"{SFT_PHASE_ENDS_LINE} 114 of at most 160 updates: greedy decoding wrote 0.213 of builtin:reverse-6's "
             "demonstrations (the weakest of 4 sources) in the last 5 updates before training on them, >= 0.2")
    (tmp_path / "logs" / "learner.log").write_text(f"update 114/164 [sft] v5 loss 0.55\n{ended}\nupdate 115/164 [grpo]\n")
    assert sft_phase_end(run) == ended
    results = [{**_result(0, "greedy", 0), "phase": "initial", "episodes": 256, "reward_mean": -0.4,
                "by_source": {"builtin:reverse-3": [0, 63], "builtin:reverse-6": [0, 66]}},
               {**_result(57, "greedy", 248), "phase": "rl", "episodes": 256, "reward_mean": 1.17,
                "by_source": {"builtin:reverse-3": [61, 63], "builtin:reverse-6": [63, 66]}},
               {**_result(57, "sampled", 230), "phase": "rl", "episodes": 256, "reward_mean": 1.1, "by_source": {}}]
    section = learning_section(results, ["greedy: final held-out success 0.969 (goal 0.8: met)"], [], ended)
    lines = section.splitlines()
    assert "## Held-out evaluation" in lines and "![learning_curve](learning_curve.png)" in lines
    assert f"{ended}." in lines
    assert "| version | phase | mode | success [95%] | episodes | reward | builtin:reverse-3 | builtin:reverse-6 |" in lines
    low, high = wilson(248, 256)
    assert f"| v57 | rl | greedy | 0.969 [{low:.3f}, {high:.3f}] | 256 | 1.170 | 0.97 | 0.95 |" in lines
    assert any(line.startswith("| v57 | rl | sampled | 0.898 ") and line.endswith("|  |  |") for line in lines)
    assert lines[-2:] == ["- greedy: final held-out success 0.969 (goal 0.8: met)", "- healthy run"]
    failed = learning_section([], [], ["no version was evaluated"], "")
    assert "No version was evaluated: see logs/eval.log." in failed and "- unhealthy: no version was evaluated" in failed
    assert SFT_PHASE_ENDS_LINE not in failed
