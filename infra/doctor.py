"""Checks the system tools the project needs, one line each, with the command that installs a missing one.

    python -m infra doctor      # `make install` runs it last; exit 1 when something is missing

Python 3.11+ runs everything; bubblewrap isolates model-written code (without it, code tasks refuse to
start); Java 17+ runs Kafka and Maven fetches its jars; Go 1.24+ builds MinIO (Debian's golang package
is too old: use the release from go.dev). It also says how much disk is free where Kafka and MinIO keep their
data (a warning under 10 GB), and whether the C reader/writer of Avro bodies was built with the package (a warning
without it: the codec then takes fastavro's slower path). Warnings do not fail it.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from infra.settings import state_dir

DISK_WANTED_GB = 10  # the tests' servers and temporary files, a few demos' data, room to install torch again
GO_FIX = ("curl -sSL https://go.dev/dl/go1.24.6.linux-amd64.tar.gz | tar -C /usr/local -xz && "
          "export PATH=/usr/local/go/bin:$PATH")


@dataclass(frozen=True)
class Check:
    tool: str
    why: str
    fix: str
    minimum: Optional[tuple[int, ...]] = None
    version: Optional[Callable[[str], str]] = None  # the tool's path -> its version output


def _output(*argv: str) -> str:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout + done.stderr


CHECKS = (
    Check("bwrap", "isolates model-written code (code tasks refuse to start without it or Docker)",
          "apt-get install -y bubblewrap"),
    Check("java", "runs Kafka", "apt-get install -y openjdk-17-jre-headless", (17,),
          lambda path: _output(path, "-version")),
    Check("mvn", "fetches Kafka's jars once", "apt-get install -y maven"),
    Check("go", "builds MinIO once", GO_FIX, (1, 24), lambda path: _output(path, "version")),
)


def parse_version(text: str) -> Optional[tuple[int, ...]]:
    """The first dotted version in a tool's output: 'go version go1.26.8 ...' -> (1, 26, 8)."""
    match = re.search(r"(?:go|version \"?)(\d+(?:\.\d+)+)", text) or re.search(r"(\d+(?:\.\d+)+)", text)
    return tuple(int(p) for p in match.group(1).split(".")) if match else None


def check(item: Check) -> tuple[bool, str]:
    path = shutil.which(item.tool)
    if path is None:
        return False, f"MISSING {item.tool}: {item.why}. Install: {item.fix}"
    if item.minimum is None or item.version is None:
        return True, f"ok      {item.tool} ({path})"
    found = parse_version(item.version(path))
    want = ".".join(map(str, item.minimum))
    if found is None or found[:len(item.minimum)] < item.minimum:
        shown = ".".join(map(str, found)) if found else "unknown"
        return False, f"OLD     {item.tool} {shown} at {path}: {item.why} needs {want}+. Install: {item.fix}"
    return True, f"ok      {item.tool} {'.'.join(map(str, found))} ({path})"


def disk(path: Path, wanted_gb: float = DISK_WANTED_GB) -> tuple[bool, str]:
    """Free space on the filesystem of `path` (or of its nearest existing parent), against `wanted_gb`."""
    while not path.exists() and path != path.parent:
        path = path.parent
    free = shutil.disk_usage(path).free / 1e9
    if free >= wanted_gb:
        return True, f"ok      disk: {free:.1f} GB free under {path}"
    return False, (f"LOW     disk: {free:.1f} GB free under {path}, where Kafka and MinIO keep every run's data "
                   f"(want {wanted_gb:g} GB): `python -m infra namespaces` lists the runs with their size, "
                   "`python -m infra delete-namespace NS` removes one")


def compiled_codec() -> tuple[bool, str]:
    """Whether schemas/_avrobin.c was compiled when the package was installed (it needs gcc and Python's headers)."""
    from schemas import avrobin
    if avrobin.AVAILABLE:
        return True, "ok      the C reader/writer of Avro bodies (schemas/_avrobin.c)"
    return False, ("SLOW    the C reader/writer of Avro bodies was not built: the codec takes fastavro's path "
                   "(the streams worker's stages cost about a third more CPU). Install: apt-get install -y gcc "
                   "python3-dev && pip install -e .")


def main() -> int:
    results = [(True, f"ok      python {sys.version.split()[0]}")] if sys.version_info >= (3, 11) else \
        [(False, f"OLD     python {sys.version.split()[0]}: 3.11+ is needed")]
    results += [check(item) for item in CHECKS]
    for _, line in [*results, disk(state_dir()), compiled_codec()]:  # these two warn, they do not fail
        print(line)
    missing = sum(not ok for ok, _ in results)
    if missing:
        print(f"{missing} tool(s) to install before `make demo` / `make test` (the commands above)")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
