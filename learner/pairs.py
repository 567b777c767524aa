"""DPO preference pairs from GRPO groups: the best and the worst trajectory of each group, ties skipped.

    pairs, skipped = preference_pairs(trajectories)
    for pair in pairs: pair.chosen.reward > pair.rejected.reward
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from schemas.records import Trajectory


@dataclass(frozen=True)
class PreferencePair:
    chosen: Trajectory
    rejected: Trajectory

    @property
    def margin(self) -> float:
        return self.chosen.reward - self.rejected.reward


def by_group(trajectories: Iterable[Trajectory]) -> dict[str, list[Trajectory]]:
    groups: dict[str, list[Trajectory]] = {}
    for traj in trajectories:
        groups.setdefault(traj.group_id, []).append(traj)
    return groups


def best_vs_worst(group: list[Trajectory], min_margin: float = 0.0) -> PreferencePair | None:
    """None for a group of one or a group whose rewards do not differ by more than min_margin."""
    # Sorting by id too makes the choice among equal rewards independent of arrival order (replays agree).
    ranked = sorted(group, key=lambda t: (t.reward, t.trajectory_id))
    worst, best = ranked[0], ranked[-1]
    if len(group) < 2 or best.reward - worst.reward <= min_margin:
        return None
    return PreferencePair(chosen=best, rejected=worst)


def preference_pairs(trajectories: Iterable[Trajectory], min_margin: float = 0.0) -> tuple[list[PreferencePair], int]:
    """One pair per group with distinct rewards, in group order; and the number of groups skipped."""
    found = [best_vs_worst(group, min_margin) for group in by_group(trajectories).values()]
    pairs = [pair for pair in found if pair is not None]
    return pairs, len(found) - len(pairs)
