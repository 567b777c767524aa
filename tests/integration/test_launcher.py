"""The local launcher: idempotent up, down leaves nothing behind, clear errors for taken ports."""
from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
from confluent_kafka.admin import ClusterMetadata

from infra.launcher import Launcher, _alive, read_pid
from infra.settings import Settings
from schemas.errors import InfraError
from tests.stack import free_ports, private_launcher

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def processes_using(path: Path) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(path) in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def test_up_twice_is_a_noop_and_down_leaves_no_process(tmp_path: Path) -> None:
    launcher = private_launcher(tmp_path / "state")
    try:
        assert launcher.up() == {"kafka": "started", "minio": "started"}
        pids = (read_pid(launcher.kafka.pid_file), read_pid(launcher.minio.pid_file))
        assert all(pids)
        assert launcher.up() == {"kafka": "already running", "minio": "already running"}
        assert (read_pid(launcher.kafka.pid_file), read_pid(launcher.minio.pid_file)) == pids
        status = launcher.status()
        assert status["kafka"]["ready"] and status["minio"]["ready"]
        assert status["kafka"]["version"].startswith("4.")
    finally:
        assert launcher.down() == {"minio": "stopped", "kafka": "stopped"}
    assert not any(_alive(p) for p in pids if p)
    assert processes_using(tmp_path / "state") == []
    assert launcher.down() == {"minio": "not running", "kafka": "not running"}
    assert oct(os.stat(tmp_path / "state" / "minio.env").st_mode & 0o777) == "0o600"


def test_a_taken_port_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        launcher = Launcher(state_dir=tmp_path / "state", kafka_port=free_ports(2), minio_port=port)
        with pytest.raises(InfraError, match=f"port {port} is taken"):
            launcher.start_minio()
    assert read_pid(launcher.minio.pid_file) is None


def test_the_test_stack_stops_the_servers_it_started_and_leaves_running_ones_alone(tmp_path: Path) -> None:
    from tests.stack import launcher_stack

    launcher = private_launcher(tmp_path / "stack")
    with launcher_stack(launcher) as settings:  # nothing ran: it starts both
        assert all(s["ready"] for s in launcher.status().values())
        assert settings.kafka_bootstrap.endswith(str(launcher.kafka_port))
    assert not any(s["running"] for s in launcher.status().values())  # ...and stops both
    launcher.up()
    try:
        with launcher_stack(launcher):
            pass
        assert all(s["ready"] for s in launcher.status().values())  # found running: left running
    finally:
        launcher.down()


def test_the_first_committed_offsets_asked_of_a_fresh_broker_wait_for_its_group_coordinator(tmp_path: Path) -> None:
    """A broker on an empty state dir (as CI starts one) makes its offsets topic at the first group request and
    answers NOT_COORDINATOR until it has loaded it; librdkafka's committed() hands that answer up as an error.
    Every reader of committed offsets waits it out (the batch reader already did; archive, monitor and rescore
    now do too): here the archiver, as the first client of a fresh platform."""
    from consumers.archive import ArchiveBounds, Archiver
    from infra.bootstrap import bootstrap
    from infra.objectstore import ObjectStore
    from schemas.topics import Topics
    from tests.taps import episode, produce

    launcher = private_launcher(tmp_path / "fresh")
    try:
        launcher.up()
        settings = launcher.settings()
        topics = Topics("fresh1", partitions=2)
        bootstrap(settings, topics.ns, partitions=2)
        produce(settings, topics.events, episode("ep-0", 1_700_000_000_000))
        store = ObjectStore(settings)
        archiver = Archiver(settings, topics.ns, ArchiveBounds(max_events=5), store=store, group="fresh1.archive")
        try:
            keys = archiver.run_once(timeout_s=60).keys
        finally:
            archiver.close()
        assert keys and all(store.exists(k) for k in keys)
    finally:
        launcher.down()


def answers_from_each_broker(settings: Settings, ids: set[int], asks: int = 200) -> dict[int, ClusterMetadata]:
    """One metadata answer from each broker in `ids`, told apart by the broker id each answer carries: which
    broker answers is librdkafka's choice, whatever address the client was given."""
    from confluent_kafka.admin import AdminClient

    addresses = settings.kafka_bootstrap.split(",")
    answers: dict[int, ClusterMetadata] = {}
    for n in range(asks):
        meta = AdminClient({"bootstrap.servers": addresses[n % len(addresses)]}).list_topics(timeout=10)
        if meta.orig_broker_id in ids:
            answers.setdefault(meta.orig_broker_id, meta)
        if set(answers) == ids:
            return answers
    raise AssertionError(f"in {asks} asks only brokers {sorted(answers)} of {sorted(ids)} answered")


def test_bootstrap_on_three_brokers_returns_once_every_broker_lists_every_topic(tmp_path: Path) -> None:
    """CreateTopics answers once the controller has committed; each broker applies the topics a moment later.
    Asked at once, a broker lagging behind called them unknown: bootstrap waits until each broker has listed
    every topic itself (the id in the answer, not the address asked: a client given one broker's address is
    often answered by another, which is how a lagging broker was once taken for ready), so a service started
    right after it finds its topics on whichever broker it asks."""
    from infra.bootstrap import bootstrap
    from infra.kafka import admin
    from schemas.topics import Topics

    launcher = private_launcher(tmp_path / "cluster", brokers=3)
    try:
        launcher.up()
        settings = launcher.settings()
        ids = set(admin(settings).list_topics(timeout=10).brokers)
        assert len(ids) == 3
        for i in range(12):
            topics = Topics(f"three{i}", partitions=2)
            report = bootstrap(settings, topics.ns, partitions=2)
            assert set(report.brokers) == ids, i
            for broker, meta in answers_from_each_broker(settings, ids).items():
                for spec in topics.specs():
                    found = meta.topics.get(spec.name)
                    assert found is not None and found.error is None, (i, broker, spec.name)
                    assert len(found.partitions) == spec.partitions and all(
                        len(p.replicas) == 3 and p.leader >= 0 for p in found.partitions.values()), (i, broker, spec.name)
    finally:
        launcher.down()
