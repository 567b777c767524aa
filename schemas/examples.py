"""One valid example of every event type, for smoke runs, docs and tests."""
from __future__ import annotations

import json

from schemas.keys import new_event_id
from schemas.packing import pack_floats, pack_ids
from schemas.records import (
    Body,
    EpisodeEnded,
    EpisodeStarted,
    PolicyTurn,
    RolloutEvent,
    SandboxResult,
)


def example_bodies() -> list[Body]:
    prompt = "def add(a, b):\n"
    return [
        EpisodeStarted(prompt_text=prompt, prompt_tokens=pack_ids(b + 3 for b in prompt.encode()),
                       task_spec=json.dumps({"entry_point": "add", "tests": "assert add(1, 2) == 3"}),
                       group_size=4, max_turns=2, temperature=1.0, max_new_tokens=64),
        PolicyTurn(turn=0, obs_text="", obs_tokens=b"", text="    return a + b\n",
                   tokens=pack_ids([35, 35, 35, 35, 117, 1]), logprobs=pack_floats([-0.1, -0.2, -0.3, -0.4, -0.5, -0.6]),
                   finish_reason="stop"),
        SandboxResult(turn=0, outcome="passed", tests_passed=1, tests_total=1, stdout="", stderr="",
                      duration_ms=42, backend="bwrap"),
        EpisodeEnded(status="completed", num_turns=1),
    ]


def example_events(run: str = "example", episode_id: str = "ep-1", group_id: str = "grp-1",
                   domain: str = "code", task_id: str = "HumanEval/x", policy_version: int = 0,
                   ts: int = 1_700_000_000_000) -> list[RolloutEvent]:
    return [
        RolloutEvent(event_id=new_event_id(ts + i), run=run, episode_id=episode_id, group_id=group_id,
                     task_id=task_id, domain=domain, policy_version=policy_version, producer_id="example",
                     ts=ts + i, seq=i, body=body)
        for i, body in enumerate(example_bodies())
    ]
