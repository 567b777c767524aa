"""The wheel carries every file the code reads at run time (Kafka's config and pom, the Avro schemas, ...)."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNTIME_DIRS = ("infra/local", "infra/docker", "schemas/avro", "schemas/avro/history")


def test_the_wheel_holds_every_runtime_file(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = tmp_path.glob("trajpipe-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    wanted = {str(p.relative_to(ROOT)) for d in RUNTIME_DIRS for p in (ROOT / d).iterdir() if p.is_file()}
    wanted |= {"infra/docker-compose.yml", "producers/sandbox/harness.py", "producers/sandbox/toolbox.py",
               "infra/prometheus/alerts.yml", "infra/grafana/dashboards/trajpipe.json"}
    assert wanted - names == set()
