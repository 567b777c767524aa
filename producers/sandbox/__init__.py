"""Code-execution sandbox: runs model-written solutions against their tests, isolated and limited.

    from producers.sandbox import Limits, SandboxPool, run_tests
    result = run_tests(prompt + completion, problem["test"], problem["entry_point"], Limits(wall_time_s=5))
    with SandboxPool(workers=2) as pool:                     # backend: docker > bwrap > subprocess
        result = await pool.run_tests_async(code, tests, entry_point)

Backends: docker (an engine answers), bwrap (bubblewrap namespaces), subprocess (rlimits only, no
isolation). `choose_backend(name)` or $TRAJPIPE_SANDBOX picks one by name.
"""
from producers.sandbox.base import Backend, SandboxUnavailable
from producers.sandbox.pool import SandboxJob, SandboxPool
from producers.sandbox.results import OUTCOMES, ExecResult, Limits
from producers.sandbox.runner import run_tests
from producers.sandbox.selection import BACKEND_NAMES, choose_backend, unavailable_reason

__all__ = [
    "BACKEND_NAMES", "Backend", "ExecResult", "Limits", "OUTCOMES", "SandboxJob", "SandboxPool",
    "SandboxUnavailable", "choose_backend", "run_tests", "unavailable_reason",
]
