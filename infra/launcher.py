"""Runs a real Kafka broker (KRaft) and a real MinIO server on loopback, without Docker.

    python -m infra up       # fetch once into the cache dir, start both, wait until they answer
    python -m infra status   # versions, addresses, pids
    python -m infra down     # stop what `up` started (by pid)
"""
from __future__ import annotations

import base64
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from infra.settings import DEFAULT_KAFKA_PORT, DEFAULT_MINIO_PORT, Settings, cache_dir, state_credentials
from schemas.errors import InfraError

KAFKA_VERSION = "4.1.1"
MINIO_VERSION = "v0.0.0-20260212201848-7aac2a2c5b7c"
HERE = Path(__file__).with_name("local")


@dataclass(frozen=True)
class Server:
    name: str
    version: str
    port: int
    address: str
    pid_file: Path
    log_file: Path


def _need(tool: str, fix: str) -> str:
    path = shutil.which(tool)
    if path is None:
        raise InfraError(f"`{tool}` is not installed; {fix}")
    return path


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child is not alive
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def read_pid(pid_file: Path) -> Optional[int]:
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if _alive(pid) else None


class Launcher:
    """Fetches, starts, checks and stops the local Kafka and MinIO servers."""

    def __init__(self, root: Optional[Path] = None, state_dir: Optional[Path] = None,
                 kafka_port: Optional[int] = None, minio_port: Optional[int] = None) -> None:
        self.root = root or cache_dir()
        self.state = state_dir or self.root / "local"
        self.kafka_port = kafka_port or int(os.environ.get("TRAJPIPE_KAFKA_PORT", DEFAULT_KAFKA_PORT))
        self.minio_port = minio_port or int(os.environ.get("TRAJPIPE_MINIO_PORT", DEFAULT_MINIO_PORT))

    # ---- servers -------------------------------------------------------------------------------
    @property
    def kafka(self) -> Server:
        return Server("kafka", KAFKA_VERSION, self.kafka_port, f"127.0.0.1:{self.kafka_port}",
                      self.state / "kafka.pid", self.state / "kafka.log")

    @property
    def minio(self) -> Server:
        return Server("minio", MINIO_VERSION, self.minio_port, f"127.0.0.1:{self.minio_port}",
                      self.state / "minio.pid", self.state / "minio.log")

    # ---- fetch ---------------------------------------------------------------------------------
    def kafka_libs(self) -> Path:
        """The broker's jars, resolved once by Maven from Maven Central."""
        libs = self.root / "kafka" / KAFKA_VERSION / "libs"
        if (libs / f"kafka_2.13-{KAFKA_VERSION}.jar").exists():
            return libs
        mvn = _need("mvn", "install Maven (apt-get install -y maven) to fetch the Kafka jars")
        work = libs.parent
        work.mkdir(parents=True, exist_ok=True)
        (work / "pom.xml").write_text((HERE / "kafka-pom.xml").read_text().replace("@KAFKA_VERSION@", KAFKA_VERSION))
        tmp = work / "libs.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"fetching Apache Kafka {KAFKA_VERSION} jars with Maven into {libs} (once)", file=sys.stderr, flush=True)
        proc = subprocess.run(
            [mvn, "-q", "-B", "-f", str(work / "pom.xml"), "dependency:copy-dependencies",
             "-DincludeScope=runtime", f"-DoutputDirectory={tmp}"],
            capture_output=True, text=True,
        )
        if proc.returncode != 0:
            raise InfraError(f"Maven could not fetch Kafka {KAFKA_VERSION}: {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        tmp.rename(libs)
        return libs

    def minio_binary(self) -> Path:
        """The MinIO server, built once from its Go module."""
        binary = self.root / "minio" / MINIO_VERSION / "minio"
        if binary.exists():
            return binary
        go = _need("go", "install Go (apt-get install -y golang) to build MinIO")
        binary.parent.mkdir(parents=True, exist_ok=True)
        print(f"building MinIO {MINIO_VERSION} with `go install` into {binary.parent} (once, a few minutes)", file=sys.stderr, flush=True)
        env = {**os.environ, "GOBIN": str(binary.parent), "CGO_ENABLED": "0"}
        proc = subprocess.run([go, "install", f"github.com/minio/minio@{MINIO_VERSION}"],
                              capture_output=True, text=True, env=env)
        if proc.returncode != 0 or not binary.exists():
            raise InfraError(f"`go install github.com/minio/minio@{MINIO_VERSION}` failed: {proc.stderr[-3000:]}")
        return binary

    def fetch(self) -> None:
        self.kafka_libs()
        self.minio_binary()

    # ---- start ---------------------------------------------------------------------------------
    def _check_port_free(self, server: Server, *extra: int) -> None:
        for port in (server.port, *extra):
            if port_open(port):
                raise InfraError(
                    f"port {port} is taken by another process, so {server.name} cannot start; free it or set "
                    f"TRAJPIPE_{server.name.upper()}_PORT to another port"
                )

    def _spawn(self, server: Server, argv: list[str], env: Optional[dict[str, str]] = None) -> int:
        self.state.mkdir(parents=True, exist_ok=True)
        with open(server.log_file, "ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, env={**os.environ, **(env or {})})
        server.pid_file.write_text(str(proc.pid))
        return proc.pid

    def _kafka_config(self) -> Path:
        data = self.state / "kafka-data"
        self.state.mkdir(parents=True, exist_ok=True)
        conf = self.state / "server.properties"
        text = (HERE / "server.properties").read_text()
        for k, v in {"@PORT@": str(self.kafka_port), "@CONTROLLER_PORT@": str(self.kafka_port + 1),
                     "@DATA_DIR@": str(data)}.items():
            text = text.replace(k, v)
        conf.write_text(text)
        if not (data / "meta.properties").exists():
            cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
            # "=": a base64 id may start with "-", which argparse would take for an option
            proc = subprocess.run(self._java(["kafka.tools.StorageTool", "format", f"--cluster-id={cluster_id}",
                                              "-c", str(conf), "--standalone"]), capture_output=True, text=True)
            if proc.returncode != 0:
                raise InfraError(f"formatting the Kafka data dir failed: {proc.stdout}{proc.stderr}")
        return conf

    def _java(self, args: list[str]) -> list[str]:
        java = _need("java", "install Java 17 (apt-get install -y openjdk-17-jre-headless)")
        log4j = self.state / "log4j2.xml"
        self.state.mkdir(parents=True, exist_ok=True)
        log4j.write_text((HERE / "log4j2.xml").read_text())
        return [java, "-Xms256m", "-Xmx1g", "-XX:+UseG1GC", "-Djava.awt.headless=true",
                f"-Dlog4j2.configurationFile={log4j}", f"-Dkafka.logs.file={self.kafka.log_file}",
                "-cp", f"{self.kafka_libs()}/*", *args]

    def start_kafka(self) -> str:
        server = self.kafka
        if read_pid(server.pid_file):
            return "already running"
        self._check_port_free(server, server.port + 1)
        conf = self._kafka_config()
        self._spawn(server, self._java(["kafka.Kafka", str(conf)]))
        self._wait(server, self._kafka_ready, 90)
        return "started"

    def minio_credentials(self) -> dict[str, str]:
        """From the environment, else generated once and kept (mode 0600) in the state dir."""
        user, password = os.environ.get("MINIO_ROOT_USER"), os.environ.get("MINIO_ROOT_PASSWORD")
        if user and password:
            return {"MINIO_ROOT_USER": user, "MINIO_ROOT_PASSWORD": password}
        saved = state_credentials(self.state / "minio.env")
        if saved.get("MINIO_ROOT_USER") and saved.get("MINIO_ROOT_PASSWORD"):
            return saved
        creds = {"MINIO_ROOT_USER": "trajpipe-" + secrets.token_hex(4), "MINIO_ROOT_PASSWORD": secrets.token_urlsafe(24)}
        path = self.state / "minio.env"
        self.state.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600)
        path.write_text("".join(f"{k}={v}\n" for k, v in creds.items()))
        return creds

    def settings(self) -> Settings:
        """How a client reaches these two servers."""
        creds = self.minio_credentials()
        return Settings(self.kafka.address, self.minio.address, creds["MINIO_ROOT_USER"], creds["MINIO_ROOT_PASSWORD"])

    def start_minio(self) -> str:
        server = self.minio
        if read_pid(server.pid_file):
            return "already running"
        self._check_port_free(server, server.port + 1)
        data = self.state / "minio-data"
        data.mkdir(parents=True, exist_ok=True)
        argv = [str(self.minio_binary()), "server", str(data), "--address", server.address,
                "--console-address", f"127.0.0.1:{server.port + 1}", "--quiet"]
        self._spawn(server, argv, {**self.minio_credentials(), "MINIO_BROWSER": "off"})
        self._wait(server, self._minio_ready, 60)
        return "started"

    def _wait(self, server: Server, ready: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if read_pid(server.pid_file) is None:
                tail = server.log_file.read_text(errors="replace")[-3000:] if server.log_file.exists() else ""
                raise InfraError(f"{server.name} exited during start; log {server.log_file}:\n{tail}")
            if ready():
                return
            time.sleep(0.5)
        raise InfraError(f"{server.name} did not become ready in {timeout:.0f}s; see {server.log_file}")

    def _kafka_ready(self) -> bool:
        if not port_open(self.kafka_port):
            return False
        from confluent_kafka.admin import AdminClient  # a real client call, not just an open port

        try:
            AdminClient({"bootstrap.servers": self.kafka.address}).list_topics(timeout=3)
            return True
        except Exception:
            return False

    def _minio_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.minio.address}/minio/health/ready", timeout=2) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    def up(self) -> dict[str, str]:
        self.fetch()
        return {"kafka": self.start_kafka(), "minio": self.start_minio()}

    # ---- stop ----------------------------------------------------------------------------------
    def stop(self, server: Server, timeout: float = 30.0) -> str:
        pid = read_pid(server.pid_file)
        if pid is None:
            server.pid_file.unlink(missing_ok=True)
            return "not running"
        os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _alive(pid):
            os.killpg(pid, signal.SIGKILL)
            time.sleep(0.5)
        server.pid_file.unlink(missing_ok=True)
        return "stopped"

    def down(self) -> dict[str, str]:
        return {"minio": self.stop(self.minio), "kafka": self.stop(self.kafka)}

    def kill(self, name: str) -> None:
        """SIGKILL one server (fault-injection tests)."""
        server = getattr(self, name)
        pid = read_pid(server.pid_file)
        if pid is not None:
            os.killpg(pid, signal.SIGKILL)
            while _alive(pid):
                time.sleep(0.05)

    def start(self, name: str) -> str:
        return self.start_kafka() if name == "kafka" else self.start_minio()

    def status(self) -> dict[str, dict[str, object]]:
        out: dict[str, dict[str, object]] = {}
        for server, ready in ((self.kafka, self._kafka_ready), (self.minio, self._minio_ready)):
            pid = read_pid(server.pid_file)
            out[server.name] = {"version": server.version, "address": server.address, "pid": pid,
                                "running": pid is not None, "ready": pid is not None and ready(),
                                "log": str(server.log_file)}
        return out
