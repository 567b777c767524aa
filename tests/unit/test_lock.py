"""requirements.lock pins every dependency, and the environment the tests run in was installed from it."""
from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def locked() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"not a pin: {line!r}"
            pins[canonical(name)] = version
    return pins


def declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"])
    for extra in ("dev", "pretrained"):  # what make install and .ci/run install
        wanted += project["optional-dependencies"][extra]
    return {canonical(re.split(r"[\s<>=!~;\[]", spec, maxsplit=1)[0]) for spec in wanted}


def test_every_declared_dependency_is_pinned() -> None:
    assert declared() - set(locked()) == set()


def test_the_installed_versions_are_the_locked_ones() -> None:
    installed = {canonical(d.metadata["Name"]): d.version for d in metadata.distributions()}
    differ = {name: (pin, installed[name]) for name, pin in locked().items()
              if name in installed and installed[name] != pin}
    assert differ == {}, "installed not from requirements.lock (locked, installed): " + repr(differ)


def test_every_module_of_the_project_imports() -> None:
    import importlib

    skip = {"producers.policy.vllm_backend"}  # needs the vllm extra, in its own environment
    for package in ("schemas", "infra", "producers", "streams", "consumers", "learner"):
        for path in sorted((ROOT / package).rglob("*.py")):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            if module not in skip and not module.endswith("__main__"):
                importlib.import_module(module)
