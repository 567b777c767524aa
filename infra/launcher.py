"""Runs a real Kafka broker (KRaft) and a real MinIO server on loopback, without Docker.

    python -m infra up              # fetch once into the cache dir, start both, wait until they answer
    python -m infra up --brokers 3  # a 3-node KRaft cluster instead of one broker (topics replicated 3 times)
    python -m infra status          # versions, addresses, pids of every node
    python -m infra down            # stop what `up` started (by pid)

A cluster's node i (1-based) listens on the Kafka port + 2(i - 1) and its controller on the next port; every
node is a combined broker and controller in one static quorum. How many brokers a state dir holds is written
when it is formatted, so later `status`, `down` and `up` calls need no flag.
"""
from __future__ import annotations

import base64
import functools
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

from infra.settings import (
    DEFAULT_KAFKA_PORT,
    DEFAULT_MINIO_PORT,
    Settings,
    cache_dir,
    record_brokers,
    recorded_brokers,
    state_credentials,
)
from infra.settings import state_dir as default_state_dir
from schemas.errors import InfraError

KAFKA_VERSION = "4.1.1"
MINIO_VERSION = "v0.0.0-20260212201848-7aac2a2c5b7c"
COMPOSE_VERSION = "v5.6.0"  # github.com/docker/compose/v5: validates infra/docker-compose.yml with no engine
PROMTOOL_VERSION = "v0.316.0"  # github.com/prometheus/prometheus (Prometheus 3.x): checks and tests the alert rules
HERE = Path(__file__).with_name("local")
BROKERS_VAR = "TRAJPIPE_KAFKA_BROKERS"
MAX_REPLICATION = 3


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


def _go_install(module: str, binary: Path, what: str) -> Path:
    """`go install module@version` into `binary`'s folder (static, CGO off), once; InfraError with Go's output."""
    go = _need("go", "install Go 1.26 (see `python -m infra doctor`)")
    binary.parent.mkdir(parents=True, exist_ok=True)
    print(f"building {what} with `go install` into {binary.parent} (once, a few minutes)", file=sys.stderr, flush=True)
    env = {**os.environ, "GOBIN": str(binary.parent), "CGO_ENABLED": "0"}
    proc = subprocess.run([go, "install", module], capture_output=True, text=True, env=env)
    if proc.returncode != 0 or not binary.exists():
        raise InfraError(f"`go install {module}` failed: {proc.stderr[-3000:]}")
    return binary


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


def replication(brokers: int) -> tuple[int, int]:
    """(replication factor, min.insync.replicas) for a cluster of `brokers`: 3 and 2 from three brokers on,
    so one broker may be lost while writes with acks=all go on."""
    factor = min(brokers, MAX_REPLICATION)
    return factor, max(1, factor - 1)


def _tail(log: Path, chars: int = 3000) -> str:
    if not log.exists():
        return "(no log)"
    with log.open("rb") as f:
        f.seek(max(0, log.stat().st_size - chars))
        return f.read().decode(errors="replace")


class Launcher:
    """Fetches, starts, checks and stops the local Kafka node(s) and MinIO server."""

    def __init__(self, root: Optional[Path] = None, state_dir: Optional[Path] = None,
                 kafka_port: Optional[int] = None, minio_port: Optional[int] = None,
                 brokers: Optional[int] = None) -> None:
        self.root = root or cache_dir()
        self.state = state_dir or (self.root / "local" if root else default_state_dir())
        self.kafka_port = kafka_port or int(os.environ.get("TRAJPIPE_KAFKA_PORT", DEFAULT_KAFKA_PORT))
        self.minio_port = minio_port or int(os.environ.get("TRAJPIPE_MINIO_PORT", DEFAULT_MINIO_PORT))
        recorded = self._recorded_brokers()
        wanted = brokers or recorded or int(os.environ.get(BROKERS_VAR) or 1)
        if wanted < 1:
            raise InfraError(f"a Kafka cluster needs at least one broker, not {wanted}")
        if recorded and wanted != recorded:
            raise InfraError(f"the local Kafka in {self.state} was formatted with {recorded} broker(s), not "
                             f"{wanted}: `python -m infra down`, then delete {self.state}/kafka-data* (its topics "
                             f"are lost) to make it again with {wanted}")
        self.brokers = wanted
        self._check_ports()

    def _check_ports(self) -> None:
        """Kafka's ports (a listener and a controller per node) and MinIO's (API and console) must not overlap,
        or the second server to start would find its port taken by the first."""
        kafka = range(self.kafka_port, self.kafka_port + 2 * self.brokers)
        minio = range(self.minio_port, self.minio_port + 2)
        for name, ports in (("Kafka", kafka), ("MinIO", minio)):
            if ports[0] < 1 or ports[-1] > 65535:
                raise InfraError(f"{name} needs ports {ports[0]}..{ports[-1]}, outside 1..65535")
        if set(kafka) & set(minio):
            raise InfraError(f"MinIO's ports {minio[0]}..{minio[-1]} overlap Kafka's {kafka[0]}..{kafka[-1]} "
                             f"({self.brokers} broker(s), two ports each): set TRAJPIPE_MINIO_PORT or "
                             f"TRAJPIPE_KAFKA_PORT so they do not")

    # ---- servers -------------------------------------------------------------------------------
    @property
    def kafka(self) -> Server:
        """Node 1 (the only one of a single-broker platform)."""
        return self.kafka_nodes[0]

    @property
    def kafka_nodes(self) -> list[Server]:
        nodes = []
        for i in range(1, self.brokers + 1):
            name, port = ("kafka" if i == 1 else f"kafka-{i}"), self.kafka_port + 2 * (i - 1)
            nodes.append(Server(name, KAFKA_VERSION, port, f"127.0.0.1:{port}", self.state / f"{name}.pid",
                                self.state / f"{name}.log"))
        return nodes

    def server(self, name: str) -> Server:
        for server in (*self.kafka_nodes, self.minio):
            if server.name == name:
                return server
        raise InfraError(f"no server {name!r} here: {', '.join(s.name for s in (*self.kafka_nodes, self.minio))}")

    def _data_dir(self, node: int) -> Path:
        return self.state / ("kafka-data" if node == 1 else f"kafka-data-{node}")

    def _recorded_brokers(self) -> int:
        """How many brokers this state dir's Kafka was formatted with (0: not formatted yet)."""
        return recorded_brokers(self.state) or (1 if (self._data_dir(1) / "meta.properties").exists() else 0)

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
        from infra.doctor import CHECKS, check

        ok, line = check(next(c for c in CHECKS if c.tool == "go"))
        if not ok:
            raise InfraError(f"cannot build MinIO: {line}")
        return _go_install(f"github.com/minio/minio@{MINIO_VERSION}", binary, f"MinIO {MINIO_VERSION}")

    def compose_binary(self) -> Path:
        """`docker-compose` built once from the Compose Go module: `config` validates the deployment file
        without a Docker engine. (`go install` refuses the module for its exclude directives, so it is built
        in a writable copy of the downloaded module.)"""
        binary = self.root / "compose" / COMPOSE_VERSION / "docker-compose"
        if binary.exists():
            return binary
        go = _need("go", "install Go 1.26 (see `python -m infra doctor`)")
        module = f"github.com/docker/compose/v5@{COMPOSE_VERSION}"
        print(f"building docker-compose {COMPOSE_VERSION} from its Go module into {binary.parent} (once, ~1 minute)",
              file=sys.stderr, flush=True)
        env = {**os.environ, "CGO_ENABLED": "0"}
        proc = subprocess.run([go, "mod", "download", "-json", module], capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise InfraError(f"`go mod download {module}` failed: {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        import json

        source = Path(json.loads(proc.stdout)["Dir"])
        work = binary.parent / "src"
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(source, work)
        for path in [work, *work.rglob("*")]:
            path.chmod(path.stat().st_mode | 0o200)
        proc = subprocess.run([go, "build", "-o", str(binary), "./cmd"], cwd=work, capture_output=True, text=True,
                              env=env)
        shutil.rmtree(work, ignore_errors=True)
        if proc.returncode != 0 or not binary.exists():
            raise InfraError(f"building docker-compose {COMPOSE_VERSION} failed: {proc.stderr[-3000:]}")
        return binary

    def promtool_binary(self) -> Path:
        """Prometheus's `promtool`, built once from its Go module: `check rules` and `test rules` run the
        alerting rules of infra/prometheus against series written in infra/prometheus/alerts_test.yml."""
        binary = self.root / "promtool" / PROMTOOL_VERSION / "promtool"
        if binary.exists():
            return binary
        return _go_install(f"github.com/prometheus/prometheus/cmd/promtool@{PROMTOOL_VERSION}", binary,
                           f"promtool {PROMTOOL_VERSION}")

    def fetch(self) -> None:
        self.kafka_libs()
        self.minio_binary()
        self.compose_binary()
        self.promtool_binary()

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

    def _kafka_config(self, node: int) -> Path:
        """Node `node`'s server.properties; formats every node's data dir (one cluster id) the first time."""
        self.state.mkdir(parents=True, exist_ok=True)
        factor, min_isr = replication(self.brokers)
        controllers = [(i, node.port + 1) for i, node in enumerate(self.kafka_nodes, 1)]  # next to its port
        # one node keeps the dynamic quorum it always had; a cluster names its voters statically
        quorum = (f"controller.quorum.bootstrap.servers=127.0.0.1:{controllers[0][1]}" if self.brokers == 1 else
                  "controller.quorum.voters=" + ",".join(f"{i}@127.0.0.1:{port}" for i, port in controllers))
        confs = []
        for i, controller in controllers:
            text = (HERE / "server.properties").read_text()
            for k, v in {"@NODE_ID@": str(i), "@QUORUM@": quorum, "@PORT@": str(controller - 1),
                         "@CONTROLLER_PORT@": str(controller), "@DATA_DIR@": str(self._data_dir(i)),
                         "@REPLICATION@": str(factor), "@MIN_ISR@": str(min_isr)}.items():
                text = text.replace(k, v)
            conf = self.state / ("server.properties" if i == 1 else f"server-{i}.properties")
            conf.write_text(text)
            confs.append(conf)
        if not (self._data_dir(1) / "meta.properties").exists():
            cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
            for conf in confs:
                # "=": a base64 id may start with "-", which argparse would take for an option
                args = ["kafka.tools.StorageTool", "format", f"--cluster-id={cluster_id}", "-c", str(conf)]
                proc = subprocess.run(self._java(args + (["--standalone"] if self.brokers == 1 else [])),
                                      capture_output=True, text=True)
                if proc.returncode != 0:
                    raise InfraError(f"formatting the Kafka data dir failed: {proc.stdout}{proc.stderr}")
            record_brokers(self.state, self.brokers)
        return confs[node - 1]

    def _java(self, args: list[str], log_file: Optional[Path] = None) -> list[str]:
        java = _need("java", "install Java 17 (apt-get install -y openjdk-17-jre-headless)")
        log4j = self.state / "log4j2.xml"
        self.state.mkdir(parents=True, exist_ok=True)
        log4j.write_text((HERE / "log4j2.xml").read_text())
        return [java, "-Xms256m", "-Xmx1g", "-XX:+UseG1GC", "-Djava.awt.headless=true",
                f"-Dlog4j2.configurationFile={log4j}", f"-Dkafka.logs.file={log_file or self.kafka.log_file}",
                "-cp", f"{self.kafka_libs()}/*", *args]

    def start_kafka(self, only: Optional[str] = None) -> str:
        """Start every node that is not running (or only the one named); wait until each answers and, on a
        cluster, until the cluster's metadata lists every broker."""
        nodes = [(i, n) for i, n in enumerate(self.kafka_nodes, 1) if only is None or n.name == only]
        down = [(i, n) for i, n in nodes if not read_pid(n.pid_file)]
        if not down:
            return "already running"
        for i, node in down:
            self._check_port_free(node, node.port + 1)
            self._spawn(node, self._java(["kafka.Kafka", str(self._kafka_config(i))], node.log_file))
        for _, node in down:
            self._wait(node, lambda: self._kafka_ready(node), 120)
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
        """How a client reaches these servers (every Kafka node in the bootstrap list)."""
        creds = self.minio_credentials()
        return Settings(",".join(node.address for node in self.kafka_nodes), self.minio.address,
                        creds["MINIO_ROOT_USER"], creds["MINIO_ROOT_PASSWORD"])

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

    def _wait(self, server: Server, ready: Callable[[], bool], timeout: float, most: float = 900.0) -> None:
        """Until `ready()`. A server whose log still grows is still working (a Kafka with thousands of
        partitions loads them for minutes): it gets up to `most` seconds; one whose log stood still for
        `timeout` seconds is given up on, with the end of its log in the error."""
        start = time.monotonic()
        last_growth, size, told = start, -1, start
        while True:
            if read_pid(server.pid_file) is None:
                raise InfraError(f"{server.name} exited during start; log {server.log_file}:\n{_tail(server.log_file)}")
            if ready():
                return
            now = time.monotonic()
            grown = server.log_file.stat().st_size if server.log_file.exists() else 0
            if grown != size:
                last_growth, size = now, grown
            if now - last_growth > timeout or now - start > most:
                why = (f"its log stood still for {timeout:.0f}s" if now - last_growth > timeout
                       else f"still starting after {most:.0f}s")
                raise InfraError(f"{server.name} did not become ready ({why}); log {server.log_file}:\n"
                                 f"{_tail(server.log_file)}")
            if now - told >= 30:
                told = now
                print(f"{server.name}: still starting after {now - start:.0f}s (its log is {size / 2**20:.1f} MiB "
                      "and growing)", file=sys.stderr, flush=True)
            time.sleep(0.5)

    def _kafka_ready(self, node: Optional[Server] = None) -> bool:
        """The node answers a metadata request, and that metadata lists every broker of the cluster."""
        node = node or self.kafka
        if not port_open(node.port):
            return False
        from confluent_kafka.admin import AdminClient  # a real client call, not just an open port

        try:
            meta = AdminClient({"bootstrap.servers": node.address}).list_topics(timeout=3)
        except Exception:
            return False
        return len(meta.brokers) >= self.brokers

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
        return {"minio": self.stop(self.minio), **{node.name: self.stop(node) for node in self.kafka_nodes}}

    def kill(self, name: str) -> None:
        """SIGKILL one server: "minio", "kafka" (node 1) or "kafka-N" (fault-injection tests)."""
        server = self.server(name)
        pid = read_pid(server.pid_file)
        if pid is not None:
            os.killpg(pid, signal.SIGKILL)
            while _alive(pid):
                time.sleep(0.05)

    def start(self, name: str) -> str:
        """Start "minio", every Kafka node that is down ("kafka"), or one node of a cluster ("kafka-N")."""
        if name == "minio":
            return self.start_minio()
        return self.start_kafka(only=None if name == "kafka" else self.server(name).name)

    def status(self) -> dict[str, dict[str, object]]:
        out: dict[str, dict[str, object]] = {}
        checks: list[tuple[Server, Callable[[], bool]]] = [
            *((node, functools.partial(self._kafka_ready, node)) for node in self.kafka_nodes),
            (self.minio, self._minio_ready)]
        for server, ready in checks:
            pid = read_pid(server.pid_file)
            out[server.name] = {"version": server.version, "address": server.address, "pid": pid,
                                "running": pid is not None, "ready": pid is not None and ready(),
                                "log": str(server.log_file)}
        return out
