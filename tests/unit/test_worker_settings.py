"""A rollout worker's quota flags: what they accept, and the error for what they do not."""
from __future__ import annotations

import pytest

from producers.settings import from_args
from schemas.errors import ConfigError


def test_versions_ahead_reaches_the_worker_and_needs_a_quota_to_count_in() -> None:
    settings = from_args(["--ns", "quota", "--max-episodes-per-version", "16", "--versions-ahead", "1"])
    assert (settings.max_episodes_per_version, settings.versions_ahead) == (16, 1)
    assert from_args(["--ns", "quota"]).versions_ahead == 0  # the default: wait for each version
    with pytest.raises(ConfigError, match="--versions-ahead counts in quotas: give --max-episodes-per-version"):
        from_args(["--ns", "quota", "--versions-ahead", "1"])
    with pytest.raises(ConfigError, match="--versions-ahead must be >= 0, got -1"):
        from_args(["--ns", "quota", "--max-episodes-per-version", "16", "--versions-ahead", "-1"])
    with pytest.raises(ConfigError, match="--max-episodes-per-version must be at least --group-size"):
        from_args(["--ns", "quota", "--group-size", "8", "--max-episodes-per-version", "4"])


def test_a_long_run_keeps_the_newest_versions_loaded_and_refusals_and_counts_them_all() -> None:
    """A rollout worker runs for days: its report lists the newest versions it loaded and checkpoints it refused,
    and counts all of them, instead of one entry per version for the whole run."""
    from infra.settings import Settings
    from producers.checkpoints import KEEP_REFUSALS, CheckpointFollower
    from producers.worker import KEEP_VERSIONS_LOADED, WorkerStats
    from schemas.topics import Topics

    follower = CheckpointFollower(Settings.from_env(), Topics("unit"), None)  # type: ignore[arg-type]
    for version in range(5 * KEEP_REFUSALS):
        follower.refuse(f"checkpoint v{version} refused: corrupt")
    assert follower.refused_count == 5 * KEEP_REFUSALS and len(follower.refused) == KEEP_REFUSALS
    assert follower.refused[-1] == f"checkpoint v{5 * KEEP_REFUSALS - 1} refused: corrupt"
    stats = WorkerStats()
    for version in range(3 * KEEP_VERSIONS_LOADED):
        stats.loaded(version)
    assert list(stats.versions_loaded) == list(range(2 * KEEP_VERSIONS_LOADED, 3 * KEEP_VERSIONS_LOADED))
    assert stats.checkpoints_loaded == 3 * KEEP_VERSIONS_LOADED


def test_replicas_started_alike_draw_different_tasks_unless_given_a_seed() -> None:
    """docker-compose starts rollout-worker replicas with the same flags: each one's seed comes from its producer id
    (host-pid), so they do not draw the same tasks in the same order; --seed still repeats a worker's draws."""
    from producers.tasks.sources import seeded_source
    from producers.tasks.mixer import TaskMixer

    a, b = (from_args(["--ns", "seed", "--producer-id", name]) for name in ("rollout-1-host", "rollout-2-host"))
    assert a.seed != b.seed and from_args(["--ns", "seed", "--producer-id", "rollout-1-host"]).seed == a.seed
    assert from_args(["--ns", "seed", "--producer-id", "rollout-1-host", "--seed", "7"]).seed == 7
    mixers = [TaskMixer([seeded_source("math-easy", s.seed)], seed=s.seed) for s in (a, b)]
    draws = [[mixer.next().task_id for _ in range(8)] for mixer in mixers]
    assert draws[0] != draws[1]
