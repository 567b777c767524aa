"""A recorded stream for the streams tests: groups of episodes in every kind of domain, with what must come out.

    stream = recorded_stream()
    stream.messages          # [(key, value)] in log order: episodes interleaved, bad and duplicate events mixed in
    stream.expect_scored     # trajectory ids that must reach <ns>.trajectories.scored
    stream.expect_reasons    # dead-letter reason -> count

Everything is derived from the arguments (event ids included), so the same call gives the same bytes.
"""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Optional

from producers.tasks.reasoning_gym import ReasoningGymDomain
from schemas.codec import codec
from schemas.keys import trajectory_id
from schemas.packing import pack_floats, pack_ids
from schemas.records import (
    BatchManifest,
    Body,
    EpisodeEnded,
    EpisodeStarted,
    PolicyTurn,
    RolloutEvent,
    SandboxResult,
    TaskStats,
)
from schemas.tasks import encode_task_spec, make_spec

RG = "rg/leg_counting"  # a reasoning-gym domain: scored by re-generating the task
_RG_TASK = ReasoningGymDomain("leg_counting", seed=0, size=8)[3]
SPECS = {
    RG: _RG_TASK.task_spec,
    "code": encode_task_spec(make_spec("code", entry_point="add", tests="def check(candidate): pass")),
    "math": encode_task_spec(make_spec("math", answer="7")),
    "table": encode_task_spec(make_spec("table", answer="38.25", tolerance=0.01, cells=[
        {"statement": "income", "row": "Revenue", "column": "2023", "value": 400}])),
}
TEXTS = {  # (right, wrong) final texts per domain
    "code": ("    return a + b\n", "    return a - b\n"),
    "math": ("3 + 4 = 7. The answer is 7", "3 + 4 = 8. The answer is 8"),
    "table": ("Revenue 400 gives a margin of 38.25", "the margin is 12"),
    RG: (f"Counting every leg. Answer: {_RG_TASK.spec['answer']}", "Answer: 999999"),
}
BASE_TS = 1_760_000_000_000


@dataclass(frozen=True)
class Episode:
    episode_id: str
    group_id: str
    domain: str
    group_size: int
    right: bool
    status: Optional[str] = "completed"  # None: never ends (abandoned by the sweeper)
    turns: int = 1
    task: Optional[str] = None  # default: "<domain>/<group id>", a task of its own

    @property
    def trajectory_id(self) -> str:
        return trajectory_id(self.episode_id)

    @property
    def trainable(self) -> bool:
        return self.status in ("completed", "truncated")


@dataclass
class RecordedStream:
    messages: list[tuple[bytes, bytes]] = field(default_factory=list)
    episodes: list[Episode] = field(default_factory=list)
    expect_scored: set[str] = field(default_factory=set)
    expect_reasons: Counter[str] = field(default_factory=Counter)
    duplicates: int = 0
    zero_variance_groups: int = 0
    timed_out_groups: int = 0

    @property
    def events(self) -> int:
        return len(self.messages)

    def by_episode(self) -> dict[str, list[tuple[bytes, bytes]]]:
        out: dict[str, list[tuple[bytes, bytes]]] = {}
        for key, value in self.messages:
            out.setdefault(key.decode(errors="replace"), []).append((key, value))
        return out


def bodies(ep: Episode) -> list[Body]:
    """EpisodeStarted, per turn a PolicyTurn (and for code a SandboxResult), then EpisodeEnded."""
    out: list[Body] = [EpisodeStarted(prompt_text=f"task of {ep.group_id}", prompt_tokens=pack_ids([1, 2, 3]),
                                      task_spec=SPECS[ep.domain], group_size=ep.group_size, max_turns=ep.turns,
                                      temperature=1.0, max_new_tokens=32)]
    for turn in range(ep.turns):
        last = turn == ep.turns - 1
        text = TEXTS[ep.domain][0 if ep.right and last else 1]
        tokens = list(text.encode()[:12])
        out.append(PolicyTurn(turn=turn, obs_text="" if turn == 0 else "# failed\n", obs_tokens=b"", text=text,
                              tokens=pack_ids(tokens), logprobs=pack_floats([-0.25] * len(tokens))))
        if ep.domain == "code":
            ok = ep.right and last
            out.append(SandboxResult(turn=turn, outcome="passed" if ok else "failed", tests_passed=int(ok),
                                     tests_total=1, stdout="", stderr="" if ok else "AssertionError",
                                     duration_ms=5, backend="subprocess"))
    if ep.status is not None:
        out.append(EpisodeEnded(status=ep.status, num_turns=ep.turns))
    return out


def events_of(ep: Episode, ts: int, run: str = "recorded") -> list[RolloutEvent]:
    return [RolloutEvent(event_id=f"{ep.episode_id}-e{i:03d}", run=run, episode_id=ep.episode_id,
                         group_id=ep.group_id, task_id=ep.task or f"{ep.domain}/{ep.group_id}", domain=ep.domain,
                         policy_version=0, producer_id="recorder", ts=ts + i, seq=i, body=body)
            for i, body in enumerate(bodies(ep))]


def groups_plan(groups_per_domain: int, group_size: int) -> list[list[Episode]]:
    """Mixed-reward groups in every domain, plus the special cases the stages must handle."""
    plan = []
    for d, domain in enumerate(("code", "math", "table", RG)):
        for g in range(groups_per_domain):
            gid = f"g-{domain}-{g}"
            plan.append([Episode(f"ep-{gid}-{i}", gid, domain, group_size, right=(i + g) % 2 == 0,
                                 turns=2 if domain == "code" and i % 2 else 1) for i in range(group_size)])
    gid = "g-math-allright"  # every member right: zero variance, dropped
    plan.append([Episode(f"ep-{gid}-{i}", gid, "math", group_size, right=True) for i in range(group_size)])
    gid = "g-table-special"  # one abandoned, one aborted member: never trained, not scored
    plan.append([Episode(f"ep-{gid}-0", gid, "table", group_size, right=True),
                 Episode(f"ep-{gid}-1", gid, "table", group_size, right=False),
                 Episode(f"ep-{gid}-2", gid, "table", group_size, right=True, status=None),
                 Episode(f"ep-{gid}-3", gid, "table", group_size, right=False, status="aborted")][:group_size])
    gid = "g-code-straggler"  # one member never comes: emitted on the group timeout
    plan.append([Episode(f"ep-{gid}-{i}", gid, "code", group_size, right=i == 0) for i in range(group_size - 1)])
    return plan


def _expected(stream: RecordedStream, plan: list[list[Episode]]) -> None:
    for group in plan:
        trainable = [e for e in group if e.trainable]
        if len({e.right for e in trainable}) < 2:
            stream.zero_variance_groups += 1
        else:
            stream.expect_scored |= {e.trajectory_id for e in trainable}
        stream.timed_out_groups += len(group) < group[0].group_size


def bad_messages(good: RolloutEvent) -> list[tuple[str, bytes, bytes]]:
    """(reason, key, value) of events every stage must set aside, built around a real event."""
    key = good.episode_id.encode()
    started = EpisodeStarted(prompt_text="p", prompt_tokens=pack_ids([1]), task_spec=SPECS["math"], group_size=2,
                             max_turns=1, temperature=1.0, max_new_tokens=8)
    turn = PolicyTurn(turn=9, obs_text="", obs_tokens=b"", text="x", tokens=pack_ids([1, 2]),
                      logprobs=pack_floats([-0.5, -0.5]))
    base = replace(good, event_id=f"{good.episode_id}-bad")
    return [
        ("bad_magic", key, b"not an avro record at all"),
        ("truncated", key, codec.encode(good)[:40]),
        ("unknown_schema", key, b"\xc3\x01" + b"\x00" * 8 + b"rest"),
        ("schema_mismatch", key, codec.encode(TaskStats(task_id="t", domain="math", attempts=1, passes=1, ts=1))),
        ("bad_logprob", key, codec.encode(replace(base, event_id=base.event_id + "1",
                                                  body=replace(turn, logprobs=pack_floats([-0.5, float("nan")]))))),
        ("bad_logprob", key, codec.encode(replace(base, event_id=base.event_id + "2",
                                                  body=replace(turn, logprobs=pack_floats([-0.5, 0.5]))))),
        ("length_mismatch", key, codec.encode(replace(base, event_id=base.event_id + "3",
                                                      body=replace(turn, logprobs=pack_floats([-0.5]))))),
        ("unknown_domain", key, codec.encode(replace(base, event_id=base.event_id + "4", domain="chess",
                                                     body=started))),
        ("unknown_environment", key, codec.encode(replace(base, event_id=base.event_id + "4e",
                                                          domain="env/not-installed", body=started))),
        ("missing_field", key, codec.encode(replace(base, event_id="", body=started))),
        # an id that would name the worker's own record of its counters (streams.state.counts_key)
        ("bad_id", key, codec.encode(replace(base, event_id=base.event_id + "6", episode_id="\x00counts\x000",
                                             body=started))),
        ("bad_step", key, codec.encode(replace(base, event_id=base.event_id + "5", body=SandboxResult(
            turn=7, outcome="passed", tests_passed=1, tests_total=1, stdout="", stderr="", duration_ms=1,
            backend="subprocess")))),
        ("unknown_episode", b"ep-nobody", codec.encode(replace(base, event_id="nobody-1", episode_id="ep-nobody",
                                                              body=replace(turn, turn=0)))),
    ]


def recorded_stream(groups_per_domain: int = 2, group_size: int = 4, seed: int = 7, bad: bool = True,
                    duplicates: int = 5, run: str = "recorded") -> RecordedStream:
    """Episodes interleaved as concurrent producers would write them; bad events and re-sends mixed in."""
    rng = random.Random(seed)
    plan = groups_plan(groups_per_domain, group_size)
    stream = RecordedStream(episodes=[e for g in plan for e in g])
    _expected(stream, plan)
    queues = [events_of(ep, BASE_TS + 100 * i, run) for i, ep in enumerate(stream.episodes)]
    log: list[RolloutEvent] = []
    while any(queues):
        log.append(rng.choice([q for q in queues if q]).pop(0))
    stream.messages = [(e.episode_id.encode(), codec.encode(e)) for e in log]
    for i in sorted(rng.sample(range(len(log)), duplicates), reverse=True):  # a re-send lands after its original
        stream.messages.insert(rng.randrange(i + 1, len(stream.messages) + 1), stream.messages[i])
    stream.duplicates = duplicates
    if bad:
        victim = next(e for e in log if e.domain == "code" and isinstance(e.body, PolicyTurn))
        at = stream.messages.index((victim.episode_id.encode(), codec.encode(victim))) + 1
        for reason, key, value in reversed(bad_messages(victim)):
            stream.messages.insert(at, (key, value))
            stream.expect_reasons[reason] += 1
    return stream


def batch_record(n: int, version: int, run: str = "r") -> bytes:
    """The n-th batch record as the shard writer writes it: of rollouts of `version`, or of demonstrations (-1)."""
    return codec.encode(BatchManifest(batch_id=f"b-{version}-{n}", run=run, bucket="b", key=f"k{n}", sha256="0" * 64,
                                      size=1, num_trajectories=4, num_tokens=40, source_topic="s", partition=0,
                                      first_offset=n, last_offset=n, policy_version_min=version,
                                      policy_version_max=version, reward_mean=0.0, reward_std=0.0,
                                      trajectory_ids=(f"t{n}",), ts=1))
