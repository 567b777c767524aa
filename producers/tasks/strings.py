"""String tasks: reverse a short lowercase word. A byte-level CPU model learns the rule (not a lookup) in minutes.

    source = StringReversalSource(seed=0)
    source[3].prompt == "reverse hyt:"; source[3].spec["answer"] == "tyh"

Every index gives a fresh random word of 3..6 letters, so the held-out split (a hash of the task id) holds
words the policy never trained on: success there means it learned to reverse, not to remember.

`reverse-N` (for example `--sources reverse-3,reverse-4,reverse-5,reverse-6`) holds the words of N letters
only: one source per length, so the curriculum retires a length once the policy always solves it and spends
the rollouts on the lengths it does not. A word's task id is the same in both forms, and so is its split.

The 3M-parameter model learns the lengths in order, each with a jump whose timing varies from run to run,
and GRPO on two cores moves the frontier by one length at most, and not in every run: from the same
post-SFT weights (6-letter words at 0.02 held-out greedy), 40 GRPO updates of 512 trajectories took 5-letter
words from 0.16 to 0.94 and left 6-letter words at 0.03 (learning rate 3e-4), 0.00 (1e-3), 0.02 (rollouts
weighted towards 5 and 6 letters) and 0.03 (temperature 0.7).
"""
from __future__ import annotations

import random
import string
from typing import Any

from producers.tasks.task import Task
from schemas.errors import ConfigError
from schemas.tasks import make_spec


LENGTH_PREFIX = "reverse-"
MAX_LENGTH = 12


def by_length(name: str, **kwargs: Any) -> "StringReversalSource":
    """`reverse-N`: the words of exactly N letters (1 <= N <= 12)."""
    length = name.removeprefix(LENGTH_PREFIX)
    if not length.isdigit() or not 1 <= int(length) <= MAX_LENGTH:
        raise ConfigError(f"task source {name!r}: reverse-N takes a word length N from 1 to {MAX_LENGTH}")
    return StringReversalSource(min_len=int(length), max_len=int(length), name=name, **kwargs)


class StringReversalSource:
    domain = "text"

    def __init__(self, seed: int = 0, size: int = 20_000, min_len: int = 3, max_len: int = 6,
                 name: str = "reverse") -> None:
        if not 1 <= min_len <= max_len:
            raise ValueError(f"word lengths {min_len}..{max_len}: need 1 <= min_len <= max_len")
        self.seed, self.size, self.min_len, self.max_len, self.name = seed, size, min_len, max_len, name

    def __len__(self) -> int:
        return self.size

    def word(self, index: int) -> str:
        rng = random.Random(f"reverse/{self.seed}/{index}")
        return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(self.min_len, self.max_len)))

    def task_id(self, index: int) -> str:
        """Task `index`'s id without making the task: the split reads every index's id when a worker starts."""
        # The id is the word itself: the same word drawn twice is one task, on one side of the split.
        return f"reverse/{self.word(index)}"

    def __getitem__(self, index: int) -> Task:
        if not 0 <= index < self.size:
            raise IndexError(f"reverse task index {index} out of range 0..{self.size - 1}")
        word = self.word(index)
        spec = make_spec("text", answer=word[::-1], source=f"builtin:{self.name}", seed=self.seed, index=index)
        return Task(task_id=f"reverse/{word}", domain="text", prompt=f"reverse {word}:", spec=spec,
                    demonstration=word[::-1])
