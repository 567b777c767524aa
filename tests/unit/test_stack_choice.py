"""The integration fixtures pick Testcontainers when a Docker engine answers and the local launcher otherwise."""
from __future__ import annotations

import pytest

from tests import stack


def test_auto_follows_the_docker_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRAJPIPE_TEST_STACK", raising=False)
    expected = "containers" if stack.docker_engine_answers() else "launcher"
    assert stack.stack_mode() == expected


@pytest.mark.parametrize("mode", ["containers", "launcher"])
def test_the_mode_can_be_forced(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    monkeypatch.setenv("TRAJPIPE_TEST_STACK", mode)
    assert stack.stack_mode() == mode
    chosen = stack.real_stack()
    assert chosen.gen.__name__ == f"{mode}_stack"  # type: ignore[attr-defined]
    chosen.gen.close()  # type: ignore[attr-defined]
