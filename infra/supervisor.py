"""Runs the pipeline's services as processes the way a deployment's restart policy would.

    sup = Supervisor(settings, log_dir)
    sup.add(Service("streams", ["streams", "--ns", ns]))      # `python -m streams --ns NS`, logs/streams.log
    sup.start_due(lambda s: s.when == "start")
    while not done:
        sup.tick()                                              # restarts what died, after its backoff
    sup.stop_all()

A service that exits with a non-zero status (or is killed) is started again after a backoff that doubles
from 1 s up to 30 s, and resets once it has run for a minute; after `max_restarts` failures in a row it is
given up (state "failed"). A one-shot service (`oneshot`) that exits 0 is done; any other service that
exits 0 is done too (the learner, at its last update). Every start, exit and restart is a line in
`supervisor.log` and in `Service.history`, which the demo's live view shows.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable, Optional

from infra.settings import Settings

BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
HEALTHY_AFTER_S = 60.0  # a run this long resets the backoff and the failure count


@dataclass
class Service:
    name: str
    argv: list[str]  # after `python -m` (or `python` when it starts with "-c")
    when: str = "start"  # when the caller starts it: "start", or a phase it names (the demo's "rl")
    oneshot: bool = False  # exits by itself when its work is done (rc 0), e.g. publishing demonstrations
    threads: int = 1  # OMP_NUM_THREADS
    env: dict[str, str] = field(default_factory=dict)
    proc: Optional[subprocess.Popen[bytes]] = None
    log: Optional[IO[bytes]] = None
    rc: Optional[int] = None  # the last exit status
    restarts: int = 0  # restarts so far
    failures: int = 0  # failures in a row (reset by a healthy run)
    started_at: float = 0.0
    restart_at: Optional[float] = None  # when a restart is due
    exit_seen: bool = False  # the current process's exit was handled
    gave_up: bool = False
    history: list[str] = field(default_factory=list)

    @property
    def state(self) -> str:
        if self.gave_up:
            return f"failed (exited {self.rc}, {self.restarts} restarts)"
        if self.restart_at is not None:
            return f"exited {self.rc}; restart in {max(0.0, self.restart_at - time.monotonic()):.0f}s"
        if self.proc is None:
            return "not started"
        rc = self.proc.poll()
        if rc is None:
            return "running" + (f" ({self.restarts} restarts)" if self.restarts else "")
        return f"exited {rc}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def finished(self) -> bool:
        """Exited 0 by itself and not due for a restart."""
        return self.proc is not None and self.proc.poll() == 0 and self.restart_at is None


class Supervisor:
    def __init__(self, settings: Settings, log_dir: Path, max_restarts: int = 10,
                 echo: Callable[[str], None] = lambda line: None) -> None:
        self.settings = settings
        self.log_dir = log_dir
        self.max_restarts = max_restarts
        self.echo = echo
        self.services: list[Service] = []
        log_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(log_dir / "supervisor.log", "a", encoding="utf-8")

    def add(self, service: Service) -> Service:
        self.services.append(service)
        return service

    def __getitem__(self, name: str) -> Service:
        return next(s for s in self.services if s.name == name)

    def note(self, service: Service, what: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {service.name}: {what}"
        service.history.append(line)
        self._log.write(line + "\n")
        self._log.flush()
        self.echo(line)

    def start(self, service: Service) -> None:
        if service.log is None:
            service.log = open(self.log_dir / f"{service.name}.log", "ab")
        env = {**os.environ, **self.settings.as_env(), "PYTHONUNBUFFERED": "1",
               "OMP_NUM_THREADS": str(service.threads), **service.env}
        args = service.argv if service.argv[:1] == ["-c"] else ["-m", *service.argv]
        service.proc = subprocess.Popen([sys.executable, *args], stdout=service.log,
                                        stderr=subprocess.STDOUT, env=env, start_new_session=True)
        service.started_at, service.restart_at, service.exit_seen = time.monotonic(), None, False
        self.note(service, f"started (pid {service.proc.pid})")

    def start_due(self, due: Callable[[Service], bool]) -> None:
        for service in self.services:
            if service.proc is None and due(service):
                self.start(service)

    def tick(self) -> None:
        """Notice exits, schedule restarts with backoff, start those that are due."""
        now = time.monotonic()
        for s in self.services:
            if s.proc is None or s.gave_up:
                continue
            if s.restart_at is not None:
                if now >= s.restart_at:
                    s.restarts += 1
                    self.start(s)
                continue
            rc = s.proc.poll()
            if rc is None or s.exit_seen:
                continue
            s.exit_seen, s.rc = True, rc
            if rc == 0:
                self.note(s, f"exited 0 ({'done' if s.oneshot else 'finished'})")
                continue
            s.failures = 1 if now - s.started_at >= HEALTHY_AFTER_S else s.failures + 1
            if s.failures > self.max_restarts:
                s.gave_up = True
                self.note(s, f"exited {rc}; {s.failures - 1} restarts in a row did not help: given up")
                continue
            delay = BACKOFF_S[min(s.failures - 1, len(BACKOFF_S) - 1)]
            s.restart_at = now + delay
            self.note(s, f"exited {rc}; restarting in {delay:.0f}s (failure {s.failures} in a row)")

    def stop(self, service: Service, timeout: float = 120.0) -> None:
        service.restart_at, service.exit_seen = None, True  # a stop is no failure to restart
        if service.proc is not None and service.proc.poll() is None:
            service.proc.send_signal(signal.SIGTERM)
            try:
                service.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                service.proc.kill()
                service.proc.wait()
            self.note(service, f"stopped: exited {service.proc.returncode}")
        if service.proc is not None:
            service.rc = service.proc.returncode
        if service.log is not None:
            service.log.close()
            service.log = None

    def stop_all(self, first: Callable[[Service], bool] = lambda s: False) -> None:
        """Stop every service: those matching `first` before the others, the rest in the order added."""
        for service in [s for s in self.services if first(s)] + [s for s in self.services if not first(s)]:
            self.stop(service)
        self._log.close()

    def kill(self, service: Service) -> None:
        """SIGKILL (a crash, for chaos tests): the next tick restarts it."""
        if service.proc is not None and service.proc.poll() is None:
            self.note(service, "killed (SIGKILL)")
            service.proc.kill()
            service.proc.wait()
