"""The throwaway work dir of one run: the job the harness reads, the nonce, and the report it writes back."""
from __future__ import annotations

import hashlib
import hmac
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
JOB_FILES = ("harness.py", "job.marshal", "tests.py", "nonce")  # what a run's work dir starts with
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
def job_dir(job: dict[str, Any], tests_source: str | None, harness: Path = HARNESS_SOURCE) -> Iterator[JobDir]:
    """A fresh 0700 directory holding harness.py (`harness`), job.marshal, tests.py (when given) and the
    nonce; removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="trajpipe-sandbox-"))
    nonce = secrets.token_hex(16)
    try:
        shutil.copyfile(harness, path / "harness.py")
        (path / "job.marshal").write_bytes(marshal.dumps(job, MARSHAL_VERSION))
        if tests_source is not None:
            (path / "tests.py").write_text(tests_source, encoding="utf-8")
        (path / "nonce").write_text(nonce, encoding="ascii")
        yield JobDir(path, nonce)
    finally:
        remove_tree(path)


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
