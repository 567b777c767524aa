"""The throwaway work dir of one run: the job the harness reads, the nonce, and the report it writes back."""
from __future__ import annotations

import functools
import hashlib
import hmac
import importlib.util
import marshal
import os
import secrets
import shutil
import stat
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from producers.sandbox.results import OUTCOMES

HARNESS_SOURCE = Path(__file__).with_name("harness.py")
HARNESS_FILES = ("harness.pyc", "harness.py")  # the compiled harness when the backend can run it, else the source
JOB_FILES = (*HARNESS_FILES, "job.marshal", "tests.py", "nonce")  # what a run's work dir starts with
REPORT_MAX_BYTES = 1 << 20  # a report is a few KB; anything bigger was not written by the harness
REPORT_HEADER = "trajpipe-report 2"  # must equal harness.REPORT_HEADER
# The job holds only str, int, bool and None, which every marshal version since 2 encodes alike, so
# an interpreter of another Python version (a docker image) reads it. The host never unmarshals
# anything the sandbox wrote: marshal is not safe against crafted input.
MARSHAL_VERSION = 4


@dataclass(frozen=True)
class JobDir:
    path: Path
    nonce: str


@dataclass(frozen=True)
class Report:
    """What the harness wrote after the checks, once its digest matched."""

    outcome: str
    passed: int
    total: int
    message: str


@contextmanager
def job_dir(job: dict[str, Any], tests_source: str | None, harness: Path = HARNESS_SOURCE,
            compiled: bool = False) -> Iterator[JobDir]:
    """A fresh 0700 directory holding the harness (`harness`: as harness.pyc when `compiled`, for a backend
    whose interpreter is this one, else as harness.py), job.marshal, tests.py (when given) and the nonce;
    removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="trajpipe-sandbox-"))
    nonce = secrets.token_hex(16)
    try:
        if compiled:
            (path / "harness.pyc").write_bytes(harness_bytecode(harness))
        else:
            shutil.copyfile(harness, path / "harness.py")
        (path / "job.marshal").write_bytes(marshal.dumps(job, MARSHAL_VERSION))
        if tests_source is not None:
            (path / "tests.py").write_text(tests_source, encoding="utf-8")
        (path / "nonce").write_text(nonce, encoding="ascii")
        yield JobDir(path, nonce)
    finally:
        remove_tree(path)


@functools.cache
def harness_bytecode(harness: Path) -> bytes:
    """`harness` compiled once, as a .pyc file this interpreter runs as a script (`python -I -S -B x.pyc`).

    Compiling the harness's source took about 7 ms of every run (the interpreter in the sandbox compiles a
    script each time and, with -B on a fresh tmpfs, caches nothing). The header is the one of an unchecked
    hash-based .pyc: the magic number of this interpreter (another version refuses the file: such a
    backend gets the source), flags 0b01 and the source's hash, which a script run does not check.
    """
    source = harness.read_bytes()
    code = compile(source, harness.name, "exec", dont_inherit=True)
    flags = (1).to_bytes(4, "little")  # hash-based, unchecked
    return importlib.util.MAGIC_NUMBER + flags + importlib.util.source_hash(source) + marshal.dumps(code)


def harness_file(names: Any) -> str:
    """Which harness file a work dir holds: harness.pyc when it was written compiled, else harness.py."""
    return next((name for name in HARNESS_FILES if name in names), HARNESS_FILES[-1])


def read_signed(job: JobDir, piped: bytes | None, header: str, limit: int) -> bytes | None:
    """The body of a report written by an in-sandbox program (from its pipe when the backend gave one, else
    result.txt in the work dir, never through a link), or None when it is missing, over `limit` bytes, has
    another header, or its digest does not match."""
    data = piped if piped is not None else _read_regular_file(job.path / "result.txt", limit)
    if data is None or len(data) > limit:
        return None
    found, _, rest = data.partition(b"\n")
    digest, _, body = rest.partition(b"\n")
    if found != header.encode() or not hmac.compare_digest(digest, _digest(job.nonce, body)):
        return None
    return body


def read_report(job: JobDir, piped: bytes | None = None) -> Report | None:
    """The harness's report, or None when it is missing, malformed, or its digest does not match."""
    body = read_signed(job, piped, REPORT_HEADER, REPORT_MAX_BYTES)
    if body is None:
        return None
    fields = body.decode("utf-8", "replace").split("\n", 3)
    if len(fields) != 4:
        return None
    outcome, passed, total, message = fields[0], _count(fields[1]), _count(fields[2]), fields[3]
    if outcome not in OUTCOMES or passed is None or total is None or passed > total:
        return None
    return Report(outcome, passed, total, message)


def _digest(nonce: str, body: bytes) -> bytes:
    """What the harness writes: SHA-256 of the nonce and the body, so the file never reveals the nonce."""
    return hashlib.sha256(nonce.encode("ascii") + b"\n" + body).hexdigest().encode("ascii")


def _count(text: str) -> int | None:
    return int(text) if text.isascii() and text.isdigit() and len(text) < 10 else None


def _read_regular_file(path: Path, limit: int) -> bytes | None:
    """Read at most `limit` bytes, refusing symlinks, FIFOs and devices the program may have planted."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = os.read(fd, limit + 1)
    finally:
        os.close(fd)
    return data if len(data) <= limit else None


def remove_tree(path: Path) -> None:
    """Delete the work dir even where the program removed permissions from what it created."""
    def make_writable_and_retry(func: Any, target: str, _exc: Any) -> None:
        try:
            os.chmod(os.path.dirname(target), 0o700)
            if os.path.isdir(target) and not os.path.islink(target):
                os.chmod(target, 0o700)
            func(target)
        except OSError:
            pass

    shutil.rmtree(path, onerror=make_writable_and_retry)
