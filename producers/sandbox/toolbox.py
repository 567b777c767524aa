"""In-sandbox runner of one shell command against a repository: the terminal domain's `run` tool.

The host copies this file into the run's work dir as harness.py; the sandboxed interpreter runs it as
`python -I -S -B harness.py WORKDIR [REPORT_FD]`. Standard library only; it never imports the package, nor
the test harness beside it (one file goes into the sandbox): the few helpers they share (rlimits, the
non-dumpable prctl, the report's write) are written out in each.

1. Read job.marshal (the repository's files, the command, the limits), make this process non-dumpable
   (a same-uid process may neither ptrace it nor open its fds), read and delete the nonce.
2. Write the files under WORKDIR/repo and run `/bin/sh -c COMMAND` there in a new session, under the
   per-process limits (CPU, memory, file size, processes), with an empty environment but PATH (this
   interpreter's directory first), HOME and LC_ALL; output (stdout and stderr together) is capped. On the
   wall-time limit the whole session is killed.
3. Read the repository back (regular files only, bounded in count and size: the next tool call starts
   from it) and report: a header, a SHA-256 digest keyed by the nonce, then JSON {exit, timed_out,
   output, output_truncated, files, files_dropped}. The host parses JSON only, never marshal.
"""
from __future__ import annotations

import json
import marshal
import os
import resource
import subprocess
import sys
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, NoReturn

REPORT_HEADER = "trajpipe-tool 1"
PR_SET_DUMPABLE = 4
RTLD_NOW = 2
MAX_FILES = 64
MAX_FILE_BYTES = 64 << 10
MAX_REPO_BYTES = 256 << 10


def lower_limit(which: int, soft: int, hard: int | None = None) -> None:
    hard = soft if hard is None else hard
    _, current = resource.getrlimit(which)
    if current != resource.RLIM_INFINITY:
        soft, hard = min(soft, current), min(hard, current)
    resource.setrlimit(which, (soft, hard))


def child_limits(limits: dict[str, Any]) -> None:
    """Runs in the command's process before exec: its limits, inherited by everything it starts."""
    lower_limit(resource.RLIMIT_CPU, limits["cpu_s"], limits["cpu_s"] + 1)
    lower_limit(resource.RLIMIT_AS, limits["memory_bytes"])
    lower_limit(resource.RLIMIT_FSIZE, limits["file_bytes"])
    lower_limit(resource.RLIMIT_CORE, 0)
    if limits.get("processes") is not None:
        lower_limit(resource.RLIMIT_NPROC, limits["processes"] + limits.get("processes_base", 0))


def make_undumpable() -> None:
    try:
        # _ctypes, not ctypes: the package costs about 4 ms to import, a tenth of a run
        from _ctypes import FUNCFLAG_CDECL, CFuncPtr, dlopen, dlsym

        class CFunction(CFuncPtr):  # returns a C int, takes Python ints as C ints
            _flags_ = FUNCFLAG_CDECL

        libc = dlopen(None, RTLD_NOW)  # type: ignore[arg-type]  # None: the program itself, as dlopen(3)
        CFunction(dlsym(libc, "prctl"))(PR_SET_DUMPABLE, 0, 0, 0, 0)
    except Exception:  # the isolation still holds, only this hardening is lost
        pass


def take_nonce(workdir: str) -> str:
    path = os.path.join(workdir, "nonce")
    with open(path, encoding="ascii") as handle:
        nonce = handle.read().strip()
    os.unlink(path)
    return nonce


def write_repo(root: str, files: dict[str, str]) -> None:
    os.makedirs(root, exist_ok=True)
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)


def read_repo(root: str) -> tuple[dict[str, str], int]:
    """The repository's regular files as text, and how many were left out (too many, too large, not text)."""
    files: dict[str, str] = {}
    dropped, total = 0, 0
    for current, dirs, names in os.walk(root, followlinks=False):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(names):
            path = os.path.join(current, name)
            try:
                st = os.lstat(path)
                if not (st.st_mode & 0o170000 == 0o100000) or st.st_size > MAX_FILE_BYTES \
                        or total + st.st_size > MAX_REPO_BYTES or len(files) >= MAX_FILES:
                    dropped += 1
                    continue
                with open(path, "rb") as handle:
                    data = handle.read(MAX_FILE_BYTES + 1)
                files[os.path.relpath(path, root)] = data.decode("utf-8")
                total += len(data)
            except (OSError, UnicodeDecodeError):
                dropped += 1
    return files, dropped


def run(command: str, repo: str, limits: dict[str, Any], wall_s: float, cap: int) -> dict[str, Any]:
    env = {"PATH": f"{os.path.dirname(sys.executable)}:/usr/bin:/bin", "HOME": repo, "LC_ALL": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1"}
    started = time.monotonic()
    try:
        proc = subprocess.Popen(["/bin/sh", "-c", command], cwd=repo, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=lambda: child_limits(limits))
    except OSError as exc:
        return {"exit": None, "timed_out": False, "output": f"cannot start the command: {exc}",
                "output_truncated": False}
    chunks, size, truncated, timed_out = [], 0, False, False
    assert proc.stdout is not None
    os.set_blocking(proc.stdout.fileno(), False)
    while True:
        try:
            chunk = os.read(proc.stdout.fileno(), 65536)
        except BlockingIOError:
            chunk = None
        if chunk:
            if size < cap:
                chunks.append(chunk[:cap - size])
            truncated = truncated or size + len(chunk) > cap
            size += len(chunk)
            continue
        if chunk == b"" and proc.poll() is not None:
            break
        if time.monotonic() - started > wall_s:
            timed_out = True
            break
        time.sleep(0.01)
    try:
        os.killpg(proc.pid, 9)  # the command and whatever it left running in the background
    except OSError:
        pass
    proc.wait()
    return {"exit": None if timed_out else proc.returncode, "timed_out": timed_out,
            "output": b"".join(chunks).decode("utf-8", "replace"), "output_truncated": truncated}


def sha256_hex(data: bytes) -> str:
    from hashlib import sha256

    return str(sha256(data).hexdigest())


def report(workdir: str, nonce: str, result: dict[str, Any], report_fd: int | None) -> None:
    body = json.dumps(result, ensure_ascii=True).encode("ascii")
    digest = sha256_hex(nonce.encode("ascii") + b"\n" + body)
    data = f"{REPORT_HEADER}\n{digest}\n".encode("ascii") + body
    if report_fd is not None:
        view = memoryview(data)
        while view:
            view = view[os.write(report_fd, view):]
        os.close(report_fd)
        return
    path = os.path.join(workdir, "result.txt")
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def main(argv: list[str]) -> NoReturn:
    """`harness.py WORKDIR [REPORT_FD]`."""
    workdir = os.path.abspath(argv[1])
    report_fd = int(argv[2]) if len(argv) > 2 else None
    if report_fd is not None:
        os.set_inheritable(report_fd, False)
    with open(os.path.join(workdir, "job.marshal"), "rb") as handle:
        job = marshal.load(handle)
    make_undumpable()
    nonce = take_nonce(workdir)
    repo = os.path.join(workdir, "repo")
    write_repo(repo, job["files"])
    result = run(job["command"], repo, job["limits"], job["wall_s"], job["output_cap"])
    files, dropped = read_repo(repo)
    result.update(files=files, files_dropped=dropped)
    report(workdir, nonce, result, report_fd)
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv)
