"""reasoning-gym datasets as domains: `rg:<generator>` is one dataset, `rg:*` every one that verifies.

    python -m producers --ns NS --sources 'rg:*'                    # ~100 domains, mixed equally
    python -m producers --ns NS --sources rg:leg_counting,rg:basic_arithmetic

Each dataset is a task source of domain "rg/<generator>": task i is the dataset's item i for the seed, and its
spec records (generator, seed, index, size) so that `streams/` re-generates the item and scores an answer with
the dataset's own score_answer (streams.reasoning). The gold answer rides along for demonstrations only.
"""
from __future__ import annotations

from typing import Any, Mapping

from producers.tasks.task import Task
from schemas.errors import ConfigError
from schemas.tasks import REASONING_GYM, make_spec

PREFIX = f"{REASONING_GYM}:"
# Datasets that are no environment here, and why: a verifier must give its own gold answer 1 and a wrong
# one less (tests/unit/test_reasoning_gym.py checks every other dataset).
EXCLUDED = {
    "composite": "a mixture of other datasets: name those instead",
    "boxnet": "its gold answer is one plan among many, and scores 0",
    "graph_color": "its gold answer is not a coloring it accepts (scores 0)",
    "propositional_logic": "its gold answer scores 0",
    "rubiks_cube": "its gold answer scores 0",
    "rush_hour": "its gold answer scores 0",
    "game_of_life_halting": "a wrong answer scores 1",
}


def generators() -> list[str]:
    """Every reasoning-gym dataset that is an environment here, by name."""
    from reasoning_gym.factory import DATASETS

    return sorted(name for name in DATASETS if name not in EXCLUDED)


def expand(names: list[str]) -> list[str]:
    """`rg:*` -> one `rg:<generator>` per dataset; other names as they are."""
    out: list[str] = []
    for name in names:
        out += [PREFIX + g for g in generators()] if name == PREFIX + "*" else [name]
    return out


class ReasoningGymDomain:
    """One reasoning-gym dataset as a task source; index i is its item i (same seed, same tasks)."""

    def __init__(self, generator: str, seed: int = 0, size: int = 1000,
                 config: Mapping[str, Any] | None = None) -> None:
        if generator in EXCLUDED:
            raise ConfigError(f"reasoning-gym dataset {generator!r} is no environment here: {EXCLUDED[generator]}")
        if generator not in generators():
            raise ConfigError(f"no reasoning-gym dataset {generator!r}; `rg:*` names every one ({len(generators())})")
        import reasoning_gym  # imported here: it is slow to import and only these sources need it

        self.generator, self.seed, self.size, self.config = generator, seed, size, dict(config or {})
        self.name, self.domain = PREFIX + generator, f"{REASONING_GYM}/{generator}"
        self._dataset = reasoning_gym.create_dataset(generator, seed=seed, size=size, **self.config)

    def __len__(self) -> int:
        return self.size

    def task_id(self, index: int) -> str:
        """Task `index`'s id, without generating it (some datasets take a second per item)."""
        return f"{self.domain}/{self.seed}/{index}"

    def __getitem__(self, index: int) -> Task:
        if not 0 <= index < self.size:
            raise IndexError(f"{self.name} task index {index} out of range 0..{self.size - 1}")
        item = self._dataset[index]
        extra = {"config": self.config} if self.config else {}
        spec = make_spec(self.domain, generator=self.generator, seed=self.seed, index=index, size=self.size,
                         answer=str(item["answer"]), **extra)
        return Task(task_id=self.task_id(index), domain=self.domain,
                    prompt=f"{item['question']}\nAnswer:", spec=spec, demonstration=f" {item['answer']}")
