"""Docker backend: one throwaway container per run, no network, read-only root, memory and pids cgroups.

Used only when an engine answers `docker.from_env().ping()`. The work dir is bind-mounted at /sandbox
(the engine must see the host path, as a local engine does); the container runs as nobody with every
capability dropped and no-new-privileges. The image (default python:3.11-slim, or $TRAJPIPE_SANDBOX_IMAGE)
must have `python` on its PATH; it is pulled once when missing.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable

from producers.sandbox.base import PYTHON_FLAGS, SANDBOX_DIR, RawRun, SandboxUnavailable
from producers.sandbox.results import Limits

DEFAULT_IMAGE = "python:3.11-slim"
IMAGE_ENV = "TRAJPIPE_SANDBOX_IMAGE"
SANDBOX_USER = 65534  # nobody
PROCESS_HEADROOM = 4  # the pids cgroup also counts the container's init


class DockerBackend:
    """Runs the harness in a fresh container per run (see the module docstring)."""

    name = "docker"
    isolates_files = True
    limits_processes = True
    compiled = False  # the image's interpreter may be another version: it gets the source
    nproc_mode = "none"  # the pids cgroup limits the container; RLIMIT_NPROC would count other nobodies

    def __init__(self, image: str | None = None, client: Any = None) -> None:
        self.image = image or os.environ.get(IMAGE_ENV) or DEFAULT_IMAGE
        self._client = client or _connect()
        self._image_ready = False

    def execute(self, workdir: Path, limits: Limits) -> RawRun:
        _open_to_sandbox_user(workdir)
        try:
            self._ensure_image()
            container = self._client.containers.create(self.image, **self._options(workdir, limits))
        except Exception as exc:  # the docker SDK raises many types; any of them means no run
            return RawRun(infra_error=f"docker could not create the container: {exc}")
        try:
            return self._run(container, limits)
        finally:
            _remove(container)

    def _run(self, container: Any, limits: Limits) -> RawRun:
        try:
            container.start()
        except Exception as exc:
            return RawRun(infra_error=f"docker could not start the container: {exc}")
        timed_out, code = _wait(container, limits.wall_time_s)
        container.reload()
        stdout, out_cut = _capped(container.logs(stdout=True, stderr=False, stream=True), limits.output_bytes)
        stderr, err_cut = _capped(container.logs(stdout=False, stderr=True, stream=True), limits.output_bytes)
        signal = code - 128 if code is not None and code > 128 else None
        return RawRun(returncode=code, signal=signal, stdout=stdout, stderr=stderr, stdout_truncated=out_cut,
                      stderr_truncated=err_cut, timed_out=timed_out,
                      oom_killed=bool(container.attrs.get("State", {}).get("OOMKilled")))

    def _options(self, workdir: Path, limits: Limits) -> dict[str, Any]:
        return {
            "command": ["python", *PYTHON_FLAGS, f"{SANDBOX_DIR}/harness.py", SANDBOX_DIR],
            "working_dir": SANDBOX_DIR, "user": f"{SANDBOX_USER}:{SANDBOX_USER}",
            "network_mode": "none", "read_only": True, "cap_drop": ["ALL"],
            "security_opt": ["no-new-privileges"], "mem_limit": limits.memory_bytes,
            "memswap_limit": limits.memory_bytes, "pids_limit": limits.processes + PROCESS_HEADROOM,
            "tmpfs": {"/tmp": f"rw,nosuid,nodev,size={limits.file_bytes}"},
            "volumes": {str(workdir): {"bind": SANDBOX_DIR, "mode": "rw"}},
            "environment": {"HOME": SANDBOX_DIR, "TMPDIR": "/tmp", "LC_ALL": "C.UTF-8"},
            "ulimits": [_ulimit("core", 0)],
        }

    def _ensure_image(self) -> None:
        if self._image_ready:
            return
        import docker.errors

        try:
            self._client.images.get(self.image)
        except docker.errors.ImageNotFound:
            self._client.images.pull(self.image)
        self._image_ready = True


def _connect() -> Any:
    try:
        import docker

        client = docker.from_env(timeout=5)
        client.ping()
    except Exception as exc:
        raise SandboxUnavailable(f"no Docker engine answers ({exc.__class__.__name__}: {str(exc)[:80]})") from exc
    return client


def _ulimit(name: str, value: int) -> Any:
    from docker.types import Ulimit

    return Ulimit(name=name, soft=value, hard=value)


def _open_to_sandbox_user(workdir: Path) -> None:
    """The container's nobody must read the job, delete the nonce and the tests after reading them,
    and write the report."""
    os.chmod(workdir, 0o777)
    for path in workdir.iterdir():
        os.chmod(path, 0o666)


def _wait(container: Any, wall_time_s: float) -> tuple[bool, int | None]:
    """(timed_out, exit status); a run past the wall clock is killed."""
    try:
        status = container.wait(timeout=wall_time_s)
        return False, int(status.get("StatusCode", -1))
    except Exception:  # requests' ReadTimeout / ConnectionError: the deadline passed
        try:
            container.kill()
        except Exception:
            pass
        return True, None


def _capped(chunks: Iterable[bytes], cap: int) -> tuple[bytes, bool]:
    data = bytearray()
    for chunk in chunks:
        if len(data) + len(chunk) > cap:
            data += chunk[: cap - len(data)]
            return bytes(data), True
        data += chunk
    return bytes(data), False


def _remove(container: Any) -> None:
    try:
        container.remove(force=True)
    except Exception:
        pass
