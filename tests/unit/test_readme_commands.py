"""Every command the README names answers --help, and every flag the README writes after it exists."""
from __future__ import annotations

import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
INFRA_SUBCOMMANDS = ("up", "down", "status", "bootstrap", "env", "smoke", "namespaces", "delete-namespace",
                     "doctor", "demo", "fetch")


def readme_commands() -> dict[str, set[str]]:
    """module (with an infra subcommand) -> the flags the README writes after it."""
    text = (ROOT / "README.md").read_text()
    found: dict[str, set[str]] = {}
    for match in re.finditer(r"python -m ([a-z_.]+)((?: [^`|\n]*)?)", text):
        module, rest = match.group(1), match.group(2)
        words = rest.split()
        if module == "infra" and words and words[0] in INFRA_SUBCOMMANDS:
            module, words = f"infra {words[0]}", words[1:]
        if words[:1] == ["--"]:
            continue
        flags = found.setdefault(module, set())
        for word in words:
            if word == "--":
                break
            flags |= set(re.findall(r"^\[?(--[a-z][a-z0-9-]*)", word))
    return found


@cache
def help_text(command: str) -> str:
    module, *sub = command.split()
    argv = [sys.executable, "-m", module, *sub, "--help"]
    if module == "learner.pretrained":
        argv = [sys.executable, "-m", module, "--help"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{' '.join(argv[2:])}: {done.stderr[-1500:]}"
    return done.stdout


@pytest.mark.parametrize("command", sorted(readme_commands()))
def test_each_readme_command_answers_help_and_knows_its_flags(command: str) -> None:
    text = help_text(command)
    unknown = {flag for flag in readme_commands()[command] if flag not in text}
    assert unknown == set(), f"the README gives {command} flags its --help does not list: {sorted(unknown)}"
