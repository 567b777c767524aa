"""make install's resolution against the package index: under the lock, pip picks exactly the pinned versions."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_lock import ROOT, canonical, locked

pytestmark = pytest.mark.integration


def test_an_install_from_the_lock_resolves_to_exactly_the_pins(tmp_path: Path) -> None:
    """make install's resolution, without installing: pip resolves pyproject under the lock's constraints to
    the pinned version of every package, and every package it would install is pinned."""
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q",
                           "--report", str(report), "-c", str(ROOT / "requirements.lock"), "-e",
                           f"{ROOT}[dev,pretrained]"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    resolved = {canonical(i["metadata"]["name"]): i["metadata"]["version"]
                for i in json.loads(report.read_text())["install"]}
    resolved.pop("trajpipe")
    pins = locked()
    assert {n: v for n, v in resolved.items() if pins.get(n) != v} == {}
