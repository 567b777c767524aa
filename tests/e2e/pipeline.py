"""Drives the pipeline's services as processes on a private Kafka + MinIO, for end-to-end tests."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from infra.kafka import end_offsets
from infra.launcher import Launcher
from infra.settings import Settings
from schemas.topics import Topics
from tests.integration.test_launcher import free_port_pair

ROOT = Path(__file__).resolve().parents[2]
MODEL = ["--layers", "2", "--width", "64"]


@dataclass
class PipelineRun:
    """A private stack (so a broker restart or a MinIO stop touches no other test) and its services."""

    root: Path
    ns: str = "e2e"
    launcher: Launcher = field(init=False)
    settings: Settings = field(init=False)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.launcher = Launcher(state_dir=self.root / "stack", kafka_port=free_port_pair(),
                                 minio_port=free_port_pair())
        self.launcher.up()
        self.settings = self.launcher.settings()

    @property
    def topics(self) -> Topics:
        return Topics(self.ns, partitions=2)

    def start(self, name: str, module: str, *argv: str) -> subprocess.Popen[bytes]:
        env = {**os.environ, **self.settings.as_env(), "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        env.pop("TRAJPIPE_FAULT", None)
        log = open(self.root / f"{name}.log", "ab")
        proc = subprocess.Popen([sys.executable, "-m", module, "--ns", self.ns, *argv], cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT)
        self.procs[name] = proc
        return proc

    def kill9(self, name: str) -> None:
        proc = self.procs.pop(name)  # a killed process is no failure to report
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)

    def stop(self, name: str, timeout: float = 120.0) -> int:
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                return proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                return -9
        return int(proc.returncode)

    def count(self, topic: str) -> int:
        try:
            return sum(hi - lo for lo, hi in end_offsets(self.settings, topic, timeout=3).values())
        except Exception:
            return -1

    def wait_until(self, what: str, ok: Callable[[], bool], timeout: float = 240.0, every: float = 0.5) -> None:
        deadline = time.monotonic() + timeout
        while not ok():
            dead = [n for n, p in self.procs.items() if p.poll() not in (None, 0)]
            if dead or time.monotonic() > deadline:
                raise AssertionError(f"waiting for {what}: dead {dead}; logs:\n{self.logs()}")
            time.sleep(every)

    def settled(self, topic: str, quiet_s: float = 8.0, timeout: float = 240.0) -> int:
        """The record count of `topic` once it has not grown for quiet_s seconds."""
        last, since = self.count(topic), time.monotonic()
        deadline = time.monotonic() + timeout
        while time.monotonic() - since < quiet_s:
            if time.monotonic() > deadline:
                raise AssertionError(f"{topic} never settled; logs:\n{self.logs()}")
            time.sleep(1.0)
            now = self.count(topic)
            if now != last:
                last, since = now, time.monotonic()
        return last

    def logs(self, tail: int = 1500) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-tail:]}" for p in self.root.glob("*.log"))

    def close(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self.launcher.down()

    def producer_args(self, episodes: int, producer_id: str, seed: int) -> list[str]:
        return ["--sources", "math-easy", "--episodes", str(episodes), "--group-size", "4", "--prompts-per-step",
                "2", "--max-new-tokens", "6", "--max-policy-lag", "1000", "--producer-id", producer_id,
                "--seed", str(seed), *MODEL]

