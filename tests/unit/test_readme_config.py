"""Every TRAJPIPE_* variable the code reads is in the README's configuration table, and nothing stale is."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("schemas", "infra", "producers", "streams", "consumers", "learner")
FAMILIES = ("TRAJPIPE_STREAMS_", "TRAJPIPE_LEARNER_")  # documented as <FAMILY><FLAG>: every flag of that service


def read_in_code() -> set[str]:
    names: set[str] = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            names |= set(re.findall(r"TRAJPIPE_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    return names


def documented() -> set[str]:
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"`(TRAJPIPE_[A-Z0-9_<>]+)`", table))


def test_every_variable_the_code_reads_is_documented() -> None:
    missing = {n for n in read_in_code() if n not in documented()
               and not any((n + "_").startswith(family) for family in FAMILIES)}
    missing |= {family + "<FLAG>" for family in FAMILIES} - documented()
    assert missing == set(), f"add to the README's configuration table: {sorted(missing)}"


def test_every_documented_variable_is_read_somewhere() -> None:
    tests = {n for path in (ROOT / "tests").rglob("*.py") for n in re.findall(r"TRAJPIPE_[A-Z0-9_]+", path.read_text())}
    stale = {n for n in documented() if "<" not in n and n not in read_in_code() | tests}
    assert stale == set(), f"documented but read nowhere: {sorted(stale)}"
