"""Math tasks: seeded reasoning-gym arithmetic generators, and a built-in single-digit addition level."""
from __future__ import annotations

import random
from typing import Any, Mapping, Sequence

from producers.tasks.task import Task
from schemas.tasks import make_spec

DEFAULT_GENERATORS = ("basic_arithmetic", "chain_sum")


class ReasoningGymSource:
    """Interleaves the generators: index i is item i // n of generator i % n (n generators).

    reasoning-gym items are a pure function of (generator, seed, index), so the same seed gives the same
    tasks. The spec records the gold answer string; scoring compares answers and never calls reasoning-gym.
    """

    name = "math"
    domain = "math"

    def __init__(self, generators: Sequence[str] = DEFAULT_GENERATORS, seed: int = 0, size: int = 500,
                 config: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        import reasoning_gym  # imported here: it is slow to import and only this source needs it

        if not generators:
            raise ValueError("ReasoningGymSource needs at least one generator name")
        config = config or {}
        self.seed, self.size, self.generators = seed, size, tuple(generators)
        self._datasets = [reasoning_gym.create_dataset(g, seed=seed, size=size, **config.get(g, {}))
                          for g in self.generators]

    def __len__(self) -> int:
        return self.size * len(self.generators)

    def __getitem__(self, index: int) -> Task:
        if not 0 <= index < len(self):
            raise IndexError(f"math task index {index} out of range 0..{len(self) - 1}")
        which, item_index = index % len(self.generators), index // len(self.generators)
        generator = self.generators[which]
        item = self._datasets[which][item_index]
        spec = make_spec("math", answer=str(item["answer"]), source=f"reasoning_gym:{generator}",
                         seed=self.seed, index=item_index)
        return Task(task_id=f"{generator}/{self.seed}/{item_index}", domain="math",
                    prompt=f"{item['question']}\nAnswer:", spec=spec, demonstration=f" {item['answer']}")


class _ShuffledPairs:
    """Every (a, b) pair of an addition source, in an order shuffled by `seed`."""

    def __init__(self, pairs: list[tuple[int, int]], seed: int) -> None:
        random.Random(seed).shuffle(pairs)
        self.seed, self._pairs = seed, pairs

    def __len__(self) -> int:
        return len(self._pairs)


class DigitAdditionSource(_ShuffledPairs):
    """Prompts "a+b=" with a + b <= 9, so the answer is one digit: learnable by a byte-level CPU model in minutes.

    All 55 pairs, in an order shuffled by `seed`.
    """

    name = "math-easy"
    domain = "math"

    def __init__(self, seed: int = 0, max_sum: int = 9) -> None:
        super().__init__([(a, b) for a in range(10) for b in range(10) if a + b <= max_sum], seed)

    def __getitem__(self, index: int) -> Task:
        a, b = self._pairs[index]
        spec = make_spec("math", answer=str(a + b), source="builtin:digit_add", seed=self.seed, index=index)
        return Task(task_id=f"digit_add/{a}+{b}", domain="math", prompt=f"{a}+{b}=", spec=spec,
                    demonstration=str(a + b))


class QuestionAdditionSource(_ShuffledPairs):
    """"What is a + b?" for a, b in 1..20, asked in words: a pretrained chat model's level (SmolLM2-135M
    answers about a third of them greedily in 32 tokens), with room for RL to teach short, right answers.

    All 400 pairs, in an order shuffled by `seed`.
    """

    name = "add"
    domain = "math"

    def __init__(self, seed: int = 0, low: int = 1, high: int = 20) -> None:
        super().__init__([(a, b) for a in range(low, high + 1) for b in range(low, high + 1)], seed)

    def __getitem__(self, index: int) -> Task:
        a, b = self._pairs[index]
        spec = make_spec("math", answer=str(a + b), source="builtin:add", seed=self.seed, index=index)
        return Task(task_id=f"add/{a}+{b}", domain="math", prompt=f"What is {a} + {b}? Answer with the number only.",
                    spec=spec, demonstration=str(a + b))
