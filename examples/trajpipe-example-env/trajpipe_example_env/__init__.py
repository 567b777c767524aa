"""An example environment package: count the vowels of a word, with a second try after a wrong answer.

Installed (`pip install examples/trajpipe-example-env`), it adds the domains "env/vowels" and
"env/vowels-remote" and the reward "brevity:1" to trajpipe through entry points; nothing in trajpipe names
them.

    python -m producers --ns NS --sources env:vowels
    python -m streams --ns NS --reward brevity:1
    TRAJPIPE_EXAMPLE_CHECKER_S=1 python -m producers --ns NS --sources env:vowels-remote
"""
from __future__ import annotations

import os
import random
import string
import time
from typing import Any, Mapping, Optional

from schemas.environments import EnvTask

VOWELS = set("aeiou")
CHECKER_S = "TRAJPIPE_EXAMPLE_CHECKER_S"  # vowels-remote: seconds its checker takes to answer


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


class RemoteVowelCount(VowelCount):
    """The same tasks, but the answer between the two tries is checked by a remote service, as a compile
    farm, a game engine or a judge model would check it: each feedback waits for the checker's reply.

    The service is emulated by a wait of $TRAJPIPE_EXAMPLE_CHECKER_S seconds (default 0.5) that uses no CPU,
    which is what a remote call costs the rollout worker. The reward reads only the recorded answer, as
    every verifier does, so streams never waits for it."""

    def feedback(self, spec: Mapping[str, Any], answer: str) -> Optional[str]:
        time.sleep(float(os.environ.get(CHECKER_S, "0.5")))
        return super().feedback(spec, answer)


def brevity(trajectory: Any, components: Mapping[str, float]) -> float:
    """The outcome, less 0.5 per turn after the first: a right first answer is worth most."""
    return components.get("outcome/correct", 0.0) - 0.5 * (len(trajectory.turns) - 1)
