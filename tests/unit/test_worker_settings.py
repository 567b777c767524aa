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
