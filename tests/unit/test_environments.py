"""The environment plugin interface, with the example package really installed (pip, into a private directory)
and found through its entry points: tasks, the held-out split, its verifier and reward function in the
rewards, and what happens when it is missing, broken or too new."""
from __future__ import annotations

import json
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import pytest

from producers.episodes import EpisodeRunner
from producers.sandbox_runner import NoCodeRunner
from producers.settings import WorkerSettings
from producers.tasks import load_source
from producers.tasks.environments import EnvironmentSource, expand, feedback
from producers.tasks.split import SplitSource
from schemas import environments
from schemas.errors import ConfigError, RewardError, ValidationError
from schemas.records import EpisodeEnded, RolloutEvent
from schemas.tasks import decode_task_spec, is_domain
from streams import rewards
from streams.rewards import get_reward_fn
from streams.validation import validate
from tests.environment_package import install, off_path, on_path
from tests.streams_data import Episode, events_of
from tests.unit.test_rewards import traj, turn
from tests.unit.test_terminal import ScriptedPolicy

SCORE = get_reward_fn("default", "1")


def forget() -> None:
    environments._entry_points.cache_clear()
    environments.load.cache_clear()
    rewards.REWARDS.pop(("brevity", "1"), None)
    for name in [m for m in sys.modules if m.startswith("trajpipe_example_env")]:
        del sys.modules[name]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return install(tmp_path_factory.mktemp("site"))


@pytest.fixture
def site(installed: Path) -> Iterator[Path]:
    """The package installed: its directory on the path, for this test only."""
    forget()
    on_path(installed)
    yield installed
    off_path(installed)
    forget()


def vowels(word: str) -> int:
    return sum(ch in "aeiou" for ch in word)


def test_the_installed_package_adds_a_domain_whose_tasks_are_reproducible_and_split(site: Path) -> None:
    assert environments.installed() == ["vowels", "vowels-remote"]
    assert expand(["env:*", "math"]) == ["env:vowels", "env:vowels-remote", "math"]
    source = load_source("env:vowels", seed=3)
    assert isinstance(source, EnvironmentSource) and len(source) == 5000 and source.domain == "env/vowels"
    task = source[7]
    assert task == EnvironmentSource("vowels", seed=3)[7] and task != EnvironmentSource("vowels", seed=4)[7]
    spec = decode_task_spec(task.task_spec, "env/vowels")
    word = spec["word"]
    assert spec["env_version"] == "1" and task.prompt == f"vowels in {word}:" and task.max_turns == 2
    assert task.task_id == f"env/vowels/{word}" and task.demonstration == str(vowels(word))
    train, held = SplitSource(source, "train"), SplitSource(source, "heldout")
    train_ids = {train[i].task_id for i in range(0, len(train), 50)}
    assert train_ids.isdisjoint(held[i].task_id for i in range(0, len(held), 50))


def test_its_verifier_scores_the_recorded_answer_and_its_reward_function_weighs_the_components(site: Path) -> None:
    task = EnvironmentSource("vowels", seed=0)[1]
    word = task.spec["word"]
    right, wrong = str(vowels(word)), str(vowels(word) + 1)
    good = SCORE(traj("env/vowels", task.task_spec, [turn(0, right)]))
    assert good.components["outcome/correct"] == 1.0 and good.components["process/answer_found"] == 1.0
    assert "penalty/truncated" in good.components and good.total == pytest.approx(1.1)
    bad = SCORE(traj("env/vowels", task.task_spec, [turn(0, "many")]))
    assert bad.components["outcome/correct"] == 0.0 and bad.components["process/answer_found"] == 0.0
    # the episode: a wrong answer gets a second try, a right one ends it; the last turn is what is scored
    assert feedback(task, wrong) == " wrong, try again:" and feedback(task, right) is None
    second_try = traj("env/vowels", task.task_spec, [turn(0, wrong), turn(1, right)])
    assert SCORE(second_try).components["outcome/correct"] == 1.0
    brevity = get_reward_fn("brevity", "1")  # from the package's trajpipe.rewards entry point "brevity:1"
    assert brevity(second_try).total == pytest.approx(0.5) and brevity(second_try).components == \
        SCORE(second_try).components
    assert brevity(traj("env/vowels", task.task_spec, [turn(0, right)])).total == pytest.approx(1.0)


def test_a_verifier_that_raises_or_answers_nonsense_and_a_task_too_new_are_reward_errors(
        site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    task = EnvironmentSource("vowels", seed=0)[2]
    env = environments.load("vowels")
    newer = json.dumps({**decode_task_spec(task.task_spec), "env_version": "2"})
    with pytest.raises(RewardError, match="does not score tasks of its version 2"):
        SCORE(traj("env/vowels", newer, [turn(0, "1")]))
    monkeypatch.setattr(env, "verify", lambda spec, answer: {"process/answer_found": 1.0})
    with pytest.raises(RewardError, match="no outcome/correct"):
        SCORE(traj("env/vowels", task.task_spec, [turn(0, "1")]))
    monkeypatch.setattr(env, "verify", lambda spec, answer: {"outcome/correct": 7.0})
    with pytest.raises(RewardError, match="outside"):
        SCORE(traj("env/vowels", task.task_spec, [turn(0, "1")]))
    monkeypatch.setattr(env, "verify", lambda spec, answer: spec["no such key"])
    with pytest.raises(RewardError, match="KeyError"):
        SCORE(traj("env/vowels", task.task_spec, [turn(0, "1")]))


def test_a_turns_feedback_calls_are_made_at_once(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vowels-remote's checker is a remote service: the worker waits for its replies together, not one
    episode after another. Here each reply comes only once every episode of the turn has asked."""
    from trajpipe_example_env import CHECKER_S

    monkeypatch.setenv(CHECKER_S, "0")
    task = EnvironmentSource("vowels-remote", seed=0)[0]
    word = task.spec["word"]
    assert feedback(task, str(vowels(word) + 1)) == " wrong, try again:" and feedback(task, str(vowels(word))) is None
    group = 6
    everyone_asked = threading.Barrier(group, timeout=60)
    remote = environments.load("vowels-remote")
    checked = remote.feedback

    def feedback_together(spec: dict[str, str], answer: str) -> str | None:
        everyone_asked.wait()  # one call at a time would break the barrier: that episode ends in error
        return checked(spec, answer)  # type: ignore[no-any-return]

    monkeypatch.setattr(remote, "feedback", feedback_together)
    events: list[RolloutEvent] = []
    settings = WorkerSettings(ns="t", producer_id="p", group_size=group, prompts_per_step=1, max_new_tokens=4)
    wrong = str(vowels(word) + 1)
    EpisodeRunner(ScriptedPolicy([wrong, str(vowels(word))]), NoCodeRunner(), events.append, settings).run_step([task])
    ended = [e.body for e in events if isinstance(e.body, EpisodeEnded)]
    assert [(e.status, e.num_turns) for e in ended] == [("completed", 2)] * group, ended
    assert everyone_asked.n_waiting == 0 and not everyone_asked.broken


def test_without_the_package_its_domain_is_unknown_with_a_reason_and_nothing_else_changes() -> None:
    forget()
    assert environments.installed() == [] and is_domain("env/vowels")  # a well-formed name, just not here
    with pytest.raises(ConfigError, match="not installed.*trajpipe.environments"):
        load_source("env:vowels")
    spec = json.dumps({"v": 1, "domain": "env/vowels", "word": "abc", "env_version": "1"})
    with pytest.raises(RewardError, match="not installed"):
        SCORE(traj("env/vowels", spec, [turn(0, "1")]))
    with pytest.raises(ConfigError, match="no reward function brevity v1"):
        get_reward_fn("brevity", "1")
    assert not is_domain("env/") and not is_domain("env/Bad Name")


def test_an_event_of_an_environment_not_installed_is_refused_as_unknown_environment() -> None:
    forget()
    started = events_of(Episode("ep-e", "g-e", "math", group_size=2, right=True), 1)[0]
    with pytest.raises(ValidationError) as info:
        validate(replace(started, domain="env/vowels"))
    assert info.value.reason == "unknown_environment" and "not installed" in str(info.value)
