"""Shared fixtures: the real stack (session), a fresh namespace with its topics, an object store."""
from __future__ import annotations

import contextlib
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
SERVERS = pytest.StashKey[contextlib.ExitStack]()  # the local servers of this pytest run (stopped if it started them)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Under `pytest -n N` the controller starts the local servers, once, before its workers ask for them: N
    workers starting them at the same moment would race for the ports, and each would stop them at its end
    while the others still run. A worker (and a run without -n) finds them running and leaves them up."""
    config = session.config
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        return
    from tests.stack import launcher_stack, stack_mode

    if stack_mode() != "launcher":  # Testcontainers: each worker starts containers of its own
        return
    servers = config.stash[SERVERS] = contextlib.ExitStack()
    servers.enter_context(launcher_stack())


def pytest_sessionfinish(session: pytest.Session) -> None:
    servers = session.config.stash.get(SERVERS, None)
    if servers is not None:
        servers.close()


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


@pytest.fixture
def own_minio(stack: Settings, tmp_path: Path):  # type: ignore[no-untyped-def]
    """(launcher, settings): a MinIO of the test's own beside the shared Kafka, for a test that takes the object
    store away while the shared one keeps serving the other tests (other pytest workers run at the same time)."""
    import dataclasses

    from tests.stack import private_launcher

    launcher = private_launcher(tmp_path / "own-minio")
    launcher.start("minio")
    try:
        yield launcher, dataclasses.replace(launcher.settings(), kafka_bootstrap=stack.kafka_bootstrap)
    finally:
        launcher.stop(launcher.minio)
