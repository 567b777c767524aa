"""Scoring: apply the configured, versioned reward function to an assembled trajectory.

    scorer = Scorer.load("default", "1")      # ConfigError at start for an unknown name or version
    scored = scorer.score(trajectory)         # RewardError: the caller dead-letters the trajectory
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from schemas.errors import RewardError
from schemas.records import Trajectory, evolve
from streams.rewards import RewardFn, RewardResult, get_reward_fn


@dataclass(frozen=True)
class Scorer:
    name: str
    version: str
    fn: RewardFn

    @classmethod
    def load(cls, name: str, version: str) -> "Scorer":
        return cls(name, version, get_reward_fn(name, version))

    def score(self, trajectory: Trajectory) -> Trajectory:
        """The trajectory with reward, every component, and the function's name and version."""
        try:
            result = self.fn(trajectory)
        except RewardError:
            raise
        except Exception as exc:  # a reward function is plug-in code: any failure is this record's, not ours
            raise RewardError(f"reward {self.name} v{self.version} failed on {trajectory.trajectory_id}: "
                              f"{exc!r}") from exc
        _check(result, trajectory.trajectory_id)
        return evolve(trajectory, reward=float(result.total),
                       reward_components={k: float(result.components[k]) for k in sorted(result.components)},
                       reward_fn=self.name, reward_version=self.version)


def _check(result: RewardResult, trajectory_id: str) -> None:
    values = [result.total, *result.components.values()]
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
        raise RewardError(f"reward of {trajectory_id} is not finite: total={result.total}, "
                          f"components={result.components}")
