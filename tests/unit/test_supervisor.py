"""The supervisor restarts what dies, with backoff, gives up on what keeps dying, and logs every step."""
from __future__ import annotations

import time
from pathlib import Path

from infra.settings import Settings
from infra.supervisor import Service, Supervisor

NO_PLATFORM = Settings("127.0.0.1:1", "127.0.0.1:1", "unused", "unused")  # these services reach nothing


def tick_until(sup: Supervisor, done: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():  # type: ignore[operator]
        assert time.monotonic() < deadline, [line for s in sup.services for line in s.history]
        sup.tick()
        time.sleep(0.05)


def test_a_crashed_service_is_restarted_after_its_backoff_and_a_finished_one_is_left_alone(tmp_path: Path) -> None:
    counter = tmp_path / "starts"
    # exits 3 on its first two starts, then runs until stopped
    flaky = ("import pathlib, sys, time\n"
             f"p = pathlib.Path({str(counter)!r}); n = len(p.read_text()) if p.exists() else 0\n"
             "p.write_text('x' * (n + 1))\n"
             "sys.exit(3) if n < 2 else time.sleep(60)\n")
    sup = Supervisor(NO_PLATFORM, tmp_path / "logs")
    crashing = sup.add(Service("flaky", ["-c", flaky]))
    oneshot = sup.add(Service("oneshot", ["-c", "print('done')"], oneshot=True))
    sup.start_due(lambda s: True)
    started = time.monotonic()
    tick_until(sup, lambda: crashing.running and crashing.restarts == 2)
    assert time.monotonic() - started >= 1.0 + 2.0  # backoff 1 s, then 2 s
    tick_until(sup, lambda: oneshot.finished)
    assert oneshot.restarts == 0 and oneshot.state == "exited 0"
    assert "running (2 restarts)" == crashing.state
    # Its third start has counted itself: a kill before that write ends would leave the count empty, and
    # the next starts would exit 3 again.
    tick_until(sup, lambda: counter.exists() and len(counter.read_text()) == 3)
    sup.kill(crashing)  # a crash after a run: restarted again
    tick_until(sup, lambda: crashing.running and crashing.restarts == 3)
    sup.stop_all()
    sup.tick()
    assert not crashing.running and crashing.restart_at is None  # a stop is not a crash
    log = (tmp_path / "logs" / "supervisor.log").read_text()
    assert log.count("flaky: exited 3; restarting in") == 2 and "flaky: killed (SIGKILL)" in log
    assert "oneshot: exited 0 (done)" in log


def test_a_service_that_keeps_dying_is_given_up(tmp_path: Path) -> None:
    sup = Supervisor(NO_PLATFORM, tmp_path / "logs", max_restarts=1)
    dying = sup.add(Service("dying", ["-c", "import sys; sys.exit(5)"]))
    sup.start_due(lambda s: True)
    tick_until(sup, lambda: dying.gave_up)
    assert dying.restarts == 1 and dying.state.startswith("failed (exited 5")
    assert "given up" in (tmp_path / "logs" / "supervisor.log").read_text()
