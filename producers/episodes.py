"""Runs the G episodes of one or more prompts: generate, execute, feed the error back, fix; records facts as events.

    runner = EpisodeRunner(backend, sandbox, emit, settings)
    summary = runner.run_step(tasks)     # every episode of these tasks is started and ended (or aborted)
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

from infra.faults import fault_point
from producers.policy.interface import Generation, PolicyBackend, Sampling
from producers.sandbox.tools import ToolResult
from producers.settings import WorkerSettings
from producers.tasks.environments import feedback as environment_feedback
from producers.tasks.task import Task
from schemas import environments
from schemas.keys import new_event_id
from schemas.packing import pack_floats, pack_ids
from schemas.records import Body, EpisodeEnded, EpisodeStarted, PolicyTurn, RolloutEvent, SandboxResult
from schemas.toolcalls import ToolCall, ToolCallError, parse_call

FEEDBACK_CHARS = 400  # error text fed back to the policy on a failed code turn


class CodeRunner(Protocol):
    """Runs candidate solutions against their tests (the sandbox pool)."""

    def run_many(self, jobs: Sequence[tuple[str, str, str]]) -> list[SandboxResult]:
        """(solution_code, test_code, entry_point) per job -> one result each, in order (turn set by caller)."""
        ...

    def run_tools(self, jobs: Sequence[tuple[Mapping[str, str], ToolCall, Mapping[str, Any]]]) -> list[ToolResult]:
        """(repository, call, task spec) per job -> one result each, in order."""
        ...


@dataclass
class Episode:
    task: Task
    episode_id: str
    group_id: str
    context: list[int]  # every token the policy has seen or produced so far
    seq: int = 0
    turn: int = 0
    status: Optional[str] = None  # set when ended
    detail: str = ""
    last: Optional[Generation] = None
    files: Optional[dict[str, str]] = None  # terminal: the repository as the last tool call left it


@dataclass
class StepSummary:
    episodes: int = 0
    turns: int = 0
    tokens: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    generate_s: float = 0.0
    sandbox_s: float = 0.0  # executing actions: sandbox runs, tool calls, installed environments' feedback
    skipped_too_long: int = 0


def solution_code(task: Task, completion: str) -> str:
    """HumanEval prompts end inside the function: the program is prompt + completion."""
    return str(task.spec.get("prompt", task.prompt)) + completion


def feedback_text(task: Task, result: SandboxResult) -> str:
    """What the policy reads after a failed attempt: the short error, then the prompt to complete again."""
    error = (result.stderr or result.stdout or result.outcome).strip()[-FEEDBACK_CHARS:]
    return f"\n# {result.outcome}: {result.tests_passed}/{result.tests_total} tests passed\n# {error}\n" + task.prompt


class EpisodeRunner:
    """Turns tasks into complete, ordered event streams, one episode per sample of a group."""

    def __init__(self, backend: PolicyBackend, code_runner: CodeRunner, emit: Callable[[RolloutEvent], None],
                 settings: WorkerSettings, should_stop: Callable[[], bool] = lambda: False,
                 max_context: int = 2048, flush: Callable[[], None] = lambda: None) -> None:
        self.backend, self.code_runner, self.emit, self.flush = backend, code_runner, emit, flush
        self.settings, self.should_stop, self.max_context = settings, should_stop, max_context
        self._consultants: Optional[ThreadPoolExecutor] = None  # made when an environment's episode first needs it

    # ---- events --------------------------------------------------------------------------------
    def _event(self, ep: Episode, body: Body) -> None:
        now = int(time.time() * 1000)
        self.emit(RolloutEvent(
            event_id=new_event_id(now), run=self.settings.ns, episode_id=ep.episode_id, group_id=ep.group_id,
            task_id=ep.task.task_id, domain=ep.task.domain, policy_version=self.backend.version,
            producer_id=self.settings.producer_id, ts=now, seq=ep.seq, body=body,
        ))
        ep.seq += 1

    def _end(self, ep: Episode, status: str, detail: str = "") -> None:
        ep.status, ep.detail = status, detail
        self._event(ep, EpisodeEnded(status=status, num_turns=ep.turn, detail=detail))

    # ---- the step ------------------------------------------------------------------------------
    def start(self, tasks: Sequence[Task], summary: StepSummary) -> list[Episode]:
        episodes = []
        for task in tasks:
            group_id = "grp-" + new_event_id()
            prompt = self.backend.tokenizer.prompt(task.prompt)
            if len(prompt) + self.settings.max_new_tokens > self.max_context:
                summary.skipped_too_long += 1  # never started: no episode, nothing to account for
                continue
            for _ in range(self.settings.group_size):
                ep = Episode(task, "ep-" + new_event_id(), group_id, list(prompt))
                self._event(ep, EpisodeStarted(
                    prompt_text=task.prompt, prompt_tokens=pack_ids(prompt), task_spec=task.task_spec,
                    group_size=self.settings.group_size, max_turns=self.max_turns(task),
                    temperature=self.settings.temperature, max_new_tokens=self.settings.max_new_tokens))
                episodes.append(ep)
        return episodes

    def max_turns(self, task: Task) -> int:
        if task.domain == "terminal":  # the task's step limit
            return task.max_turns
        multi = task.domain == "code" or environments.name_of(task.domain) is not None
        return min(task.max_turns, self.settings.max_turns) if multi else 1

    def sampling(self) -> Sampling:
        return Sampling(temperature=self.settings.temperature, max_new_tokens=self.settings.max_new_tokens)

    def generate(self, live: list[Episode], first: bool, summary: StepSummary) -> None:
        started = time.perf_counter()
        if first:  # the G samples of a prompt come from one call with n = G
            groups = self.backend.generate([ep.context for ep in live[:: self.settings.group_size]],
                                           n=self.settings.group_size, sampling=self.sampling())
            gens = [g for group in groups for g in group]
        else:
            gens = [group[0] for group in self.backend.generate([ep.context for ep in live], 1, self.sampling())]
        summary.generate_s += time.perf_counter() - started
        for ep, gen in zip(live, gens):
            ep.last = gen
            ep.context += gen.tokens
            summary.tokens += len(gen.tokens)
            summary.turns += 1

    def record_turn(self, ep: Episode, obs_text: str, obs_tokens: list[int]) -> None:
        gen, sampling = ep.last, self.sampling()
        assert gen is not None
        self._event(ep, PolicyTurn(turn=ep.turn, obs_text=obs_text, obs_tokens=pack_ids(obs_tokens), text=gen.text,
                                   tokens=pack_ids(gen.tokens), logprobs=pack_floats(gen.logprobs),
                                   finish_reason=gen.finish_reason, temperature=sampling.temperature,
                                   top_p=sampling.top_p))

    def execute(self, live: list[Episode], summary: StepSummary) -> list[SandboxResult]:
        started = time.perf_counter()
        jobs = [(solution_code(ep.task, ep.last.text if ep.last else ""), str(ep.task.spec["tests"]),
                 str(ep.task.spec["entry_point"])) for ep in live]
        results = self.code_runner.run_many(jobs)
        summary.sandbox_s += time.perf_counter() - started
        return results

    def run_step(self, tasks: Sequence[Task]) -> StepSummary:
        summary = StepSummary()
        episodes = self.start(tasks, summary)
        if not episodes:
            return summary
        fault_point("mid_episode", before=self.flush)
        live = list(episodes)
        obs: dict[str, tuple[str, list[int]]] = {}
        first = True
        while live:
            self.generate(live, first, summary)
            first = False
            for ep in live:
                self.record_turn(ep, *obs.pop(ep.episode_id, ("", [])))
            live = self.after_turn(live, obs, summary)
        summary.episodes = len(episodes)
        for ep in episodes:
            summary.statuses[ep.status or "?"] = summary.statuses.get(ep.status or "?", 0) + 1
        return summary

    def after_turn(self, live: list[Episode], obs: dict[str, tuple[str, list[int]]],
                   summary: StepSummary) -> list[Episode]:
        """Execute code and tool calls, end what is done, queue the observation of what goes on; returns the
        episodes still live."""
        code = [ep for ep in live if ep.task.domain == "code"]
        results = dict(zip((ep.episode_id for ep in code), self.execute(code, summary))) if code else {}
        tools = self.use_tools([ep for ep in live if ep.task.domain == "terminal"], summary)
        answers = self.consult_environments([ep for ep in live if environments.name_of(ep.task.domain)], summary)
        still: list[Episode] = []
        for ep in live:
            result = results.get(ep.episode_id)
            if result is not None:
                result = SandboxResult(**{**result.__dict__, "turn": ep.turn})
                self._event(ep, result)
            tool = tools.get(ep.episode_id)
            if isinstance(tool, ToolResult):
                self._event(ep, SandboxResult(turn=ep.turn, outcome=tool.outcome, tests_passed=tool.tests_passed,
                                              tests_total=tool.tests_total, stdout="", stderr=tool.observation,
                                              duration_ms=tool.duration_ms, backend=tool.backend))
                ep.files = tool.files
            ep.turn += 1
            if ep.task.domain == "terminal":
                step = self.terminal_step(ep, tool)
            elif ep.episode_id in answers:
                step = answers[ep.episode_id]
            else:
                verdict = self.verdict(ep, result)  # None only after a run that failed: try again
                if verdict is None and result is not None:
                    step = feedback_text(ep.task, result)
                else:
                    step = verdict or ("completed", "")
            if isinstance(step, tuple):
                self._end(ep, *step)
                continue
            text = step
            tokens = self.backend.tokenizer.encode(text)
            if len(ep.context) + len(tokens) + self.settings.max_new_tokens > self.max_context:
                self._end(ep, "truncated", "context length")
                continue
            ep.context += tokens
            obs[ep.episode_id] = (text, tokens)
            still.append(ep)
        return still

    def use_tools(self, live: list[Episode], summary: StepSummary) -> dict[str, ToolResult | str]:
        """Each terminal episode's tool call on its repository; a turn that is no tool call gets the reason."""
        done: dict[str, ToolResult | str] = {}
        jobs, owners = [], []
        for ep in live:
            try:
                call = parse_call(ep.last.text if ep.last else "")
            except ToolCallError as exc:
                done[ep.episode_id] = str(exc)
                continue
            if ep.files is None:
                ep.files = dict(ep.task.spec["files"])
            jobs.append((ep.files, call, ep.task.spec))
            owners.append(ep.episode_id)
        if jobs:
            started = time.perf_counter()
            done.update(zip(owners, self.code_runner.run_tools(jobs)))
            summary.sandbox_s += time.perf_counter() - started
        return done

    def terminal_step(self, ep: Episode, tool: ToolResult | str | None) -> tuple[str, str] | str:
        """(status, detail) when the episode ends, else the observation the policy reads next."""
        if isinstance(tool, ToolResult):
            if tool.outcome == "infra_error":
                return "error", f"sandbox infra error: {tool.observation[:200]}"
            if tool.done:
                return "completed", "submitted"
            observation = tool.observation
        else:
            observation = f"tool error: {tool}"
        if ep.turn >= self.max_turns(ep.task):
            return "truncated", f"step limit ({ep.turn} steps) without submit"
        if self.should_stop():
            return "aborted", "worker stopping"
        return f"\n{observation}\n"

    def consult_environments(self, live: list[Episode], summary: StepSummary) -> dict[str, tuple[str, str] | str]:
        """Each installed environment's episode's next step (environment_step), all of a turn's at once: a
        feedback that waits on a remote tool or checker waits once a turn, not once an episode."""
        if not live:
            return {}
        if self._consultants is None:
            self._consultants = ThreadPoolExecutor(self.settings.tool_workers, thread_name_prefix="environment")
        started = time.perf_counter()
        steps = list(self._consultants.map(lambda ep: self.environment_step(ep, ep.turn + 1), live))
        summary.sandbox_s += time.perf_counter() - started
        return {ep.episode_id: step for ep, step in zip(live, steps)}

    def environment_step(self, ep: Episode, turn: int) -> tuple[str, str] | str:
        """An installed environment decides whether its episode goes on after `turn` turns, and with what
        observation."""
        try:
            observation = environment_feedback(ep.task, ep.last.text if ep.last else "") \
                if turn < self.max_turns(ep.task) and not self.should_stop() else None
        except Exception as exc:  # an installed package's code: its failure ends this episode only
            return "error", f"environment feedback failed: {exc!r}"[:300]
        if observation is None:
            truncated = ep.last is not None and ep.last.finish_reason == "length"
            return ("truncated", "max_new_tokens") if truncated else ("completed", "")
        return observation

    def verdict(self, ep: Episode, result: Optional[SandboxResult]) -> Optional[tuple[str, str]]:
        """(status, detail) when the episode ends after this turn, None when it gets another turn."""
        gen = ep.last
        truncated = gen is not None and gen.finish_reason == "length"
        if result is None or result.outcome == "passed":
            return ("truncated", "max_new_tokens") if truncated and result is None else ("completed", "")
        if result.outcome == "infra_error":
            return ("error", f"sandbox infra error: {result.stderr[:200]}")
        if self.should_stop():
            return ("aborted", "worker stopping")
        if ep.turn >= self.max_turns(ep.task):
            return ("truncated", "max_new_tokens") if truncated else ("completed", f"failed after {ep.turn} turns")
        return None
