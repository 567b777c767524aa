"""Real pretrained weights from a registry package: SmolLM2-135M-Instruct's GGUF, verified and converted once."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from learner.pretrained import convert, gguf_path
from producers.policy import make_backend
from producers.policy.interface import Sampling
from schemas.errors import IntegrityError
from schemas.models import PRETRAINED


@pytest.fixture(scope="module")
def conversions(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[tuple[int, str, str]]]:
    """Two conversions into the same folder at once (two demos starting on one cache), beside the temporary
    folder a conversion killed mid-way left: (folder, [(exit code, stdout, stderr)] of each)."""
    out = tmp_path_factory.mktemp("models") / "smollm2-135m"
    (out.parent / "smollm2-135m.partial-killed").mkdir()
    procs = [subprocess.Popen([sys.executable, "-m", "learner.pretrained", "smollm2-135m", "--out", str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=600)
        results.append((proc.returncode, stdout, stderr))
    return out, results


@pytest.fixture(scope="module")
def smollm(conversions: tuple[Path, list[tuple[int, str, str]]]) -> Path:
    return conversions[0]


def test_two_conversions_at_once_take_turns_and_leave_one_whole_folder(
        conversions: tuple[Path, list[tuple[int, str, str]]]) -> None:
    out, results = conversions
    assert [code for code, _, _ in results] == [0, 0], [stderr[-2000:] for _, _, stderr in results]
    assert [stdout.strip() for _, stdout, _ in results] == [str(out)] * 2
    assert sum("waiting for another conversion" in stderr for _, _, stderr in results) == 1
    assert sum("converted " in stderr for _, _, stderr in results) == 1  # the second found the first's folder
    assert not [p.name for p in out.parent.iterdir() if "partial" in p.name]


def test_the_converted_folder_loads_with_from_pretrained_model_and_tokenizer(smollm: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(smollm, local_files_only=True)
    assert (model.config.num_hidden_layers, model.config.hidden_size, model.config.vocab_size) == (30, 576, 49152)
    assert not getattr(model, "is_quantized", False) and (smollm / "model.safetensors").is_file()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], tokenize=False,
                                           add_generation_prompt=True)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all()
    assert convert("smollm2-135m", smollm) == smollm  # converted once: the second call reuses the folder


def test_the_policy_backend_generates_with_it(smollm: Path) -> None:
    backend = make_backend("transformers", str(smollm), seed=0)
    out = backend.generate(["The capital of France is"], n=2, sampling=Sampling(temperature=1.0, max_new_tokens=6,
                                                                                  seed=1))
    assert len(out[0]) == 2 and all(len(g.tokens) == len(g.logprobs) > 0 for g in out[0])
    assert all(lp <= 0 for g in out[0] for lp in g.logprobs)


def test_a_file_that_is_not_the_pinned_one_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / PRETRAINED["smollm2-135m"]["file"]
    fake.write_bytes(b"GGUF" + b"\0" * 64)
    monkeypatch.setattr("learner.pretrained.gguf_path", lambda name: fake)
    with pytest.raises(IntegrityError, match="sha256"):
        convert("smollm2-135m", tmp_path / "out")
    assert gguf_path("smollm2-135m").stat().st_size > 90_000_000


def test_prompts_use_its_chat_template_and_demonstrations_end_its_turn(smollm: Path) -> None:
    from producers.policy.tokenizer import PolicyTokenizer, load_hf_tokenizer

    tokenizer = PolicyTokenizer(load_hf_tokenizer(smollm))
    text = tokenizer.hf.decode(tokenizer.prompt("What is 2 + 3?"))
    assert "<|im_start|>user\nWhat is 2 + 3?<|im_end|>" in text and text.rstrip().endswith("<|im_start|>assistant")
    answer = tokenizer.completion("5")
    assert answer[-1] in tokenizer.eos_token_ids and tokenizer.decode(answer) == "5"
