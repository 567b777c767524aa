"""Waiting for a local server to start: a server still working (its log growing) is waited for, a stalled one
is given up on with the end of its log; where the servers keep their state is a setting; the servers' ports must
not overlap."""
from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

from infra.launcher import Launcher, Server
from infra.settings import Settings, state_dir
from schemas.errors import InfraError


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    """A live process standing in for a starting server: its pid file and log are the launcher's to watch."""
    proc = subprocess.Popen(["sleep", "60"])
    s = Server("kafka", "4.x", 1, "127.0.0.1:1", tmp_path / "kafka.pid", tmp_path / "kafka.log")
    s.pid_file.write_text(str(proc.pid))
    s.log_file.write_text("starting\n")
    yield s
    proc.kill()
    proc.wait()


def test_a_server_whose_log_grows_is_waited_for_past_the_stall_limit(tmp_path: Path, server: Server) -> None:
    start = time.monotonic()

    def ready() -> bool:  # "loads partitions" for 3 s, writing a line every 0.2 s, then answers
        with server.log_file.open("a") as log:
            log.write("Loaded partition\n")
        return time.monotonic() - start > 3.0

    Launcher(root=tmp_path)._wait(server, ready, timeout=1.0)
    assert time.monotonic() - start > 3.0


def test_a_server_whose_log_stands_still_is_given_up_on_with_its_log(tmp_path: Path, server: Server) -> None:
    server.log_file.write_text("ERROR something the operator must read\n")
    with pytest.raises(InfraError, match="stood still for 1s(.|\n)*something the operator must read"):
        Launcher(root=tmp_path)._wait(server, lambda: False, timeout=1.0)


def test_a_server_still_busy_after_the_longest_wait_is_given_up_on(tmp_path: Path, server: Server) -> None:
    def busy() -> bool:
        with server.log_file.open("a") as log:
            log.write("still loading\n")
        return False

    with pytest.raises(InfraError, match="still starting after 2s"):
        Launcher(root=tmp_path)._wait(server, busy, timeout=1.0, most=2.0)


def test_the_state_dir_is_a_setting_that_keeps_the_download_cache(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    state = tmp_path / "fresh-state"
    state.mkdir()
    (state / "minio.env").write_text("MINIO_ROOT_USER=u1\nMINIO_ROOT_PASSWORD=p1\n")
    (state / "kafka.brokers").write_text("3\n")
    env = {"TRAJPIPE_STATE_DIR": str(state), "TRAJPIPE_CACHE_DIR": str(tmp_path / "cache")}
    assert state_dir(env) == state and state_dir({"TRAJPIPE_CACHE_DIR": "/c"}) == Path("/c/local")
    settings = Settings.from_env(env)
    assert (settings.s3_access_key, settings.s3_secret_key) == ("u1", "p1")
    assert settings.kafka_bootstrap == "127.0.0.1:39092,127.0.0.1:39094,127.0.0.1:39096"
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    launcher = Launcher()
    assert launcher.state == state and launcher.root == tmp_path / "cache" and launcher.brokers == 3


@pytest.mark.parametrize("brokers, minio", [(1, 30001), (3, 30005), (3, 29999), (1, 29999)])
def test_ports_that_overlap_are_refused_before_anything_starts(tmp_path: Path, brokers: int, minio: int) -> None:
    """Kafka's nodes take two ports each from TRAJPIPE_KAFKA_PORT, MinIO two from its own: a MinIO port among
    Kafka's would be "taken by another process" only after Kafka started, a misleading error at the wrong time."""
    with pytest.raises(InfraError, match=f"MinIO's ports {minio}..{minio + 1} overlap Kafka's 30000..{30000 + 2 * brokers - 1}"):
        Launcher(state_dir=tmp_path / "state", kafka_port=30000, minio_port=minio, brokers=brokers)
    assert not (tmp_path / "state").exists()


def test_ports_side_by_side_are_accepted(tmp_path: Path) -> None:
    launcher = Launcher(state_dir=tmp_path / "state", kafka_port=30000, minio_port=30006, brokers=3)
    assert [n.port for n in launcher.kafka_nodes] == [30000, 30002, 30004] and launcher.minio.port == 30006
    with pytest.raises(InfraError, match=r"Kafka needs ports 65534..65537, outside 1..65535"):
        Launcher(state_dir=tmp_path / "state", kafka_port=65534, minio_port=30000, brokers=2)


def test_services_find_the_servers_up_started_on_the_ports_the_environment_moved(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`infra up` with TRAJPIPE_KAFKA_PORT and TRAJPIPE_MINIO_PORT (what a taken port's error tells a user to set)
    starts the servers there; a service started in the same environment must look there too, MinIO included
    (it went to the default port and retried a connection nobody answered)."""
    state = tmp_path / "state"
    state.mkdir()
    (state / "minio.env").write_text("MINIO_ROOT_USER=u1\nMINIO_ROOT_PASSWORD=p1\n")
    env = {"TRAJPIPE_STATE_DIR": str(state), "TRAJPIPE_KAFKA_PORT": "30000", "TRAJPIPE_MINIO_PORT": "30006"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    started = Launcher().settings()
    assert (started.kafka_bootstrap, started.s3_endpoint) == ("127.0.0.1:30000", "127.0.0.1:30006")
    assert Settings.from_env(env) == started
    # an endpoint set outright still wins
    assert Settings.from_env({**env, "TRAJPIPE_S3_ENDPOINT": "minio:9000"}).s3_endpoint == "minio:9000"
