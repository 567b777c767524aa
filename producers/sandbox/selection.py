"""Picks the sandbox backend: docker > bwrap > subprocess, or the one named by argument or $TRAJPIPE_SANDBOX."""
from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path

from producers.sandbox.base import Backend, SandboxUnavailable
from producers.sandbox.results import Limits
from schemas.errors import ConfigError

BACKEND_NAMES: tuple[str, ...] = ("docker", "bwrap", "subprocess")  # best first
ENV_VAR = "TRAJPIPE_SANDBOX"
PROBE_LIMITS = Limits(wall_time_s=30.0)


def choose_backend(name: str | None = None) -> Backend:
    """The named backend (argument, else $TRAJPIPE_SANDBOX), or the best available one when neither is set.

    Raises ConfigError for an unknown name and SandboxUnavailable when the named one cannot run here.
    """
    wanted = name or os.environ.get(ENV_VAR) or "auto"
    if wanted == "auto":
        for candidate in BACKEND_NAMES:
            if unavailable_reason(candidate) is None:
                return _build(candidate)
    if wanted not in BACKEND_NAMES:
        raise ConfigError(f"unknown sandbox backend {wanted!r}: use one of {', '.join(BACKEND_NAMES)} or auto")
    reason = unavailable_reason(wanted)
    if reason is not None:
        raise SandboxUnavailable(f"sandbox backend {wanted} is unavailable: {reason}")
    return _build(wanted)


def resolve_backend(backend: str | Backend | None) -> Backend:
    """A Backend object as given, or chosen by name / automatically."""
    if backend is None or isinstance(backend, str):
        return choose_backend(backend)
    return backend


@functools.cache
def unavailable_reason(name: str) -> str | None:
    """None when the backend works on this machine, else why not (checked once per process)."""
    try:
        backend = _build(name)
    except SandboxUnavailable as exc:
        return str(exc)
    return _probe(backend)


@functools.cache
def _build(name: str) -> Backend:
    if name == "docker":
        from producers.sandbox.docker_backend import DockerBackend

        return DockerBackend()
    if name == "bwrap":
        from producers.sandbox.bwrap_backend import BwrapBackend

        return BwrapBackend()
    if name == "subprocess":
        from producers.sandbox.subprocess_backend import SubprocessBackend

        return SubprocessBackend()
    raise ConfigError(f"unknown sandbox backend {name!r}: use one of {', '.join(BACKEND_NAMES)}")


def _probe(backend: Backend) -> str | None:
    """Run a trivial program through the backend: an installed bwrap may still be refused namespaces."""
    if backend.name in ("docker", "subprocess"):
        return None  # docker answered ping; a subprocess always starts
    with tempfile.TemporaryDirectory(prefix="trajpipe-probe-") as tmp:
        probe = Path(tmp) / "probe"
        probe.mkdir()
        (probe / "harness.py").write_text("import sys\nprint('ok')\n")
        raw = backend.execute(probe, PROBE_LIMITS)
    if raw.infra_error or raw.returncode != 0 or b"ok" not in raw.stdout:
        detail = raw.infra_error or raw.stderr.decode("utf-8", "replace").strip()[-300:]
        return f"a trial run failed (status {raw.returncode}): {detail}"
    return None
