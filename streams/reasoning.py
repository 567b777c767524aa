"""reasoning-gym domains ("rg/<generator>"): the task re-generated from its spec, scored by its own dataset.

    entry, dataset = regenerate(spec)                    # the item at (generator, seed, size, config)[index]
    score = dataset.score_answer(answer_text(text), entry)

The event's gold answer is never trusted: the generator is deterministic in (seed, size, config, index), so the
verifier rebuilds the item. Datasets are cached per (generator, seed, size, config); an unknown generator or a
bad index raises (the reward function's caller dead-letters the trajectory with the reason).
"""
from __future__ import annotations

import functools
import json
import re
from typing import Any, Mapping

_BOXED = re.compile(r"\\boxed\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}")
_ANSWER_MARK = re.compile(r"(?:final\s+)?answer\s*(?:is\s*:?|:)", re.IGNORECASE)


@functools.lru_cache(maxsize=512)
def _dataset(generator: str, seed: int, size: int, config: str) -> Any:
    import reasoning_gym  # imported here: slow to import, and only these domains need it

    return reasoning_gym.create_dataset(generator, seed=seed, size=size, **json.loads(config))


@functools.lru_cache(maxsize=4096)
def _item(generator: str, seed: int, size: int, config: str, index: int) -> dict[str, Any]:
    if not 0 <= index < size:
        raise ValueError(f"{generator}: index {index} outside the dataset's {size} items")
    return dict(_dataset(generator, seed, size, config)[index])  # a group's trajectories share one


def regenerate(spec: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
    """The spec's item and its dataset; ValueError for an index outside the dataset."""
    key = (spec["generator"], spec["seed"], spec["size"], json.dumps(spec.get("config", {}), sort_keys=True))
    return _item(*key, spec["index"]), _dataset(*key)


def answer_text(text: str) -> str:
    """What the policy answered: the last \\boxed{...}, else what follows the last "answer:", else the text."""
    boxed = _BOXED.findall(text)
    if boxed:
        return str(boxed[-1]).strip()
    marks = list(_ANSWER_MARK.finditer(text))
    return (text[marks[-1].end():] if marks else text).strip()


def score(spec: Mapping[str, Any], text: str) -> float:
    """The dataset's own score of the answer in `text`, in [0, 1]. A scorer that chokes on a malformed answer
    (some parse it as a number) scores it 0: the answer is what is wrong, not the task."""
    entry, dataset = regenerate(spec)
    try:
        value = float(dataset.score_answer(answer_text(text), entry))
    except Exception:  # ~100 third-party scorers on arbitrary model text: any failure is a wrong answer
        return 0.0
    return min(max(value, 0.0), 1.0)
