"""An example environment package: count the vowels of a word, with a second try after a wrong answer.

Installed (`pip install examples/trajpipe-example-env`), it adds the domain "env/vowels" and the reward
"brevity:1" to trajpipe through entry points; nothing in trajpipe names it.

    python -m producers --ns NS --sources env:vowels
    python -m streams --ns NS --reward brevity:1
"""
from __future__ import annotations

import random
import string
from typing import Any, Mapping, Optional

from schemas.environments import EnvTask

VOWELS = set("aeiou")


class VowelCount:
    """Task i of a seed: a random 4-8 letter word; the answer is how many of its letters are vowels."""

    version = "1"
    size = 5000
    max_turns = 2  # a wrong first answer gets "wrong, try again" and one more turn
    length_budget = 16

    def task(self, seed: int, index: int) -> EnvTask:
        rng = random.Random(f"vowels/{seed}/{index}")
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(4, 8)))
        count = sum(ch in VOWELS for ch in word)
        return EnvTask(task_id=word, prompt=f"vowels in {word}:", spec={"word": word}, demonstration=str(count))

    def verify(self, spec: Mapping[str, Any], answer: str) -> dict[str, float]:
        gold = sum(ch in VOWELS for ch in spec["word"])
        said = answer.strip().split()[0] if answer.strip() else ""
        return {"outcome/correct": float(said == str(gold)), "process/answer_found": float(said.isdigit())}

    def feedback(self, spec: Mapping[str, Any], answer: str) -> Optional[str]:
        """None (the episode ends) on a right answer, else what the policy reads before its second try."""
        return None if self.verify(spec, answer)["outcome/correct"] else " wrong, try again:"


def brevity(trajectory: Any, components: Mapping[str, float]) -> float:
    """The outcome, less 0.5 per turn after the first: a right first answer is worth most."""
    return components.get("outcome/correct", 0.0) - 0.5 * (len(trajectory.turns) - 1)
