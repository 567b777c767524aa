"""The learner's log-probs of rollout tokens equal the behaviour log-probs the rollout worker recorded,
at the same weights and temperature: the importance ratio starts at exactly 1."""
from __future__ import annotations

import pytest
import torch

from learner.batching import collate
from learner.losses import token_logprobs
from learner.model import build_policy
from producers.episodes import EpisodeRunner
from producers.policy import make_backend
from producers.settings import WorkerSettings
from producers.tasks import load_source
from schemas.models import tiny_llama_config
from schemas.records import RolloutEvent, SourcePosition
from streams import assembly


class NoCode:
    def run_many(self, jobs):  # type: ignore[no-untyped-def]
        raise AssertionError("math tasks run no code")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_learner_recomputes_the_recorded_behaviour_logprobs(temperature: float) -> None:
    config = tiny_llama_config(layers=2, width=64)
    backend = make_backend("transformers", None, seed=3, config=config)
    learner_model = build_policy(layers=2, width=64, seed=0)
    learner_model.load_state_dict(backend.model.state_dict())  # type: ignore[attr-defined]
    events: list[RolloutEvent] = []
    settings = WorkerSettings(ns="t", producer_id="t", group_size=4, max_new_tokens=12, temperature=temperature)
    EpisodeRunner(backend, NoCode(), events.append, settings).run_step(
        [load_source("math-easy")[i] for i in range(3)] + [load_source("table", seed=2)[0]])
    states: dict[str, assembly.EpisodeState] = {}
    for i, ev in enumerate(events):
        states[ev.episode_id] = assembly.fold(states.get(ev.episode_id), ev, SourcePosition(0, i))
    trajectories = [assembly.to_trajectory(s, "t") for s in states.values()]
    batch = collate([(t, 1.0) for t in trajectories], max_len=4096)
    learner_model.eval()
    with torch.no_grad():
        recomputed = token_logprobs(learner_model, batch.input_ids, batch.attention_mask, temperature=temperature)
    mask = batch.loss_mask.bool()
    assert mask.sum() > 40
    gap = (recomputed[mask] - batch.old_logprobs[mask]).abs().max().item()
    assert gap < 1e-4, f"ratio would start at exp({gap}) instead of 1"
