"""Which held-out tasks an evaluation measures, and how sure its interval may be about them."""
from __future__ import annotations

import argparse
from dataclasses import replace

import pytest

import learner.eval as evaluation
from learner.eval import Evaluation, summarise, wilson
from producers.settings import from_args
from producers.worker import task_mixer
from schemas.tasks import encode_task_spec, make_spec
from tests.taps import trajectory


def eval_worker_argv(monkeypatch: pytest.MonkeyPatch, mode: str, **overrides: object) -> list[str]:
    """The worker command line `python -m learner.eval` starts for one version and mode (its defaults)."""
    monkeypatch.setattr(evaluation, "model_args", lambda store, ns, version: ["--layers", "2", "--width", "64"])
    run = Evaluation.__new__(Evaluation)
    run.args = argparse.Namespace(**{**vars(evaluation.parser().parse_args(["--ns", "demo"])), **overrides})
    run.store = None  # type: ignore[assignment]
    return run.worker("demo-eval", [85], mode)


def drawn(argv: list[str]) -> list[str]:
    """The task ids a worker started with `argv` plays: --episodes episodes in groups of --group-size."""
    s = from_args(argv)
    tasks = task_mixer(s)
    return [tasks.next().task_id for _ in range((s.episodes or 0) // s.group_size)]


def test_sampled_mode_plays_the_greedy_modes_held_out_tasks_each_once(monkeypatch: pytest.MonkeyPatch) -> None:
    greedy, sampled = (drawn(eval_worker_argv(monkeypatch, mode)) for mode in ("greedy", "sampled"))
    assert len(greedy) == 256 and len(set(greedy)) == 256 and sampled == greedy


def test_the_learning_benchmarks_loop_is_measured_on_the_evaluations_tasks(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.benchmarks.bench_learning import eval_tasks

    assert [t.task_id for t in eval_tasks(256)] == drawn(eval_worker_argv(monkeypatch, "greedy"))


def test_several_samples_of_a_task_give_an_interval_as_wide_as_their_tasks_allow() -> None:
    """64 tasks sampled 4 times each are 64 independent draws, not 256: the interval says so."""
    def episodes(tasks: int, each: int) -> list:
        return [replace(trajectory(f"e-{t}-{k}", reward=float(t % 4 != 0)), task_id=f"t-{t}")
                for t in range(tasks) for k in range(each)]

    clustered = summarise(9, "sampled", episodes(64, 4))
    assert clustered.episodes == 256 and clustered.success == 0.75
    assert (clustered.ci_low, clustered.ci_high) == pytest.approx(wilson(48, 64))
    independent = summarise(9, "sampled", episodes(256, 1))
    assert (independent.ci_low, independent.ci_high) == pytest.approx(wilson(192, 256))
    assert clustered.ci_high - clustered.ci_low > 1.9 * (independent.ci_high - independent.ci_low)


def test_success_is_reported_per_task_source_when_an_evaluation_draws_from_several() -> None:
    """`--sources reverse-3,...,reverse-6` measures each word length apart: where a policy stands on each."""
    def episode(i: int, length: int, solved: bool) -> object:
        spec = encode_task_spec(make_spec("text", answer="x" * length, source=f"builtin:reverse-{length}"))
        return replace(trajectory(f"e-{i}", reward=float(solved), domain="text"), task_id=f"t-{i}", task_spec=spec)

    episodes = [episode(i, 3, True) for i in range(6)] + [episode(10 + i, 6, i == 0) for i in range(4)]
    result = summarise(5, "greedy", episodes)  # type: ignore[arg-type]
    assert result.successes == 7 and result.by_source == {"builtin:reverse-3": [6, 6], "builtin:reverse-6": [1, 4]}
    assert result.line().endswith("; builtin:reverse-3 1.00 (6/6), builtin:reverse-6 0.25 (1/4)")
    one_source = summarise(5, "greedy", episodes[:6])  # type: ignore[arg-type]
    assert one_source.by_source == {"builtin:reverse-3": [6, 6]} and "builtin" not in one_source.line()
    untyped = summarise(5, "greedy", [replace(episodes[0], task_spec="not json")])  # type: ignore[arg-type]
    assert untyped.by_source == {"text": [1, 1]}


def test_evaluation_workers_at_once_must_be_at_least_one(capsys: pytest.CaptureFixture[str]) -> None:
    assert evaluation.main(["--ns", "demo", "--parallel", "0"]) == 2
    assert "--parallel must be at least 1, got 0" in capsys.readouterr().err
    assert evaluation.main(["--ns", "demo", "--episodes-per-step", "0"]) == 2
    assert "--episodes-per-step must be at least 1, got 0" in capsys.readouterr().err
    assert evaluation.main(["--ns", "demo", "--modes", "greedy,beam"]) == 2
    assert "--modes 'greedy,beam': greedy, sampled or both" in capsys.readouterr().err


def test_each_mode_s_versions_are_dealt_into_parallel_workers_that_play_them_in_turn(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker starts Python, torch and the task split once for its versions: 11 versions and modes in 4 workers,
    where each took one of its own."""
    run = Evaluation.__new__(Evaluation)
    run.args = argparse.Namespace(parallel=2)
    assert run.plan({"greedy": [0, 2, 4, 6, 18, 31, 44, 56], "sampled": [0, 6, 56]}) == [
        ("greedy", [0, 4, 18, 44]), ("greedy", [2, 6, 31, 56]), ("sampled", [0, 56]), ("sampled", [6])]
    argv = eval_worker_argv(monkeypatch, "sampled", group_size=4)
    s = from_args(argv[:argv.index("--init-checkpoint") + 1] + ["demo:0,4,18"] + argv[argv.index("--init-checkpoint") + 2:])
    assert s.init_checkpoints == ["demo:0", "demo:4", "demo:18"] and s.prompts_per_step * s.group_size == 32


def test_several_checkpoints_in_turn_are_for_a_worker_that_plays_a_fixed_number_of_episodes() -> None:
    from schemas.errors import ConfigError

    base = ["--ns", "demo-eval", "--init-checkpoint", "demo:3,5"]
    with pytest.raises(ConfigError, match="add --no-follow and --episodes N"):
        from_args(base + ["--episodes", "8"])
    with pytest.raises(ConfigError, match="add --no-follow and --episodes N"):
        from_args(base + ["--no-follow"])
    assert from_args(base + ["--no-follow", "--episodes", "8"]).init_checkpoints == ["demo:3", "demo:5"]
    for bad in ("3,5", "demo:3,x", "demo:", "demo:3,,5"):
        with pytest.raises(ConfigError, match="write NS:VERSION, NS:latest or NS:V1,V2"):
            from_args(["--ns", "demo-eval", "--init-checkpoint", bad, "--no-follow", "--episodes", "8"])
    assert from_args(["--ns", "x", "--init-checkpoint", "demo:latest"]).init_checkpoints == ["demo:latest"]
