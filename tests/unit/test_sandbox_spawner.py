"""The bwrap backend's slots (a run cgroup and the spawner that forks every run inside it), for real."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

from producers.sandbox import Limits, cgroups, run_tests, unavailable_reason
from producers.sandbox.bwrap_backend import BwrapBackend
from producers.sandbox.workdir import HARNESS_SOURCE, harness_bytecode
from tests.unit.test_sandbox import PROBE_TEST, _processes_with

REPO = Path(__file__).resolve().parents[2]
FAST = Limits(wall_time_s=10.0, cpu_time_s=10.0)


@pytest.fixture()
def backend() -> BwrapBackend:
    reason = unavailable_reason("bwrap") or cgroups.unavailable_reason()
    if reason is not None:
        pytest.skip(f"needs bwrap and a memory cgroup: {reason}")
    made = BwrapBackend()
    yield made
    made.close()


def probe(backend: BwrapBackend, body: str, limits: Limits = FAST):
    solution = "def probe():\n" + textwrap.indent(textwrap.dedent(body), "    ")
    return run_tests(solution, PROBE_TEST, "probe", limits, backend)


def idle_slots(backend: BwrapBackend) -> list:
    return list(backend._slots._idle)


def members(group: cgroups.RunCgroup) -> set[str]:
    return {pid for d in group.dirs for pid in (d / "cgroup.procs").read_text().split()}


def test_runs_reuse_one_slot_whose_spawner_alone_stays_and_close_removes_it(backend: BwrapBackend) -> None:
    marker = f"{4000 + uuid.uuid4().int % 1000}.{uuid.uuid4().int % 10**6:06d}"
    leaves_a_process = f"""
        import subprocess
        subprocess.Popen(["sleep", "{marker}"], start_new_session=True)
        return "contained"
    """
    first = probe(backend, leaves_a_process)
    [slot] = idle_slots(backend)
    assert first.outcome == "passed", first
    assert members(slot.group) == {str(slot.spawner.pid)}  # the run's processes are gone, the spawner stays
    second = probe(backend, leaves_a_process)
    assert second.outcome == "passed" and idle_slots(backend) == [slot], second
    assert _processes_with(marker) == []
    dirs = slot.group.dirs
    backend.close()
    assert not any(d.exists() for d in dirs)
    assert slot.spawner.process.poll() is not None


def test_an_oom_kill_is_blamed_on_its_own_run_only(backend: BwrapBackend) -> None:
    """The slot's group counts OOM kills since it was made; a run is judged by the kills during it."""
    limits = Limits(wall_time_s=20.0, cpu_time_s=20.0, memory_mb=512, run_memory_mb=160, processes=16)
    hog = probe(backend, "block = bytearray(300 << 20)\nreturn 'filled'", limits)
    assert hog.outcome == "memory_exceeded", hog
    after = probe(backend, "return 'contained'", limits)
    assert after.outcome == "passed", after
    assert len(idle_slots(backend)) == 1  # the same slot ran both


def test_a_spawner_killed_between_runs_or_during_one_costs_that_run_at_most(backend: BwrapBackend) -> None:
    assert probe(backend, "return 'contained'").outcome == "passed"
    [slot] = idle_slots(backend)
    os.kill(slot.spawner.pid, signal.SIGKILL)
    slot.spawner.process.wait()
    assert probe(backend, "return 'contained'").outcome == "passed"  # a fresh slot
    [fresh] = idle_slots(backend)
    assert fresh is not slot and not any(d.exists() for d in slot.group.dirs)

    killer = threading.Timer(1.0, os.kill, (fresh.spawner.pid, signal.SIGKILL))
    killer.start()
    lost = probe(backend, "import time\ntime.sleep(5)\nreturn 'contained'")
    killer.join()
    assert lost.outcome == "infra_error" and "spawner" in lost.stderr, lost
    assert probe(backend, "return 'contained'").outcome == "passed"


HOST = """
import os, sys
sys.path.insert(0, {repo!r})
from producers.sandbox import Limits, run_tests
from producers.sandbox.bwrap_backend import BwrapBackend
print("started", flush=True)
marker = os.environ["MARKER"]  # not in this process's command line, where the test looks for the run
run_tests(f"def probe():\\n    import subprocess\\n    subprocess.run(['sleep', {{marker!r}}])\\n",
          "def check(candidate):\\n    candidate()\\n", "probe", Limits(wall_time_s=60.0), BwrapBackend())
"""


def test_a_host_killed_9_takes_its_spawner_and_the_run_with_it(backend: BwrapBackend) -> None:
    marker = f"{5000 + uuid.uuid4().int % 1000}.{uuid.uuid4().int % 10**6:06d}"
    host = subprocess.Popen([sys.executable, "-c", HOST.format(repo=str(REPO))], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "MARKER": marker})
    assert host.stdout is not None and host.stdout.readline().strip() == "started"
    deadline = time.monotonic() + 30
    while not _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes_with(marker), "the run never started"
    spawners = [pid for pid in _processes_with("spawn_server.py") if parent_of(pid) == host.pid]
    assert spawners, "the host started no spawner"
    groups = [Path(f"/sys/fs/cgroup/{line.split(':')[1]}{line.split(':')[2]}")
              for line in Path(f"/proc/{spawners[0]}/cgroup").read_text().splitlines()
              if "trajpipe-run-" in line and line.split(":")[1] in ("memory", "pids", "")]
    assert groups and all(g.is_dir() for g in groups), groups
    host.kill()
    host.wait()
    deadline = time.monotonic() + 10
    while (_processes_with(marker) or set(spawners) & set(_processes_with("spawn_server.py"))) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes_with(marker) == []
    while any(g.exists() for g in groups) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [g for g in groups if g.exists()] == []  # the spawner removed its groups on its way out
    left = set(spawners) & set(_processes_with("spawn_server.py"))
    assert left == set()


def parent_of(pid: str) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_the_compiled_harness_is_this_interpreters_bytecode(tmp_path: Path) -> None:
    """harness.pyc runs as a script under this interpreter; its header carries this version's magic."""
    compiled = harness_bytecode(HARNESS_SOURCE)
    assert compiled[:4] == __import__("importlib.util").util.MAGIC_NUMBER
    (tmp_path / "harness.pyc").write_bytes(compiled)
    done = subprocess.run([sys.executable, "-I", "-S", "-B", str(tmp_path / "harness.pyc")],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode != 0 and "IndexError" in done.stderr  # main() ran: it wants a work dir argument
