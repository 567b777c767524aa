"""GPU-host check of the vLLM policy backend: generate, hot-load weights, compare log-probs with transformers.

Not a pytest module (no test_ prefix): run it on a GPU host whose environment has vllm and this project:

    python tests/gpu/check_vllm.py [--prompts 64 --n 4 --new-tokens 128 --dtype float32 --tol 1e-3]

It builds the small policy model, saves it with ByT5 tokenizer files to a temporary directory, serves it
with the vLLM backend, samples, checks lengths/EOS/log-probs against a teacher-forced transformers pass,
hot-loads perturbed weights (outputs must change, log-probs must match the perturbed reference), loads the
original weights back from a safetensors file (greedy outputs must return), and prints figures and
PASS or FAIL. Exit status: 0 pass, 1 fail, 2 vllm missing.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from producers.policy import Generation, Sampling, build_tiny_model, make_backend, save_pretrained_dir  # noqa: E402
from producers.policy.tokenizer import load_hf_tokenizer  # noqa: E402
from producers.policy.weights import copy_state, unaliased, write_state_file  # noqa: E402
from schemas.models import EOS_ID  # noqa: E402

Groups = list[list[Generation]]


class Report:
    """Collects named checks and figures; PASS only if every check held."""

    def __init__(self) -> None:
        self.failures: list[str] = []

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        print(f"  [{'ok' if ok else 'FAIL'}] {name}" + (f": {detail}" if detail else ""))
        if not ok:
            self.failures.append(name)

    @staticmethod
    def figure(name: str, value: str) -> None:
        print(f"  {name}: {value}")


def _prompt_ids(backend: Any, count: int) -> list[list[int]]:
    return [backend.tokenizer.encode(f"Task {i}: add {13 * i} and {7 + i}, then explain.") for i in range(count)]


def _timed_generate(backend: Any, prompts: list[list[int]], n: int, sampling: Sampling) -> tuple[Groups, float]:
    start = time.perf_counter()
    groups = backend.generate(prompts, n, sampling)
    return groups, time.perf_counter() - start


def _check_shapes(report: Report, groups: Groups, prompts: int, n: int, max_new: int) -> None:
    gens = [g for group in groups for g in group]
    report.check("one group of n per prompt", len(groups) == prompts and all(len(g) == n for g in groups))
    report.check("one log-prob per token", all(len(g.tokens) == len(g.logprobs) >= 1 for g in gens))
    report.check("log-probs finite and <= 0", all(math.isfinite(x) and x <= 1e-6 for g in gens for x in g.logprobs))
    stops = [g for g in gens if g.finish_reason == "stop"]
    report.check("'stop' ends with EOS, only there",
                 all(g.tokens[-1] == EOS_ID and EOS_ID not in g.tokens[:-1] for g in stops), f"{len(stops)} stopped")
    report.check("'length' ran to max_new_tokens without EOS",
                 all(len(g.tokens) == max_new and EOS_ID not in g.tokens for g in gens if g.finish_reason == "length"))


@torch.no_grad()
def _max_logprob_gap(model: Any, prompts: list[list[int]], groups: Groups, temperature: float, limit: int) -> float:
    """Largest |recorded - teacher-forced log_softmax(logits / T)| over up to `limit` completions."""
    worst, seen = 0.0, 0
    for prompt, group in zip(prompts, groups):
        for gen in group:
            if seen == limit:
                return worst
            ids = torch.tensor([prompt + gen.tokens], device=model.device)
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
            expected = torch.log_softmax(logits / temperature, dim=-1)
            expected = expected.gather(-1, torch.tensor(gen.tokens, device=model.device).unsqueeze(-1)).squeeze(-1)
            worst = max(worst, (expected.cpu() - torch.tensor(gen.logprobs)).abs().max().item())
            seen += 1
    return worst


def _perturbed(model: Any, scale: float) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    base = unaliased(model.state_dict())
    return {name: t + scale * torch.randn(t.shape, generator=generator, dtype=t.dtype) for name, t in base.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--dtype", default="float32", help="vLLM downcasts float32 models under 'auto'")
    parser.add_argument("--tol", type=float, default=1e-3, help="log-prob gap allowed (use ~5e-2 for bfloat16)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--eager", action="store_true", help="enforce_eager: skip CUDA graph capture")
    args = parser.parse_args()
    if importlib.util.find_spec("vllm") is None:
        print("FAIL: vllm is not installed in this environment (pip install 'trajpipe[vllm]')")
        return 2
    report = Report()
    with tempfile.TemporaryDirectory(prefix="check-vllm-") as tmp:
        run(args, Path(tmp), report)
    print("PASS" if not report.failures else f"FAIL: {', '.join(report.failures)}")
    return 0 if not report.failures else 1


def run(args: argparse.Namespace, tmp: Path, report: Report) -> None:
    import vllm

    print(f"vllm {vllm.__version__}, torch {torch.__version__}, device {torch.cuda.get_device_name(0)}")
    reference = build_tiny_model(seed=0)
    model_dir = save_pretrained_dir(reference, load_hf_tokenizer(None), tmp / "model")
    write_state_file(reference.state_dict(), tmp / "original.safetensors")
    reference = reference.to("cuda")
    start = time.perf_counter()
    backend = make_backend("vllm", model_dir=str(model_dir), seed=0, dtype=args.dtype, max_model_len=1024,
                           gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.eager)
    report.figure("engine start", f"{time.perf_counter() - start:.1f}s")
    prompts = _prompt_ids(backend, args.prompts)
    sampling = Sampling(temperature=args.temperature, max_new_tokens=args.new_tokens, seed=1)
    greedy = Sampling(temperature=0.0, max_new_tokens=32)

    backend.generate(prompts[:2], 1, Sampling(max_new_tokens=4, seed=0))  # warm-up
    groups, seconds = _timed_generate(backend, prompts, args.n, sampling)
    tokens = sum(len(g.tokens) for group in groups for g in group)
    report.figure("sampling", f"{args.prompts} prompts x n={args.n}: {tokens} tokens in {seconds:.2f}s "
                              f"= {tokens / seconds:,.0f} tokens/s")
    _check_shapes(report, groups, args.prompts, args.n, args.new_tokens)
    gap = _max_logprob_gap(reference, prompts, groups, args.temperature, limit=64)
    report.check("log-probs equal a transformers recompute", gap <= args.tol, f"max gap {gap:.2e}")
    again, _ = _timed_generate(backend, prompts, args.n, sampling)
    report.check("same seed, same samples", again == groups)
    before, _ = _timed_generate(backend, prompts, 1, greedy)

    perturbed = _perturbed(reference, scale=0.5)
    start = time.perf_counter()
    backend.load_weights(perturbed, version=1)
    report.figure("hot load (state dict)", f"{time.perf_counter() - start:.2f}s")
    copy_state(reference, perturbed)
    after, _ = _timed_generate(backend, prompts, 1, greedy)
    report.check("version follows the load", backend.version == 1)
    report.check("outputs change after the hot load", after != before)
    groups, _ = _timed_generate(backend, prompts, args.n, sampling)
    gap = _max_logprob_gap(reference, prompts, groups, args.temperature, limit=64)
    report.check("log-probs match the new weights", gap <= args.tol, f"max gap {gap:.2e}")

    start = time.perf_counter()
    backend.load_weights(tmp / "original.safetensors", version=2)
    report.figure("hot load (safetensors file)", f"{time.perf_counter() - start:.2f}s")
    restored, _ = _timed_generate(backend, prompts, 1, greedy)
    same = sum(a[0].tokens == b[0].tokens for a, b in zip(restored, before))
    report.check("original weights from a file restore greedy outputs", same == len(before),
                 f"{same}/{len(before)} identical")


if __name__ == "__main__":
    sys.exit(main())
