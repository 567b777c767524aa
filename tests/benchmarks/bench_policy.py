"""Generated tokens/s of the default small policy on CPU: 16 prompts x 64 new tokens (run as a script)."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from producers.policy import Sampling, make_backend  # noqa: E402
from tests.benchmarks.report import Figure, record  # noqa: E402


def _prompts(count: int) -> list[str]:
    return [f"Task {i}: compute {17 * i} + {29 + i} and explain." for i in range(count)]


def run(prompts: int, new_tokens: int, threads: int, repeats: int) -> list[Figure]:
    torch.set_num_threads(threads)
    backend = make_backend("transformers", seed=0)  # tiny_llama_config(): 4 layers, width 256
    params = sum(p.numel() for p in backend.model.parameters())  # type: ignore[attr-defined]
    batch = _prompts(prompts)
    backend.generate(batch[:2], 1, Sampling(max_new_tokens=4, seed=0))  # warm-up
    figures = []
    for temperature in (1.0, 0.0):
        sampling = Sampling(temperature=temperature, max_new_tokens=new_tokens, seed=1)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            groups = backend.generate(batch, 1, sampling)
            best = min(best, time.perf_counter() - start)
        generated = sum(len(g.tokens) for group in groups for g in group)
        print(f"policy/transformers params={params / 1e6:.2f}M threads={threads} prompts={prompts} "
              f"new_tokens={new_tokens} T={temperature}: {generated} tokens in {best:.3f}s "
              f"= {generated / best:,.0f} tokens/s")
        figures.append(Figure("generated tokens/s, " + ("sampling (T=1)" if temperature else "greedy"),
                              generated / best, "tokens/s"))
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    started = time.monotonic()
    figures = run(args.prompts, args.new_tokens, args.threads, args.repeats)
    record("bench_policy", f"tiny Llama 4x256 on CPU, {args.prompts} prompts x {args.new_tokens} new tokens, "
           f"{args.threads} threads", figures, started)


if __name__ == "__main__":
    main()
