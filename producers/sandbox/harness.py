"""In-sandbox test harness: a judge process runs the checks, a player process runs the untrusted solution.

The host copies this file into each run's work dir; the sandboxed interpreter runs it as
`python -I -S -B harness.py WORKDIR`. Standard library only; it never imports the package.

Why two processes. Code that runs in the process that counts the assertions can rewrite the counting
(patch the recorder, walk up the frames, swap builtins, return an object whose __eq__ is always True).
So the solution runs in a forked *player* and the instrumented check() runs in the *judge*. check()
calls proxies; each call travels to the player as marshal (judge to player only: marshal is not safe to
read from an untrusted writer) and the return value comes back as tagged JSON that the judge decodes
into built-in values only (lists, tuples, dicts, sets, numbers, strings, bytes, None). Nothing the
player sends is ever executed or compared by the player's own code.

Order of one run (the judge is the process the backend started):
1. Read job.marshal (solution, entry point, limits), lower the rlimits, fork the player. The player
   blocks until the judge says "go", so no untrusted code runs yet.
2. The judge makes itself non-dumpable (prctl): a same-uid process may then neither ptrace it nor open
   its /proc/<pid>/mem or fds. It reads and deletes the nonce and the tests, which the player therefore
   never has on disk or in memory (the tests cannot be read to hard-code their answers).
3. START_MARKER goes to fd 1; the host treats a run without it as infra_error (nothing untrusted ran)
   and a run with it but without a valid report as the program's fault.
4. "go": the player compiles (syntax_error) and runs (runtime_error / memory_exceeded) the solution and
   answers calls. The judge runs check() against the entry point and the helpers the tests name.
5. The judge kills the player and writes result.txt: outcome, counts and message with a SHA-256 digest
   keyed by the nonce. The nonce itself is never written, so a left-over process that reads the report
   still cannot forge another one. os._exit skips atexit hooks.

What remains: the solution controls the helpers the tests call (HumanEval prompts define them, e.g.
poly() of HumanEval/32), and a program can kill the judge (no report: runtime_error, never a pass).
"""
from __future__ import annotations

import marshal
import os
import resource
import select
import sys
import time
from _signal import SIGKILL, SIGXCPU  # `signal` itself would import enum

# typing, json, hashlib and traceback each cost milliseconds to import, typing alone more than a typical
# run: annotations stay strings, JSON goes through the C scanner directly, traceback is imported on the
# failure path only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, NoReturn

START_MARKER = b"\x1etrajpipe-harness-started\n"
REPORT_HEADER = "trajpipe-report 2"
SOLUTION_FILE = "<solution>"
TESTS_FILE = "<tests>"
RECORDER_GLOBAL = "__trajpipe_recorder"
MESSAGE_CAP = 1500
MESSAGE_MAX_BYTES = 64 << 20
NESTING_MAX = 200
GO = b"go"
PR_SET_DUMPABLE = 4
RTLD_NOW = 2
CPU_SIGNALS = (SIGXCPU, SIGKILL)
INFINITY = float("inf")
LOAD_OUTCOMES = ("syntax_error", "runtime_error", "memory_exceeded")
SOURCES: dict[str, str] = {}  # file name -> code, handed to linecache only when a traceback is formatted


class PlayerGone(Exception):
    """The player process died or broke the protocol; `status` is its wait status when known."""

    def __init__(self, why: str, status: int | None = None) -> None:
        super().__init__(why)
        self.status = status


class CandidateRaised(Exception):
    """The solution raised inside the player; the message is its short traceback."""


# ------------------------------------------------------------------------------------------ wire

def send(fd: int, payload: bytes) -> None:
    data = memoryview(len(payload).to_bytes(4, "little") + payload)
    while data:
        data = data[os.write(fd, data):]


def read_exact(fd: int, size: int, alive: Callable[[], None]) -> bytes:
    data = bytearray()
    while len(data) < size:
        ready, _, _ = select.select([fd], [], [], 0.05)
        if not ready:
            alive()  # a descendant of a dead player may hold the pipe open: EOF alone is not enough
            continue
        chunk = os.read(fd, min(size - len(data), 1 << 20))
        if not chunk:
            raise PlayerGone("the program closed its channel")
        data += chunk
    return bytes(data)


def receive(fd: int, alive: Callable[[], None]) -> bytes:
    size = int.from_bytes(read_exact(fd, 4, alive), "little")
    if size > MESSAGE_MAX_BYTES:
        raise PlayerGone(f"the program sent a {size}-byte message")
    return read_exact(fd, size, alive)


def encode_json(value: Any, depth: int = 0) -> str:
    """Plain values as tagged JSON; TypeError for anything a custom class could hide behind."""
    import _json

    if depth > NESTING_MAX:
        raise TypeError("candidate returned a value nested too deeply")
    kind = type(value)
    if value is None or kind is bool:
        return "null" if value is None else ("true" if value else "false")
    if kind is int:
        return str(value)
    if kind is float:
        if value != value:
            return "NaN"
        if value in (INFINITY, -INFINITY):
            return "Infinity" if value > 0 else "-Infinity"
        return repr(value)
    if kind is str:
        return _json.encode_basestring_ascii(value)
    return encode_tagged(kind, value, depth)


CONTAINER_TAGS: dict[type, str] = {list: "l", tuple: "t", set: "s", frozenset: "f"}


def encode_tagged(kind: type, value: Any, depth: int) -> str:
    tag = CONTAINER_TAGS.get(kind)
    if tag is not None:
        return '{"%s":[%s]}' % (tag, ",".join(encode_json(item, depth + 1) for item in value))
    if kind is dict:
        pairs = ",".join(f"[{encode_json(k, depth + 1)},{encode_json(v, depth + 1)}]" for k, v in value.items())
        return '{"d":[%s]}' % pairs
    if kind is complex:
        return '{"c":[%s,%s]}' % (encode_json(value.real), encode_json(value.imag))
    if kind is bytes:
        return '{"b":"%s"}' % value.hex()
    raise TypeError(f"candidate returned a {kind.__name__!s} object: only built-in values "
                    "(numbers, strings, bytes, lists, tuples, dicts, sets, None) are accepted")


class _ScanContext:
    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = float  # NaN, Infinity, -Infinity
    memo: dict[str, str] = {}


def decode_json(text: str) -> Any:
    """Parse JSON written by the player (untrusted) into JSON values; PlayerGone when it is not JSON."""
    import _json

    try:
        value, end = _json.make_scanner(_ScanContext())(text, 0)  # type: ignore[arg-type]
    except (StopIteration, ValueError, RecursionError) as exc:
        raise PlayerGone(f"the program sent malformed data ({type(exc).__name__})") from None
    if end != len(text):
        raise PlayerGone("the program sent trailing data")
    return value


def untag(value: Any) -> Any:
    """Rebuild the built-in value a tagged JSON value stands for."""
    if type(value) is list:
        raise PlayerGone("the program sent an untagged list")
    if type(value) is not dict:
        return value
    if len(value) != 1:
        raise PlayerGone("the program sent a malformed value")
    ((tag, body),) = value.items()
    try:
        return UNTAGGERS[tag](body)
    except (KeyError, TypeError, ValueError, RecursionError) as exc:
        raise PlayerGone(f"the program sent a malformed value ({type(exc).__name__})") from None


UNTAGGERS: dict[str, Callable[[Any], Any]] = {
    "l": lambda body: [untag(item) for item in body],
    "t": lambda body: tuple(untag(item) for item in body),
    "s": lambda body: {untag(item) for item in body},
    "f": lambda body: frozenset(untag(item) for item in body),
    "d": lambda body: {untag(k): untag(v) for k, v in body},
    "c": lambda body: complex(float(body[0]), float(body[1])),
    "b": lambda body: bytes.fromhex(body),
}


# ------------------------------------------------------------------------------------------ player

def player_main(job: dict[str, Any], requests: int, replies: int) -> NoReturn:
    """The forked child: wait for go, load the solution, answer calls until the judge hangs up."""
    try:
        if receive(requests, lambda: None) != GO:
            os._exit(0)
        namespace: dict[str, Any] = {"__name__": "solution"}  # `if __name__ == "__main__":` stays off
        reply(replies, load_solution(job["solution"], namespace))
        while True:
            name, args, kwargs = marshal.loads(receive(requests, lambda: None))
            reply(replies, call(namespace, name, args, kwargs))
    except BaseException:  # the judge hung up, or the program broke the player's own loop
        os._exit(0)


def reply(fd: int, message: str) -> None:
    flush_streams()  # the judge SIGKILLs the player at the end: nothing may stay in its buffers
    send(fd, message.encode("ascii"))


def load_solution(source: str, namespace: dict[str, Any]) -> str:
    SOURCES[SOLUTION_FILE] = source
    try:
        code = compile(source, SOLUTION_FILE, "exec", dont_inherit=True)
    except MemoryError:
        return outcome_json("memory_exceeded", "memory limit exceeded while compiling the solution")
    except (SyntaxError, ValueError, RecursionError, OverflowError) as exc:  # ValueError: NUL bytes
        import traceback

        return outcome_json("syntax_error", "".join(traceback.format_exception_only(type(exc), exc)).strip())
    try:
        exec(code, namespace)
    except MemoryError:
        namespace.clear()
        return outcome_json("memory_exceeded", "MemoryError while loading the solution (memory limit)")
    except BaseException as exc:
        return outcome_json("runtime_error", "the solution raised while loading:\n" + exception_summary(exc))
    names = [name for name, value in namespace.items() if callable(value) and isinstance(name, str)]
    return '{"loaded":[%s]}' % ",".join(encode_json(name) for name in names)


def outcome_json(outcome: str, message: str) -> str:
    return '{"outcome":%s,"message":%s}' % (encode_json(outcome), encode_json(message[-MESSAGE_CAP:]))


def call(namespace: dict[str, Any], name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    try:
        value = namespace[name](*args, **kwargs)
        return '{"value":%s}' % encode_json(value)
    except MemoryError:
        return '{"memory":true}'
    except BaseException as exc:
        return '{"raised":%s}' % encode_json(exception_summary(exc)[-MESSAGE_CAP:])


# ------------------------------------------------------------------------------------------ judge

class Player:
    """The judge's handle on the player: start it, call into it, tell how it ended."""

    def __init__(self, job: dict[str, Any], judge_only: tuple[int, ...] = ()) -> None:
        request_r, self.requests = os.pipe()
        self.replies, reply_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(self.requests)
            os.close(self.replies)
            for fd in judge_only:  # the report pipe: only the judge may write a report
                os.close(fd)
            player_main(job, request_r, reply_w)
        os.close(request_r)
        os.close(reply_w)

    def start(self) -> dict[str, Any]:
        send(self.requests, GO)
        return self.message()

    def message(self) -> dict[str, Any]:
        data = decode_json(receive(self.replies, self.check_alive).decode("ascii", "replace"))
        if type(data) is not dict:
            raise PlayerGone("the program sent a malformed message")
        return data

    def call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            send(self.requests, marshal.dumps((name, args, kwargs)))
        except BrokenPipeError:
            self.check_alive()
            raise PlayerGone("the program closed its channel") from None
        answer = self.message()
        if "value" in answer:
            return untag(answer["value"])
        if "memory" in answer:
            raise MemoryError
        raise CandidateRaised(str(answer.get("raised", "the call failed")))

    def check_alive(self) -> None:
        pid, status = os.waitpid(self.pid, os.WNOHANG)
        if pid:
            raise PlayerGone("the program exited", status)

    def stop(self) -> None:
        try:
            os.kill(self.pid, SIGKILL)
        except ProcessLookupError:
            pass


def proxy(player: Player, name: str, recorder: Recorder | None) -> Callable[..., Any]:
    """What check() sees under a solution's name: the call runs in the player."""
    def call_player(*args: Any, **kwargs: Any) -> Any:
        value = player.call(name, args, kwargs)
        if recorder is not None:
            recorder.last_return = (value,)
        return value
    call_player.__name__ = name
    return call_player


class Recorder:
    """Counts assertion outcomes; the instrumented check() calls ok() or fail() once per assert."""

    def __init__(self) -> None:
        self.passed = 0
        self.total = 0
        self.first_failure: str | None = None
        self.last_return: tuple[Any, ...] = ()

    def ok(self) -> None:
        self.passed += 1
        self.total += 1
        self.last_return = ()

    def fail(self, line: int, source: str, exc: BaseException) -> None:
        if isinstance(exc, (MemoryError, PlayerGone)):
            raise exc  # the run is over, this is not one failed assertion
        self.total += 1
        if self.first_failure is None:
            self.first_failure = describe_failure(line, source, exc, self.last_return)
        self.last_return = ()


def describe_failure(line: int, source: str, exc: BaseException, last_return: tuple[Any, ...]) -> str:
    """The first failing assertion, what the candidate returned, or what it raised: short, for the model."""
    parts = [f"first failing assertion (test line {line}): {source}"]
    if isinstance(exc, AssertionError) and last_return:
        parts.append(f"candidate returned: {safe_repr(last_return[0])}")
    elif not isinstance(exc, AssertionError):
        parts.append(exception_summary(exc))
    return "\n".join(parts)


def safe_repr(value: Any) -> str:
    import reprlib

    short = reprlib.Repr()
    short.maxstring = short.maxother = 160
    short.maxlist = short.maxtuple = short.maxset = short.maxfrozenset = short.maxdict = 12
    try:
        return short.repr(value)
    except Exception:  # built-in values only, but a repr must never take the report down
        return f"<unprintable {type(value).__name__}>"


def exception_summary(exc: BaseException) -> str:
    """The exception line and the last few frames of the solution (test and harness frames are noise)."""
    if isinstance(exc, CandidateRaised):
        return str(exc)
    try:
        import linecache
        import traceback

        for filename, source in SOURCES.items():
            linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == SOLUTION_FILE]
        head = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        if not frames:
            return head
        return "Traceback (solution frames):\n" + "".join(traceback.format_list(frames[-4:])) + head
    except Exception:
        return f"{type(exc).__name__} (unprintable)"


def report(outcome: str, message: str = "", passed: int = 0, total: int = 0) -> dict[str, Any]:
    return {"outcome": outcome, "passed": passed, "total": total, "message": message[-MESSAGE_CAP:]}


def gone_report(gone: PlayerGone, player: Player, recorder: Recorder | None) -> dict[str, Any]:
    """The player died: by the CPU limit (timeout), a signal or an exit (runtime_error)."""
    status = gone.status if gone.status is not None else wait_briefly(player)
    passed, total = (recorder.passed, recorder.total) if recorder else (0, 0)
    if status is not None and os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        if number in CPU_SIGNALS:
            return report("timeout", "killed: CPU-time limit exceeded", passed, total)
        return report("runtime_error", f"the program was killed by {signal_name(number)}", passed, total)
    code = os.WEXITSTATUS(status) if status is not None else "unknown"
    return report("runtime_error", f"{gone} (exit status {code}) before the tests finished", passed, total)


def signal_name(number: int) -> str:
    import signal

    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def wait_briefly(player: Player) -> int | None:
    for _ in range(50):
        pid, status = os.waitpid(player.pid, os.WNOHANG)
        if pid:
            return status
        time.sleep(0.01)
    return None


def judge(job: dict[str, Any], tests: Any, player: Player) -> dict[str, Any]:
    try:
        loaded = player.start()
    except PlayerGone as gone:
        return gone_report(gone, player, None)
    if "loaded" not in loaded:
        return load_failure(loaded)
    names = loaded["loaded"]
    if type(names) is not list or not all(type(name) is str for name in names):
        return report("runtime_error", "the program sent a malformed load report")
    entry = job["entry_point"]
    if entry not in names:
        return report("failed", f"the solution defines no function {entry}()")
    recorder = Recorder()
    namespace: dict[str, Any] = {"__name__": "tests", RECORDER_GLOBAL: recorder}
    for name in {entry, *job["helpers"]} & set(names):
        namespace[name] = proxy(player, name, recorder if name == entry else None)
    exec(tests, namespace)
    return run_check(namespace[job["check"]], namespace[entry], recorder, player)


def load_failure(loaded: dict[str, Any]) -> dict[str, Any]:
    outcome, message = loaded.get("outcome"), loaded.get("message")
    if outcome not in LOAD_OUTCOMES or type(message) is not str:
        return report("runtime_error", "the program sent a malformed load report")
    return report(outcome, message)


def run_check(check: Callable[..., Any], candidate: Callable[..., Any], recorder: Recorder,
              player: Player) -> dict[str, Any]:
    stopped = ""
    try:
        check(candidate)
    except MemoryError:
        return report("memory_exceeded", "MemoryError while running the tests (memory limit)",
                      recorder.passed, recorder.total)
    except PlayerGone as gone:
        return gone_report(gone, player, recorder)
    except BaseException as exc:
        stopped = "check() stopped early:\n" + exception_summary(exc)
    failed = recorder.total - recorder.passed
    if not failed and not stopped:
        return report("passed", "", recorder.passed, recorder.total)
    lines = [f"{recorder.passed} of {recorder.total} assertions passed"]
    lines += [text for text in (recorder.first_failure, stopped) if text]
    return report("failed", "\n".join(lines), recorder.passed, recorder.total)


# ------------------------------------------------------------------------------------------ setup

def lower_limit(which: int, soft: int, hard: int | None = None) -> None:
    """Set an rlimit, never above the hard limit already in force (raising it needs privileges)."""
    hard = soft if hard is None else hard
    _, current = resource.getrlimit(which)
    if current != resource.RLIM_INFINITY:
        soft, hard = min(soft, current), min(hard, current)
    resource.setrlimit(which, (soft, hard))


def threads_of(uid: int) -> int:
    """Tasks this uid already runs: RLIMIT_NPROC counts them all when there is no per-run identity."""
    count = 0
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and os.stat(f"/proc/{entry}").st_uid == uid:
                count += len(os.listdir(f"/proc/{entry}/task"))
        except OSError:
            continue
    return count


def apply_limits(limits: dict[str, Any]) -> None:
    # SIGXCPU at the soft limit; the hard limit one second later kills a program that ignores it.
    lower_limit(resource.RLIMIT_CPU, limits["cpu_s"], limits["cpu_s"] + 1)
    lower_limit(resource.RLIMIT_AS, limits["memory_bytes"])
    lower_limit(resource.RLIMIT_FSIZE, limits["file_bytes"])
    lower_limit(resource.RLIMIT_CORE, 0)
    processes = limits.get("processes")
    if processes is not None:
        processes += 1  # the judge
        if limits.get("processes_relative"):
            processes += threads_of(os.getuid())
        lower_limit(resource.RLIMIT_NPROC, processes)


def make_undumpable() -> None:
    """Forbid same-uid ptrace and /proc/<pid>/{mem,fd} access to this process (best effort)."""
    try:
        # _ctypes, not ctypes: the package costs about 4 ms to import, a tenth of a run
        from _ctypes import FUNCFLAG_CDECL, CFuncPtr, dlopen, dlsym

        class CFunction(CFuncPtr):  # returns a C int, takes Python ints as C ints
            _flags_ = FUNCFLAG_CDECL

        libc = dlopen(None, RTLD_NOW)  # type: ignore[arg-type]  # None: the program itself, as dlopen(3)
        CFunction(dlsym(libc, "prctl"))(PR_SET_DUMPABLE, 0, 0, 0, 0)
    except Exception:  # no ctypes or no libc: the isolation still holds, only this hardening is lost
        pass


def take_file(workdir: str, name: str) -> str:
    path = os.path.join(workdir, name)
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    os.unlink(path)
    return text


def sha256_hex(data: bytes) -> str:
    try:
        from _sha256 import sha256  # hashlib would load OpenSSL: ~10x slower to import
    except ImportError:
        from hashlib import sha256
    return str(sha256(data).hexdigest())


def encode_report(nonce: str, result: dict[str, Any]) -> bytes:
    """Header, digest, outcome, passed, total one per line, then the message; the digest covers all but
    the header and is keyed by the nonce, which the file never contains."""
    body = "\n".join([result["outcome"], str(result["passed"]), str(result["total"]), result["message"]])
    encoded = body.encode("utf-8", "replace")
    digest = sha256_hex(nonce.encode("ascii") + b"\n" + encoded)
    return f"{REPORT_HEADER}\n{digest}\n".encode("ascii") + encoded


def write_result(workdir: str, data: bytes, report_fd: int | None = None) -> None:
    """The report to the host's pipe when it gave one (an isolating backend: the work dir is a tmpfs the
    host cannot read), else to result.txt in the work dir."""
    if report_fd is not None:
        view = memoryview(data)
        while view:
            view = view[os.write(report_fd, view):]
        os.close(report_fd)
        return
    path = os.path.join(workdir, "result.txt")
    try:
        os.unlink(path)  # whatever the program left there (a file, a symlink) is not ours
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def flush_streams() -> None:
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # the program may have closed or replaced them
            pass


def main(argv: list[str]) -> NoReturn:
    """`harness.py WORKDIR [REPORT_FD]`."""
    workdir = os.path.abspath(argv[1])
    report_fd = int(argv[2]) if len(argv) > 2 else None
    with open(os.path.join(workdir, "job.marshal"), "rb") as handle:
        job = marshal.load(handle)
    apply_limits(job["limits"])
    player = Player(job, () if report_fd is None else (report_fd,))
    make_undumpable()
    nonce = take_file(workdir, "nonce").strip()
    tests = compile(take_file(workdir, "tests.py"), TESTS_FILE, "exec", dont_inherit=True)
    os.write(1, START_MARKER)
    try:
        result = judge(job, tests, player)
    except MemoryError:
        result = report("memory_exceeded", "MemoryError in the test harness (memory limit)")
    except BaseException as exc:  # the program found a way to break the judge: its fault, not infra
        result = report("runtime_error", "the program disturbed the test harness:\n" + exception_summary(exc))
    player.stop()
    write_result(workdir, encode_report(nonce, result), report_fd)
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv)
