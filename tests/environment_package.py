"""The example environment package (examples/trajpipe-example-env), really installed for a test: pip builds it
and installs it into a private directory, found through its entry points once that directory is on the path."""
from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

from schemas import environments

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "examples" / "trajpipe-example-env"


def install(target: Path) -> Path:
    """`pip install` the example package into `target` (a site directory); returns it."""
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(PACKAGE)], check=True, capture_output=True, text=True)
    assert (target / "trajpipe_example_env").is_dir() and list(target.glob("trajpipe_example_env-*.dist-info"))
    return target


def on_path(site: Path) -> None:
    """Put an installed site directory on this process's path, so its entry points are found."""
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    environments._entry_points.cache_clear()


def off_path(site: Path) -> None:
    sys.path.remove(str(site))
    environments._entry_points.cache_clear()
