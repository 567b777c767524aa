"""Shared fixtures: the real stack (session), a fresh namespace with its topics, an object store."""
from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "2")

from infra.settings import Settings  # noqa: E402
from schemas.topics import Topics  # noqa: E402


ISSUED: list[str] = []  # every namespace the `ns` fixture handed out in this session


@pytest.fixture(scope="session")
def stack() -> Iterator[Settings]:
    from tests.stack import clear_namespaces, real_stack

    with real_stack() as settings:
        yield settings
        clear_namespaces(settings, ISSUED)


@pytest.fixture
def ns() -> str:
    name = f"t{uuid.uuid4().hex[:10]}"
    ISSUED.append(name)
    return name


@pytest.fixture
def topics(stack: Settings, ns: str) -> Topics:
    from infra.bootstrap import bootstrap

    bootstrap(stack, ns, partitions=2)
    return Topics(ns, partitions=2)


@pytest.fixture
def store(stack: Settings):  # type: ignore[no-untyped-def]
    from infra.objectstore import ObjectStore

    s = ObjectStore(stack)
    s.ensure_bucket()
    return s
