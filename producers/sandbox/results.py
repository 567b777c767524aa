"""The limits a sandboxed run gets and the result it yields: outcomes, counts, captured output."""
from __future__ import annotations

import math
from dataclasses import dataclass

from schemas.errors import ConfigError

# The outcome strings are part of the SandboxResult event contract: never rename one.
OUTCOMES: tuple[str, ...] = (
    "passed",            # every assertion held
    "failed",            # the program ran, at least one assertion failed (see tests_passed / tests_total)
    "syntax_error",      # the solution does not compile
    "runtime_error",     # the solution raised while loading, or the program died before reporting
    "timeout",           # wall-clock or CPU-time limit
    "memory_exceeded",   # MemoryError under RLIMIT_AS, or killed by the memory cgroup
    "output_truncated",  # the tests passed but stdout or stderr went over the output limit
    "infra_error",       # the sandbox itself broke before any untrusted code ran: not the answer's fault
)


@dataclass(frozen=True)
class Limits:
    """Resource limits of one run; each is enforced inside the sandbox, the wall clock by the host."""

    wall_time_s: float = 10.0
    cpu_time_s: float = 10.0
    memory_mb: int = 512
    processes: int = 32
    output_bytes: int = 64 * 1024  # per stream (stdout, stderr)
    file_size_mb: int = 16         # largest file the program may write; also the size of its /tmp
    disk_mb: int = 64              # all the program may write in its work dir (an isolating backend's tmpfs)
    run_memory_mb: int = 1024      # every process of the run and its tmpfs pages together (a memory cgroup)

    def __post_init__(self) -> None:
        for name in ("wall_time_s", "cpu_time_s", "memory_mb", "processes", "output_bytes", "file_size_mb",
                     "disk_mb", "run_memory_mb"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"Limits.{name} must be a positive number, got {value!r}")
        if self.memory_mb < 64:
            raise ConfigError(f"Limits.memory_mb={self.memory_mb} cannot start Python: use at least 64")

    @property
    def cpu_seconds(self) -> int:
        """RLIMIT_CPU takes whole seconds: round up so a limit never cuts a run short."""
        return max(1, math.ceil(self.cpu_time_s))

    @property
    def memory_bytes(self) -> int:
        return self.memory_mb * 1024 * 1024

    @property
    def file_bytes(self) -> int:
        return self.file_size_mb * 1024 * 1024

    @property
    def run_memory_bytes(self) -> int:
        return self.run_memory_mb * 1024 * 1024

    @property
    def disk_bytes(self) -> int:
        return self.disk_mb * 1024 * 1024


@dataclass(frozen=True)
class ExecResult:
    """What one sandboxed run of a solution against its tests produced; the fields of a SandboxResult."""

    outcome: str
    tests_passed: int
    tests_total: int
    stdout: str
    stderr: str
    duration_ms: int
    backend: str

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise ValueError(f"unknown sandbox outcome {self.outcome!r}; expected one of {OUTCOMES}")

    @property
    def passed(self) -> bool:
        return self.outcome == "passed"
