"""The deployment file: structure, every stage present, commands that exist, no secrets in the repo."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from infra.launcher import COMPOSE_VERSION, Launcher

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "infra" / "docker-compose.yml"
STAGES = {"kafka", "minio", "bootstrap", "streams", "shard-writer", "producer", "producer-gpu", "learner", "monitor"}


@pytest.fixture(scope="module")
def compose() -> dict:  # type: ignore[type-arg]
    return yaml.safe_load(COMPOSE.read_text())


def test_every_stage_is_a_service(compose: dict) -> None:  # type: ignore[type-arg]
    assert STAGES <= set(compose["services"])


def test_service_commands_name_modules_that_exist(compose: dict) -> None:  # type: ignore[type-arg]
    for name, svc in compose["services"].items():
        if "build" not in svc:
            continue
        module = svc["command"][0]
        assert importlib.util.find_spec(module) is not None, f"{name}: python -m {module} does not exist"


def test_servers_have_health_checks_and_named_volumes(compose: dict) -> None:  # type: ignore[type-arg]
    services, volumes = compose["services"], set(compose["volumes"])
    for name in ("kafka", "minio"):
        assert "healthcheck" in services[name]
    for svc in services.values():
        for vol in svc.get("volumes", []):
            source = vol.split(":")[0]
            assert source.startswith(("${", "./", "/")) or source in volumes, f"undeclared volume {source}"
    assert services["bootstrap"]["depends_on"]["kafka"]["condition"] == "service_healthy"
    assert services["streams"]["depends_on"]["bootstrap"]["condition"] == "service_completed_successfully"


def test_kafka_writes_its_log_on_the_named_volume(compose: dict) -> None:  # type: ignore[type-arg]
    brokers = {name: svc for name, svc in compose["services"].items() if name.startswith("kafka")}
    assert set(brokers) == {"kafka", "kafka-2", "kafka-3"}
    sources = []
    for name, kafka in brokers.items():
        log_dirs = kafka["environment"]["KAFKA_LOG_DIRS"].split(",")
        mounts = {v.split(":")[1]: v.split(":")[0] for v in kafka["volumes"]}
        for path in log_dirs:
            assert mounts.get(path) in set(compose["volumes"]), f"{name}'s log dir {path} is not on a named volume"
            sources.append(mounts[path])
    assert len(set(sources)) == 3  # each broker its own volume
    ids = {kafka["environment"]["KAFKA_NODE_ID"] for kafka in brokers.values()}
    assert ids == {1, 2, 3} and all(kafka["environment"]["CLUSTER_ID"] == brokers["kafka"]["environment"]["CLUSTER_ID"]
                                    for kafka in brokers.values())
    assert brokers["kafka-2"]["profiles"] == brokers["kafka-3"]["profiles"] == ["cluster"]


def test_health_checks_use_only_what_their_images_ship(compose: dict) -> None:  # type: ignore[type-arg]
    minio = " ".join(compose["services"]["minio"]["healthcheck"]["test"])
    assert "curl" not in minio and "wget" not in minio and "mc ready local" in minio
    kafka = " ".join(compose["services"]["kafka"]["healthcheck"]["test"])
    assert "/opt/kafka/bin/" in kafka  # the image's own tools


def test_every_setting_a_service_is_given_is_one_the_code_reads(compose: dict) -> None:  # type: ignore[type-arg]
    from tests.unit.test_readme_config import read_in_code

    read = read_in_code()
    given = {name for svc in compose["services"].values() if "build" in svc
             for name in svc.get("environment", {}) if name.startswith("TRAJPIPE_")}
    assert given and given <= read, f"dead settings in the compose file: {sorted(given - read)}"


def test_credentials_come_from_the_env_file(compose: dict) -> None:  # type: ignore[type-arg]
    text = COMPOSE.read_text()
    for key in ("MINIO_ROOT_PASSWORD", "TRAJPIPE_S3_SECRET_KEY"):
        for value in re.findall(rf"^\s*{key}:\s*(\S+)", text, re.M):
            assert value.startswith("${"), f"{key} is hard-coded"
    assert compose["services"]["producer-gpu"]["profiles"] == ["gpu"]


def test_dockerfiles_copy_paths_that_exist() -> None:
    for dockerfile in (ROOT / "infra" / "docker").glob("Dockerfile*"):
        for line in dockerfile.read_text().splitlines():
            if line.startswith("COPY "):
                for src in line.split()[1:-1]:
                    assert (ROOT / src).exists(), f"{dockerfile.name}: COPY {src} does not exist"


def test_compose_config_validates_the_file_with_the_compose_binary(tmp_path: Path) -> None:
    """`docker-compose config` (built from the Compose module by `python -m infra fetch`; a docker CLI with
    the compose plugin does as well) is the authority on the file's syntax and interpolation."""
    built = Launcher().root / "compose" / COMPOSE_VERSION / "docker-compose"
    docker = shutil.which("docker")
    if built.exists():
        command = [str(built)]
    elif docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        command = [docker, "compose"]
    else:
        pytest.skip("no docker-compose: `python -m infra fetch` builds it (CI does); the YAML tests above ran")
    # Compose lets the shell's variables override the env file: a shell that ran `eval "$(python -m infra env)"`
    # would resolve the local broker's address instead of the file's. Only PATH and HOME go through.
    shell = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ}
    env = tmp_path / ".env"
    env.write_text("MINIO_ROOT_USER=u\nMINIO_ROOT_PASSWORD=p\n")
    proc = subprocess.run([*command, "-f", str(COMPOSE), "--env-file", str(env), "config", "-q"],
                          capture_output=True, text=True, env=shell)
    assert proc.returncode == 0, proc.stderr
    cluster = ("MINIO_ROOT_USER=u\nMINIO_ROOT_PASSWORD=p\nGRAFANA_ADMIN_PASSWORD=g\nKAFKA_REPLICATION=3\nKAFKA_MIN_ISR=2\n"
               "KAFKA_VOTERS=1@kafka:9093,2@kafka-2:9093,3@kafka-3:9093\n"
               "TRAJPIPE_KAFKA_BOOTSTRAP=kafka:9092,kafka-2:9092,kafka-3:9092\n")
    env.write_text(cluster)  # every profile: three brokers, Prometheus and Grafana
    proc = subprocess.run([*command, "-f", str(COMPOSE), "--env-file", str(env), "--profile", "cluster", "--profile",
                           "observability", "config", "--format", "json"], capture_output=True, text=True, env=shell)
    assert proc.returncode == 0, proc.stderr
    resolved = json.loads(proc.stdout)["services"]
    assert {"kafka-2", "kafka-3", "prometheus", "grafana"} <= set(resolved)
    for broker in ("kafka", "kafka-2", "kafka-3"):
        assert resolved[broker]["environment"]["KAFKA_CONTROLLER_QUORUM_VOTERS"].count("@") == 3
        assert resolved[broker]["environment"]["KAFKA_MIN_INSYNC_REPLICAS"] == "2"
    assert resolved["learner"]["environment"]["TRAJPIPE_KAFKA_BOOTSTRAP"].count(",") == 2
    env.write_text("MINIO_ROOT_USER=u\n")  # a missing secret: refused with the file's own message
    proc = subprocess.run([*command, "-f", str(COMPOSE), "--env-file", str(env), "config", "-q"],
                          capture_output=True, text=True, env=shell)
    assert proc.returncode != 0 and "set MINIO_ROOT_PASSWORD in the env file" in proc.stderr
