"""The benchmark report: every benchmark records its figures here; one markdown table gathers them.

Each `bench_*.py` ends with `record(...)`, which writes `runs/bench/<bench>.json`. Then

    python tests/benchmarks/report.py                 # runs/bench/report.md + runs/bench/goals.png
    python tests/benchmarks/report.py --publish       # also copies the figures to docs/bench/ and
                                                      # regenerates the README's benchmark table from them

`make bench` runs every benchmark and then this script, so a user compares runs on their own hardware
against the figures this repository publishes (machine, core count and versions are in each report).
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable

ROOT = Path(__file__).resolve().parents[2]
RUNS = ROOT / "runs" / "bench"
PUBLISHED = ROOT / "docs" / "bench"
README_START = "<!-- bench-table:start (generated from docs/bench/*.json by make bench-publish) -->"
README_END = "<!-- bench-table:end -->"
PACKAGES = ("torch", "transformers", "confluent-kafka", "faust-streaming", "fastavro", "aiokafka", "minio")


_SCRATCH: list[str] = []


def scratch(prefix: str, digits: int = 8) -> str:
    """A fresh namespace for a benchmark's run, deleted (topics, groups, objects) when the benchmark exits;
    TRAJPIPE_KEEP_TEST_NAMESPACES=1 keeps it, to look at afterwards."""
    if not _SCRATCH:
        atexit.register(_clear_scratch)
    ns = f"{prefix}{uuid.uuid4().hex[:digits]}"
    _SCRATCH.append(ns)
    return ns


def _clear_scratch() -> None:
    from infra.settings import Settings
    from tests.stack import clear_namespaces

    clear_namespaces(Settings.from_env(), _SCRATCH)


@dataclass(frozen=True)
class Figure:
    """One measured figure; `ratio` compares it with a baseline measured in the same run."""

    name: str
    value: float
    unit: str
    ratio: float | None = None
    baseline: str = ""
    goal: str = ""
    met: bool | None = None

    def cell(self) -> str:
        return f"{_number(self.value)} {self.unit}".strip()

    def ratio_cell(self) -> str:
        if self.ratio is None:
            return ""
        return f"×{self.ratio:.2f} vs {self.baseline}" if self.baseline else f"×{self.ratio:.2f}"

    def goal_cell(self) -> str:
        if not self.goal:
            return ""
        return f"{self.goal}: {'met' if self.met else 'not met'}" if self.met is not None else self.goal


def percentile(values: list[float], q: float) -> float:
    """The value below which a share `q` of `values` lies (the nearest rank; 0 for no values)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def bench_dir() -> Path:
    return Path(os.environ.get("TRAJPIPE_BENCH_DIR", RUNS))


def record(bench: str, workload: str, figures: Iterable[Figure], started: float | None = None,
           directory: Path | None = None, command: str = "") -> Path:
    """Write one benchmark's figures (with the machine they were measured on) for the report; `command`: how
    the table names it when it is not `<bench>.py` (a mode of another script)."""
    out = (directory or bench_dir()) / f"{bench}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"bench": bench, "workload": workload, "figures": [asdict(f) for f in figures], "command": command,
           "argv": sys.argv[1:], "recorded_at": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
           "seconds": round(time.monotonic() - started, 1) if started is not None else None,
           "machine": machine()}
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"figures recorded: {out}")
    return out


def machine() -> dict[str, Any]:
    return {"cores": os.cpu_count(), "cpu": _cpu_model(), "memory_gib": _memory_gib(),
            "platform": platform.platform(), "python": platform.python_version(),
            "packages": {name: _version(name) for name in PACKAGES}, "kafka": _kafka_version(),
            "bwrap": _tool_version(["bwrap", "--version"])}


def load(directory: Path) -> list[dict[str, Any]]:
    docs = [json.loads(p.read_text()) for p in sorted(directory.glob("bench_*.json"))]
    for doc in docs:
        doc["figures"] = [Figure(**f) for f in doc["figures"]]
    return docs


def table(docs: list[dict[str, Any]]) -> str:
    lines = ["| benchmark | workload | figure | value | ratio | goal |", "| --- | --- | --- | --- | --- | --- |"]
    for doc in docs:
        for i, f in enumerate(doc["figures"]):
            head = (f"`{doc.get('command') or doc['bench'] + '.py'}`", doc["workload"]) if i == 0 else ("", "")
            lines.append(f"| {head[0]} | {head[1]} | {f.name} | {f.cell()} | {f.ratio_cell()} | {f.goal_cell()} |")
    return "\n".join(lines)


def machines_line(docs: list[dict[str, Any]]) -> str:
    seen = {_describe(doc["machine"]) for doc in docs}
    return "; ".join(sorted(seen))


def report(docs: list[dict[str, Any]], directory: Path) -> str:
    goals = [f for doc in docs for f in doc["figures"] if f.met is not None]
    met = sum(bool(f.met) for f in goals)
    parts = [
        "# Benchmark report", "",
        f"Measured on: {machines_line(docs)}.", "",
        _versions(docs), "",
        f"Goals met: {met} of {len(goals)}. Ratios compare with a baseline measured in the same script.", "",
        table(docs), "",
        "| benchmark | arguments | recorded | seconds |", "| --- | --- | --- | --- |",
        *[f"| `{d['bench']}` | `{' '.join(d['argv']) or '(defaults)'}` | {d['recorded_at']} | {d['seconds']} |"
          for d in docs], "",
    ]
    parts += [f"![{p.stem}]({p.name})" for p in sorted(directory.glob("*.png"))]
    return "\n".join(parts) + "\n"


def plot_goals(docs: list[dict[str, Any]], path: Path) -> bool:
    """One bar per figure that has a goal and a ratio: how far it got, with the goal marked."""
    rows = [(doc["bench"], f) for doc in docs for f in doc["figures"] if f.ratio is not None and f.goal]
    if not rows:
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.2))
    labels = [f"{bench}: {f.name}" for bench, f in rows]
    colors = ["tab:green" if f.met else "tab:red" for _, f in rows]
    ax.barh(labels, [f.ratio for _, f in rows], color=colors)
    for y, (_, f) in enumerate(rows):
        ax.annotate(f.goal, (f.ratio or 0, y), xytext=(4, 0), textcoords="offset points", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set(xlabel="ratio against the baseline measured in the same run", title="benchmark goals (green: met)")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def publish(docs: list[dict[str, Any]], source: Path, readme: Path) -> None:
    PUBLISHED.mkdir(parents=True, exist_ok=True)
    for doc in docs:
        shutil.copyfile(source / f"{doc['bench']}.json", PUBLISHED / f"{doc['bench']}.json")
    readme.write_text(with_table(readme.read_text(), load(PUBLISHED)))


def with_table(text: str, docs: list[dict[str, Any]]) -> str:
    """The README with its generated benchmark table replaced by one rendered from `docs`."""
    start, end = text.find(README_START), text.find(README_END)
    if start < 0 or end < start:
        raise SystemExit(f"README has no generated benchmark table (markers {README_START!r} ... {README_END!r})")
    body = f"{README_START}\nMeasured on: {machines_line(docs)}.\n\n{table(docs)}\n"
    return text[:start] + body + text[end:]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=bench_dir(), help="where the benchmarks recorded their figures")
    p.add_argument("--publish", action="store_true", help="copy the figures to docs/bench/ and regenerate the README")
    p.add_argument("--readme", type=Path, default=ROOT / "README.md")
    args = p.parse_args()
    docs = load(args.dir)
    if not docs:
        print(f"no figures under {args.dir}: run the benchmarks first (make bench)", file=sys.stderr)
        return 2
    plot_goals(docs, args.dir / "goals.png")
    out = args.dir / "report.md"
    out.write_text(report(docs, args.dir))
    print(f"report: {out} ({len(docs)} benchmarks, {sum(len(d['figures']) for d in docs)} figures)")
    if args.publish:
        publish(docs, args.dir, args.readme)
        print(f"published: {PUBLISHED}/ and the table in {args.readme}")
    return 0


def _number(value: float) -> str:
    if value == int(value) and abs(value) >= 100:
        return f"{int(value):,}"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _describe(m: dict[str, Any]) -> str:
    return f"{m['cores']} cores ({m['cpu']}), {m['memory_gib']} GiB, Python {m['python']}"


def _versions(docs: list[dict[str, Any]]) -> str:
    m = docs[-1]["machine"]
    pkgs = ", ".join(f"{k} {v}" for k, v in m["packages"].items() if v)
    return f"Versions: {pkgs}; Kafka {m['kafka']}; {m['bwrap'] or 'no bwrap'}; {m['platform']}."


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def process_cpu_seconds(pid: int, children: bool = False) -> float:
    """A running process's CPU seconds so far (user + system); `children`: its waited-for children's too."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15 if children else 13]) / os.sysconf("SC_CLK_TCK")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _memory_gib() -> int | None:
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None
    return round(pages * size / 2**30)


def _kafka_version() -> str:
    from infra.launcher import KAFKA_VERSION
    return KAFKA_VERSION


def _tool_version(argv: list[str]) -> str | None:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
