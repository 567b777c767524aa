"""Policy backends on a tiny real model: lengths, exact behaviour log-probs, EOS, seeding, hot loads."""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Iterator

import pytest
import torch
from safetensors.torch import save_file

from producers.policy import Generation, PolicyBackend, Sampling, make_backend, save_pretrained_dir
from producers.policy.hf_backend import TransformersBackend
from producers.policy.sampling import nucleus_filter
from producers.policy.weights import unaliased
from schemas.errors import CheckpointError, ConfigError
from schemas.models import EOS_ID, tiny_llama_config

TINY = tiny_llama_config(layers=2, width=64)
PROMPTS = [[104, 105, 106, 107, 108], [50], [70, 71]]  # different lengths: left padding is exercised


@pytest.fixture(scope="module", autouse=True)
def _few_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny model, shared cores
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def backend() -> TransformersBackend:
    made = make_backend("transformers", seed=0, config=TINY)
    assert isinstance(made, TransformersBackend)
    return made


def _fresh(tied: bool = True) -> TransformersBackend:
    made = make_backend("transformers", seed=0, config={**TINY, "tie_word_embeddings": tied})
    assert isinstance(made, TransformersBackend)
    return made


@pytest.fixture(scope="module")
def peaked() -> TransformersBackend:
    """The tiny model with large random weights: a far from uniform next-token distribution."""
    policy = _fresh()
    generator = torch.Generator().manual_seed(0)
    base = unaliased(policy.model.state_dict())
    policy.load_weights({k: v + 0.5 * torch.randn(v.shape, generator=generator) for k, v in base.items()}, 1)
    return policy


def _teacher_forced(backend: TransformersBackend, prompt: list[int], gen: Generation, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of the generated tokens, from one unpadded forward pass without a cache."""
    ids = torch.tensor([prompt + gen.tokens])
    with torch.no_grad():
        logits = backend.model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return logprobs.gather(-1, torch.tensor(gen.tokens).unsqueeze(-1)).squeeze(-1)


def _always_eos_state(backend: TransformersBackend, eos_logit: float) -> dict[str, torch.Tensor]:
    """Weights (of an untied model) under which every step has logit `eos_logit` for EOS, 0 for the rest."""
    state = {k: v.clone() for k, v in backend.model.state_dict().items()}
    for name in state:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            state[name].zero_()  # every layer adds nothing: the final hidden state is the embedding
    state["model.embed_tokens.weight"].fill_(1.0)  # ... which RMSNorm maps to all ones
    state["lm_head.weight"].zero_()
    state["lm_head.weight"][EOS_ID] = eos_logit / TINY["hidden_size"]
    return state


def test_backend_satisfies_the_protocol(backend: TransformersBackend) -> None:
    assert isinstance(backend, PolicyBackend)
    assert backend.version == 0


def test_n_samples_per_prompt_with_one_logprob_per_token(backend: TransformersBackend) -> None:
    groups = backend.generate(PROMPTS, n=3, sampling=Sampling(temperature=1.0, max_new_tokens=6, seed=1))
    assert len(groups) == len(PROMPTS) and all(len(group) == 3 for group in groups)
    for group in groups:
        for gen in group:
            assert 1 <= len(gen.tokens) <= 6 and len(gen.logprobs) == len(gen.tokens)
            assert all(math.isfinite(lp) and lp <= 0.0 for lp in gen.logprobs)
            assert gen.text == backend.tokenizer.decode(gen.tokens)
        assert len({tuple(gen.tokens) for gen in group}) > 1  # the n samples are distinct draws


@pytest.mark.parametrize("policy_name", ["backend", "peaked"])
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9), (1.5, 1.0)])
def test_recorded_logprobs_equal_teacher_forced_recomputation(
    request: pytest.FixtureRequest, policy_name: str, temperature: float, top_p: float
) -> None:
    policy: TransformersBackend = request.getfixturevalue(policy_name)
    sampling = Sampling(temperature=temperature, top_p=top_p, max_new_tokens=12, seed=3)
    groups = policy.generate(PROMPTS, n=2, sampling=sampling)
    for prompt, group in zip(PROMPTS, groups):
        for gen in group:
            expected = _teacher_forced(policy, prompt, gen, temperature)
            assert torch.allclose(torch.tensor(gen.logprobs), expected, atol=1e-4, rtol=0.0)


def test_greedy_is_argmax_deterministic_and_reports_temperature_one(peaked: TransformersBackend) -> None:
    # The peaked model: a near-uniform one would leave argmax at the mercy of float rounding.
    sampling = Sampling(temperature=0.0, max_new_tokens=8)
    first = peaked.generate(PROMPTS, n=2, sampling=sampling)
    assert first == peaked.generate(PROMPTS, n=2, sampling=sampling)
    for prompt, group in zip(PROMPTS, first):
        assert group[0] == group[1]
        gen = group[0]
        ids = torch.tensor([prompt + gen.tokens])
        with torch.no_grad():
            logits = peaked.model(input_ids=ids).logits[0, len(prompt) - 1:-1]
        assert gen.tokens == logits.argmax(dim=-1).tolist()
        expected = _teacher_forced(peaked, prompt, gen, temperature=1.0)
        assert torch.allclose(torch.tensor(gen.logprobs), expected, atol=1e-4, rtol=0.0)


def test_a_tiny_temperature_is_greedy(backend: TransformersBackend) -> None:
    greedy = backend.generate(PROMPTS, n=1, sampling=Sampling(temperature=0.0, max_new_tokens=6))
    near_zero = backend.generate(PROMPTS, n=1, sampling=Sampling(temperature=1e-6, max_new_tokens=6, seed=9))
    assert [g[0].tokens for g in greedy] == [g[0].tokens for g in near_zero]


def test_seeded_sampling_is_reproducible(backend: TransformersBackend) -> None:
    def run(seed: int) -> list[list[Generation]]:
        return backend.generate(PROMPTS, n=2, sampling=Sampling(temperature=1.0, max_new_tokens=8, seed=seed))

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_batch_size_does_not_change_logprob_exactness() -> None:
    small_batches = _fresh()
    small_batches.max_batch_size = 2
    groups = small_batches.generate(PROMPTS, n=3, sampling=Sampling(temperature=1.0, max_new_tokens=5, seed=2))
    assert [len(g) for g in groups] == [3, 3, 3]
    for prompt, group in zip(PROMPTS, groups):
        for gen in group:
            expected = _teacher_forced(small_batches, prompt, gen, 1.0)
            assert torch.allclose(torch.tensor(gen.logprobs), expected, atol=1e-4, rtol=0.0)


def test_text_prompts_equal_their_token_ids(backend: TransformersBackend) -> None:
    sampling = Sampling(temperature=0.0, max_new_tokens=5)
    ids = backend.tokenizer.encode("2+2=")
    assert ids and EOS_ID not in ids  # ByT5 appends EOS; a prompt must not carry it
    assert backend.generate(["2+2="], 1, sampling) == backend.generate([ids], 1, sampling)


def test_eos_stops_a_sequence_and_is_kept_with_its_logprob() -> None:
    policy = _fresh(tied=False)
    policy.load_weights(_always_eos_state(policy, eos_logit=40.0), version=1)
    gen = policy.generate([[60, 61]], n=1, sampling=Sampling(temperature=1.0, max_new_tokens=10, seed=0))[0][0]
    assert gen.tokens == [EOS_ID] and gen.finish_reason == "stop" and gen.text == ""
    assert -1e-4 < gen.logprobs[0] <= 0.0


def test_rows_of_one_batch_stop_independently() -> None:
    policy = _fresh(tied=False)
    # p(EOS) = 0.15 per step: some of 16 samples stop early, others run to the length cap.
    policy.load_weights(_always_eos_state(policy, eos_logit=math.log(0.15 / 0.85 * 383)), version=1)
    sampling = Sampling(temperature=1.0, max_new_tokens=6, seed=4)
    group = policy.generate([[60, 61]], n=16, sampling=sampling)[0]
    reasons = {gen.finish_reason for gen in group}
    assert reasons == {"stop", "length"}
    for gen in group:
        eos_at = [i for i, t in enumerate(gen.tokens) if t == EOS_ID]
        if gen.finish_reason == "stop":
            assert eos_at == [len(gen.tokens) - 1]
        else:
            assert eos_at == [] and len(gen.tokens) == sampling.max_new_tokens
        expected = _teacher_forced(policy, [60, 61], gen, 1.0)
        assert torch.allclose(torch.tensor(gen.logprobs), expected, atol=1e-4, rtol=0.0)


def test_hot_load_changes_version_and_outputs(tmp_path: Path) -> None:
    policy = _fresh()
    greedy = Sampling(temperature=0.0, max_new_tokens=8)
    before = policy.generate(PROMPTS, 1, greedy)
    generator = torch.Generator().manual_seed(0)
    # unaliased: the tied embedding / lm_head pair is perturbed once and stays tied.
    base = unaliased(policy.model.state_dict())
    perturbed = {k: v + 0.5 * torch.randn(v.shape, generator=generator) for k, v in base.items()}
    policy.load_weights(perturbed, version=1)
    after = policy.generate(PROMPTS, 1, greedy)
    assert policy.version == 1 and after != before
    # The same weights from a safetensors file give the same policy.
    other = _fresh()
    save_file(perturbed, str(tmp_path / "model.safetensors"))
    other.load_weights(tmp_path / "model.safetensors", version=2)
    assert other.version == 2 and other.generate(PROMPTS, 1, greedy) == after


def test_a_state_that_does_not_fit_is_refused_and_changes_nothing() -> None:
    policy = _fresh()
    greedy = Sampling(temperature=0.0, max_new_tokens=6)
    before = policy.generate(PROMPTS, 1, greedy)
    state = {k: torch.zeros_like(v) for k, v in policy.model.state_dict().items()}
    state["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(CheckpointError, match="wrong shape"):
        policy.load_weights(state, version=7)
    del state["model.norm.weight"]
    with pytest.raises(CheckpointError, match="missing"):
        policy.load_weights(state, version=7)
    assert policy.version == 0 and policy.generate(PROMPTS, 1, greedy) == before


def test_loading_from_a_saved_local_dir(backend: TransformersBackend, tmp_path: Path) -> None:
    greedy = Sampling(temperature=0.0, max_new_tokens=8)
    expected = backend.generate(PROMPTS, 1, greedy)
    with_tokenizer = save_pretrained_dir(backend.model, backend.tokenizer, tmp_path / "with")
    assert (with_tokenizer / "config.json").is_file() and (with_tokenizer / "model.safetensors").is_file()
    assert not list(with_tokenizer.glob("*.bin"))
    without_tokenizer = save_pretrained_dir(backend.model, None, tmp_path / "without")
    for model_dir in (with_tokenizer, without_tokenizer):
        loaded = make_backend("transformers", model_dir=str(model_dir), seed=123)
        assert loaded.generate(PROMPTS, 1, greedy) == expected
        assert loaded.tokenizer.encode("héllo") == backend.tokenizer.encode("héllo")


def test_unknown_backend_name_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="unknown policy backend 'tensorrt'.*transformers, vllm"):
        make_backend("tensorrt")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_vllm_without_the_extra_says_how_to_install_it() -> None:
    with pytest.raises(ConfigError, match=r"`vllm` extra.*own"):
        make_backend("vllm")


@pytest.mark.parametrize("kwargs", [{"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"max_new_tokens": 0}])
def test_invalid_sampling_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        Sampling(**kwargs)  # type: ignore[arg-type]


def test_prompt_problems_are_refused(backend: TransformersBackend) -> None:
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        backend.generate([[5], []], 1, Sampling(max_new_tokens=2))
    with pytest.raises(ConfigError, match="positions"):
        backend.generate([[5] * (TINY["max_position_embeddings"] - 10)], 1, Sampling(max_new_tokens=11))


def test_nucleus_keeps_the_smallest_set_reaching_top_p() -> None:
    logprobs = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = nucleus_filter(logprobs, 0.75).isfinite()
    assert kept.tolist() == [[True, True, False, False]]
    assert nucleus_filter(logprobs, 0.01).isfinite().tolist() == [[True, False, False, False]]


class _FakeSamplingParams:
    def __init__(self, **kw: object) -> None:
        self.kw = kw


class _FakeLLM:
    """Stands in for vllm.LLM: records calls, answers `n` completions [7, EOS] per prompt."""

    def __init__(self, **kw: object) -> None:
        self.kw = kw
        self.params: list[dict[str, object]] = []
        self.loaded: list[tuple[str, list[str]]] = []
        self.resets = 0

    def generate(self, prompts: list[dict[str, list[int]]], params: list[_FakeSamplingParams], use_tqdm: bool) -> list[object]:
        from types import SimpleNamespace as NS

        self.params = [p.kw for p in params]
        step = {7: NS(logprob=-0.5), EOS_ID: NS(logprob=-0.25)}
        completion = NS(token_ids=[7, EOS_ID], logprobs=[step, step], finish_reason="stop")
        return [NS(outputs=[completion] * int(p.kw["n"])) for p in params]  # type: ignore[call-overload]

    def collective_rpc(self, method: str, args: tuple[str]) -> list[int]:
        from safetensors import safe_open

        with safe_open(args[0], framework="pt") as handle:
            self.loaded.append((method, sorted(handle.keys())))
        return [len(self.loaded[-1][1])]

    def reset_prefix_cache(self) -> None:
        self.resets += 1


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch, backend: TransformersBackend, tmp_path: Path) -> object:
    import importlib.machinery
    import sys
    import types

    module = types.ModuleType("vllm")
    module.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    module.LLM = _FakeLLM  # type: ignore[attr-defined]
    module.SamplingParams = _FakeSamplingParams  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", module)
    model_dir = save_pretrained_dir(backend.model, backend.tokenizer, tmp_path / "served")
    return make_backend("vllm", model_dir=str(model_dir), seed=3)


def test_vllm_adapter_maps_sampling_and_outputs(fake_vllm: object) -> None:
    from producers.policy.vllm_backend import EXTENSION, LOGPROBS_MODE, VLLMBackend

    assert isinstance(fake_vllm, VLLMBackend) and isinstance(fake_vllm, PolicyBackend)
    llm = fake_vllm._llm
    assert llm.kw["logprobs_mode"] == LOGPROBS_MODE and llm.kw["worker_extension_cls"] == EXTENSION
    groups = fake_vllm.generate([[8], [9, 9]], n=3, sampling=Sampling(temperature=0.8, max_new_tokens=5, seed=10))
    assert [p["seed"] for p in llm.params] == [10, 13]  # children get seed + index: ranges stay disjoint
    assert llm.params[0]["logprobs"] == 0 and llm.params[0]["stop_token_ids"] == [EOS_ID]
    assert groups[1][2] == Generation([7, EOS_ID], [-0.5, -0.25], "\x04", "stop")
    greedy = fake_vllm.generate([[9]], n=4, sampling=Sampling(temperature=0.0, max_new_tokens=5))
    assert llm.params[0]["n"] == 1 and len(greedy[0]) == 4
    with pytest.raises(ConfigError, match="top_p"):
        fake_vllm.generate([[9]], n=2, sampling=Sampling(temperature=1.0, top_p=0.9))


def test_vllm_adapter_checks_then_reloads_weights(fake_vllm: object, backend: TransformersBackend) -> None:
    from producers.policy.vllm_backend import RELOAD_METHOD, VLLMBackend

    assert isinstance(fake_vllm, VLLMBackend)
    llm = fake_vllm._llm
    bad = {k: v for k, v in backend.model.state_dict().items() if "norm" not in k}
    with pytest.raises(CheckpointError, match="missing"):
        fake_vllm.load_weights(bad, version=1)
    assert llm.loaded == [] and fake_vllm.version == 0
    fake_vllm.load_weights(backend.model.state_dict(), version=1)  # tied lm_head.weight is dropped
    assert llm.loaded[0][0] == RELOAD_METHOD and "lm_head.weight" not in llm.loaded[0][1]
    assert llm.resets == 1 and fake_vllm.version == 1
