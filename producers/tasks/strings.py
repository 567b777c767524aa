"""String tasks: reverse a short lowercase word. A byte-level CPU model learns the rule (not a lookup) in minutes.

    source = StringReversalSource(seed=0)
    source[3].prompt == "reverse qzkd:"; source[3].spec["answer"] == "dkzq"

Every index gives a fresh random word of 3..6 letters, so the held-out split (a hash of the task id) holds
words the policy never trained on: success there means it learned to reverse, not to remember.
"""
from __future__ import annotations

import random
import string

from producers.tasks.task import Task
from schemas.tasks import make_spec


class StringReversalSource:
    name = "reverse"
    domain = "text"

    def __init__(self, seed: int = 0, size: int = 20_000, min_len: int = 3, max_len: int = 6) -> None:
        if not 1 <= min_len <= max_len:
            raise ValueError(f"word lengths {min_len}..{max_len}: need 1 <= min_len <= max_len")
        self.seed, self.size, self.min_len, self.max_len = seed, size, min_len, max_len

    def __len__(self) -> int:
        return self.size

    def word(self, index: int) -> str:
        rng = random.Random(f"reverse/{self.seed}/{index}")
        return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(self.min_len, self.max_len)))

    def __getitem__(self, index: int) -> Task:
        if not 0 <= index < self.size:
            raise IndexError(f"reverse task index {index} out of range 0..{self.size - 1}")
        word = self.word(index)
        spec = make_spec("text", answer=word[::-1], source="builtin:reverse", seed=self.seed, index=index)
        # The id is the word itself: the same word drawn twice is one task, on one side of the split.
        return Task(task_id=f"reverse/{word}", domain="text", prompt=f"reverse {word}:", spec=spec,
                    demonstration=word[::-1])
