"""The terminal domain with the real bwrap sandbox: a scripted policy (fixed tool calls) through the episode
runner, its events assembled and scored as streams does; wrong fixes, hostile commands, re-scoring."""
from __future__ import annotations

import glob
import json
import re
import tempfile
from typing import Any, Sequence

import pytest

from producers.episodes import EpisodeRunner
from producers.policy.interface import Generation, Prompts, Sampling, Tokenizer
from producers.sandbox.tools import Toolbox, ToolResult
from producers.sandbox_runner import SandboxCodeRunner
from producers.settings import WorkerSettings
from producers.tasks import load_source
from producers.tasks.task import Task
from producers.tasks.terminal import TerminalSource
from schemas.records import EpisodeEnded, RolloutEvent, SandboxResult, SourcePosition, Trajectory
from schemas.tasks import decode_task_spec
from schemas.toolcalls import ToolCall, ToolCallError, parse_call
from streams.assembly import fold, to_trajectory
from streams.rewards import get_reward_fn
from producers.sandbox import unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason("bwrap") is not None,
                                reason=f"the bwrap sandbox: {unavailable_reason('bwrap')}")

V1, V2 = get_reward_fn("default", "1"), get_reward_fn("default", "2")


class ScriptedPolicy:
    """A policy that says the given turns in order (the byte-level tokenizer of the small model)."""

    version = 0

    def __init__(self, turns: Sequence[str]) -> None:
        from producers.policy.tokenizer import PolicyTokenizer, load_hf_tokenizer

        self.turns, self.at = list(turns), 0
        self._tokenizer: Tokenizer = PolicyTokenizer(load_hf_tokenizer(None))

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    def generate(self, prompts: Prompts, n: int, sampling: Sampling) -> list[list[Generation]]:
        text = self.turns[min(self.at, len(self.turns) - 1)]
        self.at += 1
        tokens = self._tokenizer.completion(text)
        return [[Generation(tokens, [0.0] * len(tokens), text, "stop") for _ in range(n)] for _ in prompts]

    def load_weights(self, state: Any, version: int) -> None:
        raise NotImplementedError


def call(name: str, **arguments: str) -> str:
    return "I will use a tool.\n" + ToolCall(name, arguments).text()


def play(task: Task, turns: Sequence[str]) -> tuple[Trajectory, list[RolloutEvent]]:
    """One episode of `task` with the scripted turns, through the rollout worker's episode runner and the
    real sandbox; its events folded into a trajectory as streams does."""
    events: list[RolloutEvent] = []
    settings = WorkerSettings(ns="t", producer_id="scripted", group_size=1, prompts_per_step=1, max_new_tokens=4096)
    runner = SandboxCodeRunner("bwrap", workers=1)
    try:
        EpisodeRunner(ScriptedPolicy(turns), runner, events.append, settings, max_context=1 << 16).run_step([task])
    finally:
        runner.close()
    state = None
    for i, event in enumerate(events):
        state = fold(state, event, SourcePosition(partition=0, offset=i))
    assert state is not None and state.ended is not None
    return to_trajectory(state, "t.rollout.events"), events


def buggy_humaneval_task() -> Task:
    """A humaneval-bug task whose bug breaks HumanEval's tests."""
    source, box = TerminalSource(seed=0, families=("humaneval-bug",)), Toolbox("bwrap")
    for i in range(20):
        task = source[i]
        if box.call(task.spec["files"], ToolCall("run_tests"), task.spec).outcome != "passed":
            return task
    raise AssertionError("no mutant of the first 20 breaks its tests")


def test_a_scripted_fix_earns_the_full_reward_and_every_call_is_a_fact_in_the_log() -> None:
    task = buggy_humaneval_task()
    module = f"{task.spec['module']}.py"
    fix = json.loads(task.demonstration or "")["arguments"]["content"]
    trajectory, events = play(task, [call("run", command="ls"), call("read_file", path=module), call("run_tests"),
                                     call("write_file", path=module, content=fix), call("submit")])
    results = [e.body for e in events if isinstance(e.body, SandboxResult)]
    assert [r.outcome for r in results][:2] == ["passed", "passed"] and results[2].outcome != "passed"
    assert results[-1].outcome == "passed" and results[-1].tests_passed == results[-1].tests_total > 0
    assert isinstance(events[-1].body, EpisodeEnded) and events[-1].body.status == "completed"
    assert module in trajectory.turns[1].stderr or "def " in trajectory.turns[2].obs_text  # read_file's text
    scored = V1(trajectory).components
    first = results[2].tests_passed / results[2].tests_total
    assert scored["outcome/tests_passed"] == 1.0 and scored["process/tests_partial"] == 1.0
    assert scored["process/tests_gained"] == pytest.approx(1.0 - first)
    assert scored["process/commands_ok"] == 1.0 and scored["process/syntax_ok"] == 1.0
    assert scored["penalty/tool_errors"] == 0.0 and scored["penalty/truncated"] == 0.0
    assert scored["penalty/steps"] == pytest.approx(3 / 6)


def split_task_whose_implementation_bug_breaks_its_tests() -> tuple[Task, ToolResult]:
    """A humaneval-split task, and its repository with only the import repaired, still failing its tests."""
    source, box = TerminalSource(seed=0, families=("humaneval-split",)), Toolbox("bwrap")
    for i in range(20):
        task = source[i]
        if task.spec["family"] != "humaneval-split":
            continue
        module = task.spec["module"]
        facade = re.sub(r"from \S+ import", f"from {module}_core import", task.spec["files"][f"{module}.py"])
        half = box.call(task.spec["files"], ToolCall("write_file", {"path": f"{module}.py", "content": facade}),
                        task.spec)
        tested = box.call(half.files, ToolCall("run_tests"), task.spec)
        if tested.outcome != "passed":
            return task, tested
    raise AssertionError("no humaneval-split task of the first 20 has a bug that breaks its tests")


def test_a_bug_spread_over_two_files_needs_both_fixed_and_the_demonstration_fixes_both() -> None:
    task, half_fixed = split_task_whose_implementation_bug_breaks_its_tests()
    module, files = task.spec["module"], task.spec["files"]
    assert {f"{module}.py", f"{module}_core.py", f"test_{module}.py", "README.md"} == set(files)
    broken = Toolbox("bwrap").call(files, ToolCall("run_tests"), task.spec)
    assert "ModuleNotFoundError" in broken.observation and "ModuleNotFoundError" not in half_fixed.observation
    demo = parse_call(task.demonstration or "")
    assert demo.name == "run" and f"cat > {module}_core.py" in demo.arguments["command"]
    assert f"cat > {module}.py" in demo.arguments["command"]
    trajectory, events = play(task, [task.demonstration or "", call("submit")])
    results = [e.body for e in events if isinstance(e.body, SandboxResult)]
    assert [r.outcome for r in results] == ["passed", "passed"], [r.stderr[-300:] for r in results]
    assert results[-1].tests_passed == results[-1].tests_total > 0
    scored = V1(trajectory).components
    assert scored["outcome/tests_passed"] == 1.0 and scored["process/commands_ok"] == 1.0


def test_a_wrong_fix_and_a_policy_that_never_submits_score_no_outcome() -> None:
    task = buggy_humaneval_task()
    module = f"{task.spec['module']}.py"
    wrong, _ = play(task, [call("write_file", path=module, content="def broken(:\n"), call("submit")])
    components = V1(wrong).components
    assert components["outcome/tests_passed"] == 0.0 and components["process/syntax_ok"] == 0.0
    # the judged harness could not even import the module
    assert wrong.turns[-1].outcome == "runtime_error" and "SyntaxError" in wrong.turns[-1].stderr
    rambling, events = play(task, ["no tool here", call("run", command="true")] * 4)
    assert isinstance(events[-1].body, EpisodeEnded) and events[-1].body.status == "truncated"
    assert "step limit" in events[-1].body.detail and len(rambling.turns) == task.max_turns == 8
    components = V1(rambling).components
    assert components["outcome/tests_passed"] == 0.0 and components["penalty/tool_errors"] == 0.5
    assert rambling.turns[1].obs_text.startswith("\ntool error: no tool call")
    # re-scoring with another version changes the total by exactly the truncation weight, no component
    assert V2(rambling).components == components and V2(rambling).total == pytest.approx(V1(rambling).total - 0.5)
    solved, _ = play(task, [call("write_file", path=module, content=json.loads(task.demonstration or "")
                                 ["arguments"]["content"]), call("submit")])
    assert V2(solved).total == V1(solved).total and V1(solved).components["outcome/tests_passed"] == 1.0


def test_hostile_commands_are_contained_and_reported_and_leave_no_work_dir() -> None:
    task = TerminalSource(seed=0, families=("import-fix",))[0]
    box, files = Toolbox("bwrap"), dict(task.spec["files"])
    before = set(glob.glob(f"{tempfile.gettempdir()}/trajpipe-sandbox-*"))

    def run(command: str) -> Any:
        return box.call(files, ToolCall("run", {"command": command}), task.spec)

    net = run("python3 -c \"import socket; socket.create_connection(('127.0.0.1', 39092), timeout=2)\"; "
              "python3 -c \"import socket; socket.create_connection(('1.1.1.1', 80), timeout=2)\"")
    assert net.outcome == "failed" and "Error" in net.observation
    host = run("cat /etc/shadow; cat /work/main/README.md; ls /root /home; echo $TRAJPIPE_S3_SECRET_KEY.")
    assert "No such file" in host.observation and "trajpipe" not in host.observation.split("\n", 1)[1]
    assert "\n.\n" in host.observation  # the secret variable is empty in there
    bomb = run(":(){ :|:& };:")
    assert bomb.outcome in ("failed", "timeout", "runtime_error") and bomb.duration_ms < 30_000
    big = run("head -c 300000000 /dev/zero > big")  # one file past the per-file limit
    assert big.outcome == "failed" and "File size limit exceeded" in big.observation
    assert "big" not in big.files and "files not kept" in big.observation  # bounded: not carried over
    full = run("for i in $(seq 20); do head -c 15000000 /dev/zero > f$i || exit 1; done")  # the whole disk
    assert full.outcome == "failed" and "No space left" in full.observation and "f1" not in full.files
    assert run("echo fine").outcome == "passed"  # the sandbox and the host are still well
    assert set(glob.glob(f"{tempfile.gettempdir()}/trajpipe-sandbox-*")) == before


@pytest.mark.parametrize("text,needle", [
    ("just words", "no tool call"), ('{"name": "rm", "arguments": {}}', "unknown tool"),
    ('{"name": "run", "arguments": {}}', "'command'"), ('{"name": "read_file", "arguments": {"path": "../x"}}',
                                                       "inside the repository"),
    ('{"name": "write_file", "arguments": {"path": "/etc/passwd", "content": ""}}', "inside the repository"),
])
def test_a_turn_that_is_no_valid_tool_call_is_refused_with_a_reason(text: str, needle: str) -> None:
    with pytest.raises(ToolCallError, match=needle):
        parse_call(text)
    assert parse_call('think... {"name": "read_file", "arguments": {"path": "./a/../b.py"}} done') == \
        ToolCall("read_file", {"path": "b.py"})


def test_terminal_tasks_are_reproducible_and_their_demonstration_fixes_them() -> None:
    source = load_source("terminal", seed=5)
    assert isinstance(source, TerminalSource) and len(source) == 3 * 164 and source[3] == TerminalSource(seed=5)[3]
    box, families, broken = Toolbox("bwrap"), set(), 0
    for i in range(0, 40, 5):
        task = source[i]
        spec = decode_task_spec(task.task_spec, "terminal")
        families.add(spec["family"])
        assert task.max_turns == spec["max_steps"] == 8 and "README.md" in spec["files"]
        broken += box.call(spec["files"], ToolCall("run_tests"), spec).outcome != "passed"
        fix = parse_call(task.demonstration or "")
        fixed = box.call(spec["files"], fix, spec)
        assert box.call(fixed.files, ToolCall("submit"), spec).outcome == "passed", task.task_id
    assert families == {"humaneval-bug", "import-fix", "humaneval-split"} and broken >= 6
