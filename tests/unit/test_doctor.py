"""`python -m infra doctor` names each missing or too old tool with the command that installs it."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def fake_tool(bin_dir: Path, name: str, output: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/bin/sh\necho '{output}' >&2\n")
    path.chmod(0o755)


def test_missing_and_old_tools_are_named_with_their_fix(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_tool(bin_dir, "go", "go version go1.19.8 linux/amd64")  # Debian's golang: too old for MinIO
    fake_tool(bin_dir, "java", 'openjdk version "17.0.15" 2025-04-15')
    done = subprocess.run([sys.executable, "-m", "infra", "doctor"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PATH": str(bin_dir)}, timeout=60)
    assert done.returncode == 1
    lines = done.stdout.splitlines()
    assert any(line.startswith("MISSING bwrap") and "apt-get install -y bubblewrap" in line for line in lines)
    assert any(line.startswith("MISSING mvn") and "apt-get install -y maven" in line for line in lines)
    assert any(line.startswith("OLD     go 1.19.8") and "go.dev" in line for line in lines)
    assert any(line.startswith("ok      java 17.0.15") for line in lines)


def test_free_disk_is_reported_and_low_disk_names_the_commands_that_free_it(tmp_path: Path) -> None:
    from infra.doctor import disk

    free = shutil.disk_usage(tmp_path).free / 1e9
    ok, line = disk(tmp_path / "not" / "made" / "yet", wanted_gb=free / 2)  # the nearest existing folder counts
    assert ok and line.startswith("ok      disk: ") and str(tmp_path) in line
    ok, line = disk(tmp_path, wanted_gb=free * 2)
    assert not ok and line.startswith("LOW     disk: ") and "infra delete-namespace NS" in line


def test_this_machine_has_everything() -> None:
    done = subprocess.run([sys.executable, "-m", "infra", "doctor"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout


def test_the_compiled_codec_is_reported_and_its_absence_only_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    from infra import doctor
    from schemas import avrobin

    assert doctor.compiled_codec() == (True, "ok      the C reader/writer of Avro bodies (schemas/_avrobin.c)")
    monkeypatch.setattr(avrobin, "AVAILABLE", False)  # as after an install without a C compiler
    ok, line = doctor.compiled_codec()
    assert not ok and line.startswith("SLOW    ") and "apt-get install -y gcc python3-dev" in line
