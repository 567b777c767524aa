"""The real Kafka and MinIO for tests: Testcontainers when a Docker engine answers, the local launcher otherwise."""
from __future__ import annotations

import contextlib
import os
import random
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from infra.settings import Settings

if TYPE_CHECKING:
    from infra.launcher import Launcher


def free_ports(count: int = 2) -> int:
    """A port p with p .. p + count - 1 all free, below the ephemeral range (where clients' own ports come
    from)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 30000)
        sockets = [socket.socket() for _ in range(count)]
        try:
            for i, sock in enumerate(sockets):
                sock.bind(("127.0.0.1", port + i))
            return port
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports")


def private_launcher(state_dir: Path, brokers: int = 1) -> "Launcher":
    """A launcher for a stack of its own: one block of free ports, Kafka's nodes first (two ports each), then
    MinIO's API and console, so no server of the stack can take another's port."""
    from infra.launcher import Launcher

    port = free_ports(2 * brokers + 2)
    return Launcher(state_dir=state_dir, kafka_port=port, minio_port=port + 2 * brokers, brokers=brokers)


def docker_engine_answers() -> bool:
    try:
        import docker

        docker.from_env(timeout=3).ping()
        return True
    except Exception:
        return False


def stack_mode() -> str:
    """TRAJPIPE_TEST_STACK=containers|launcher forces a path; auto picks containers when Docker answers."""
    mode = os.environ.get("TRAJPIPE_TEST_STACK", "auto")
    if mode == "auto":
        return "containers" if docker_engine_answers() else "launcher"
    return mode


@contextlib.contextmanager
def containers_stack() -> Iterator[Settings]:
    from testcontainers.community.kafka import KafkaContainer
    from testcontainers.community.minio import MinioContainer

    with KafkaContainer("confluentinc/cp-kafka:7.7.1").with_kraft() as kafka, MinioContainer() as minio:
        conf = minio.get_config()
        yield Settings(kafka_bootstrap=kafka.get_bootstrap_server(), s3_endpoint=conf["endpoint"],
                       s3_access_key=conf["access_key"], s3_secret_key=conf["secret_key"])


@contextlib.contextmanager
def launcher_stack(launcher: "Launcher | None" = None) -> Iterator[Settings]:
    from infra.launcher import Launcher

    launcher = launcher or Launcher()
    running = all(server["ready"] for server in launcher.status().values())
    try:
        launcher.up()  # idempotent: reuses servers that .ci/run or a developer already started
        yield launcher.settings()
    finally:
        if not running:  # started here (even half-way): stopped here, so a test run leaves no server behind
            launcher.down()


def real_stack() -> contextlib.AbstractContextManager[Settings]:
    return containers_stack() if stack_mode() == "containers" else launcher_stack()


def clear_namespaces(settings: Settings, namespaces: list[str]) -> None:
    """Delete what the session's tests made (topics, groups, objects), so test runs do not pile up thousands of
    topics that a broker then loads for minutes at every start; TRAJPIPE_KEEP_TEST_NAMESPACES=1 keeps them."""
    from infra.namespaces import delete_prefixed

    if os.environ.get("TRAJPIPE_KEEP_TEST_NAMESPACES") == "1" or not namespaces:
        return
    try:
        done = delete_prefixed(settings, namespaces)
    except Exception as exc:  # clearing is housekeeping: a failure here is reported, never a test failure
        print(f"\ntest namespaces not cleared: {exc}", file=sys.stderr)
        return
    print(f"\ncleared {len(namespaces)} test namespaces: {done['topics_deleted']} topics, "
          f"{done['objects_deleted']} objects, {done['groups_deleted']} consumer groups"
          + (f"; {len(done['failed'])} left: {done['failed'][:3]}" if done["failed"] else ""), file=sys.stderr)
