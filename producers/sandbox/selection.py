"""Picks the sandbox backend: docker > bwrap, or the one named by argument or $TRAJPIPE_SANDBOX.

It fails closed: when no isolating backend works, model-written code does not run at all. The subprocess
backend (rlimits, no isolation) runs only when named *and* allowed: `allow_unisolated=True` or
TRAJPIPE_SANDBOX_ALLOW_UNISOLATED=1, and then with a warning on stderr.
"""
from __future__ import annotations

import functools
import logging
import os
import sys
import tempfile
from pathlib import Path

from producers.sandbox.base import Backend, SandboxUnavailable
from producers.sandbox.results import Limits
from schemas.errors import ConfigError

BACKEND_NAMES: tuple[str, ...] = ("docker", "bwrap", "subprocess")  # best first
ISOLATING: tuple[str, ...] = ("docker", "bwrap")  # the only ones "auto" may pick
ENV_VAR = "TRAJPIPE_SANDBOX"
ALLOW_UNISOLATED_VAR = "TRAJPIPE_SANDBOX_ALLOW_UNISOLATED"
HOW_TO_ISOLATE = ("install bubblewrap (Debian/Ubuntu: apt-get install -y bubblewrap; `make install` does) or "
                  "start a Docker engine")
log = logging.getLogger(__name__)
PROBE_LIMITS = Limits(wall_time_s=30.0)


def choose_backend(name: str | None = None, allow_unisolated: bool | None = None) -> Backend:
    """The named backend (argument, else $TRAJPIPE_SANDBOX), or the best isolating one when neither is set.

    Raises ConfigError for an unknown name, and SandboxUnavailable when the named one cannot run here, when
    no isolating backend works ("auto"), or when "subprocess" is named without the opt-in.
    """
    wanted = name or os.environ.get(ENV_VAR) or "auto"
    if wanted == "auto":
        reasons = {candidate: unavailable_reason(candidate) for candidate in ISOLATING}
        for candidate, reason in reasons.items():
            if reason is None:
                return _build(candidate)
        detail = "; ".join(f"{candidate}: {reason}" for candidate, reason in reasons.items())
        raise SandboxUnavailable(f"no isolating sandbox works here ({detail}), so model-written code will not "
                                 f"run: {HOW_TO_ISOLATE}")
    if wanted not in BACKEND_NAMES:
        raise ConfigError(f"unknown sandbox backend {wanted!r}: use one of {', '.join(BACKEND_NAMES)} or auto")
    if wanted not in ISOLATING:
        allowed = unisolated_allowed() if allow_unisolated is None else allow_unisolated
        if not allowed:
            raise SandboxUnavailable(
                f"sandbox backend {wanted} does not isolate: model-written code would see this host's files, "
                f"network and processes. {HOW_TO_ISOLATE[0].upper()}{HOW_TO_ISOLATE[1:]}, or accept the risk "
                f"with {ALLOW_UNISOLATED_VAR}=1")
        _warn_unisolated(wanted)
    reason = unavailable_reason(wanted)
    if reason is not None:
        raise SandboxUnavailable(f"sandbox backend {wanted} is unavailable: {reason}")
    return _build(wanted)


def unisolated_allowed() -> bool:
    return os.environ.get(ALLOW_UNISOLATED_VAR, "").strip().lower() in ("1", "true", "yes")


def _warn_unisolated(name: str) -> None:
    """On stderr and in the log, each time it is chosen: untrusted code runs with this host's privileges."""
    message = (f"WARNING: sandbox backend {name} runs model-written code WITHOUT isolation "
               "(explicitly allowed): it can read this host's files and reach its network")
    print(message, file=sys.stderr, flush=True)
    log.warning(message)


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
