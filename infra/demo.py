"""The main job: local Kafka and MinIO, then every service as a process, an SFT warm start then GRPO.

    python -m infra demo                    # ~10 minutes on 2 cores; Ctrl-C stops cleanly
    python -m infra demo --updates 40 --workers 2 --ns mydemo

Writes runs/<ns>/ (service logs, PNG plots, summary.md, eval.json); the exit code says whether the
run was healthy: every service stopped cleanly, the learner made its updates, nothing was lost, and
the final policy beats the initial one on held-out tasks.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Optional

from rich.console import Console
from rich.live import Live
from rich.table import Table

from infra.bootstrap import bootstrap
from infra.kafka import end_offsets
from infra.launcher import Launcher
from infra.settings import Settings
from schemas.topics import Topics

console = Console(stderr=True)
MIN_GAIN = 0.1  # held-out mean reward the final policy must gain over the first for a healthy run


@dataclass
class Service:
    name: str
    argv: list[str]
    proc: Optional[subprocess.Popen[bytes]] = None
    log: Optional[IO[bytes]] = None
    rc: Optional[int] = None

    @property
    def state(self) -> str:
        if self.proc is None:
            return "not started"
        rc = self.proc.poll()
        return "running" if rc is None else f"exited {rc}"


@dataclass
class Run:
    ns: str
    dir: Path
    settings: Settings
    services: list[Service] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)


def platform() -> Settings:
    launcher = Launcher()
    launcher.up()
    return launcher.settings()


def quota(args: argparse.Namespace) -> int:
    """Episodes per worker per policy version: what the learner trains per version (two updates).

    More would queue up in the log and reach the learner too stale to train on: workers outrun a
    learner on these machines. Zero-variance groups dropped upstream make partial batches instead.
    """
    per_version = args.batch_trajectories * 2 // args.workers
    return max(args.group_size, per_version - per_version % args.group_size)


def plan(args: argparse.Namespace, ns: str) -> list[Service]:
    model = ["--layers", str(args.layers), "--width", str(args.width)]
    workers = [Service(f"producer-{i}", ["producers", "--ns", ns, "--sources", args.sources, "--group-size",
                                         str(args.group_size), "--prompts-per-step", "4", "--max-new-tokens",
                                         str(args.max_new_tokens), "--producer-id", f"worker-{i}", "--seed", str(i),
                                         "--max-policy-lag", "1", "--max-episodes-per-version",
                                         str(quota(args)), "--quota-wait-s", "10", *model])
               for i in range(args.workers)]
    return [
        Service("streams", ["streams", "--ns", ns]),
        Service("shard-writer", ["consumers.shard_writer", "--ns", ns, "--max-trajectories",
                                 str(args.batch_trajectories), "--max-age-s", "3"]),
        Service("learner", ["learner", "--ns", ns, "--sft-updates", str(args.sft_updates), "--algorithm", "grpo",
                            "--max-updates", str(args.updates), "--updates-per-checkpoint", "2", "--lr", str(args.lr),
                            *model]),
        *workers,
        Service("monitor", ["consumers.monitor", "--ns", ns, "--no-tui", "--port", str(args.monitor_port)]),
    ]


def start(run: Run, service: Service) -> None:
    logs = run.dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    service.log = open(logs / f"{service.name}.log", "ab")
    env = {**os.environ, **run.settings.as_env(), "PYTHONUNBUFFERED": "1"}
    service.proc = subprocess.Popen([sys.executable, "-m", *service.argv], stdout=service.log,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True)


def stop(service: Service, timeout: float = 120.0) -> None:
    if service.proc is None:
        return
    if service.proc.poll() is None:
        service.proc.send_signal(signal.SIGTERM)
        try:
            service.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            service.proc.kill()
            service.proc.wait()
    service.rc = service.proc.returncode
    if service.log:
        service.log.close()


def counts(run: Run) -> dict[str, int]:
    t = Topics(run.ns)
    out = {}
    for label, topic in (("events", t.events), ("dead letters", t.deadletter), ("trajectories", t.trajectories),
                         ("scored", t.scored), ("batches", t.batches), ("checkpoints", t.checkpoints)):
        try:
            out[label] = sum(hi - lo for lo, hi in end_offsets(run.settings, topic, timeout=2).values())
        except Exception:
            out[label] = -1
    return out


def learner_line(run: Run) -> str:
    log = run.dir / "logs" / "learner.log"
    if not log.exists():
        return ""
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.startswith(("update", "checkpoint"))]
    return lines[-1] if lines else ""


def view(run: Run) -> Table:
    table = Table(title=f"trajpipe demo {run.ns} — {time.monotonic() - run.started:.0f}s", expand=False)
    table.add_column("service")
    table.add_column("state")
    for s in run.services:
        table.add_row(s.name, s.state)
    for label, n in counts(run).items():
        table.add_row(f"[dim]{label}[/dim]", str(n))
    table.add_row("[bold]learner[/bold]", learner_line(run))
    return table


def supervise(run: Run, minutes: float) -> str:
    learner = next(s for s in run.services if s.name == "learner")
    deadline = run.started + minutes * 60
    with Live(view(run), console=console, refresh_per_second=1) as live:
        try:
            while learner.proc is not None and learner.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(1.0)
                live.update(view(run))
        except KeyboardInterrupt:
            return "interrupted"
    return "learner finished" if learner.proc is not None and learner.proc.poll() is not None else "time limit"


def shutdown(run: Run) -> None:
    order = [s for s in run.services if s.name.startswith("producer")] + \
            [s for s in run.services if s.name in ("learner", "streams", "shard-writer", "monitor")]
    for s in order:
        stop(s)
        console.print(f"stopped {s.name}: rc {s.rc}")


def evaluate(run: Run, args: argparse.Namespace) -> list[dict[str, Any]]:
    env = {**os.environ, **run.settings.as_env()}
    proc = subprocess.run([sys.executable, "-m", "learner.eval", "--ns", run.ns, "--versions", "first,latest",
                           "--sources", args.sources, "--episodes", str(args.eval_episodes), "--max-new-tokens",
                           str(args.max_new_tokens), "--json"], env=env, capture_output=True, text=True)
    (run.dir / "logs" / "eval.log").write_text(proc.stderr)
    if proc.returncode != 0:
        console.print(f"[red]evaluation failed[/red]: {proc.stderr[-1500:]}")
        return []
    results: list[dict[str, Any]] = json.loads(proc.stdout.strip().splitlines()[-1])
    (run.dir / "eval.json").write_text(json.dumps(results, indent=2))
    return results


def report(run: Run) -> int:
    env = {**os.environ, **run.settings.as_env()}
    return subprocess.call([sys.executable, "-m", "consumers.monitor", "--ns", run.ns, "--no-tui", "--duration", "5",
                            "--port", "0", "--report", str(run.dir)], env=env, stdout=subprocess.DEVNULL)


def healthy(run: Run, results: list[dict[str, Any]], how: str) -> list[str]:
    problems = [f"{s.name} exited {s.rc}" for s in run.services if s.rc not in (0, -signal.SIGTERM)]
    if how != "learner finished":
        problems.append(f"run ended by {how}")
    if len(results) == 2 and results[1]["reward_mean"] < results[0]["reward_mean"] + MIN_GAIN:
        problems.append(f"the final policy's held-out reward is not {MIN_GAIN} above the initial one's")
    if len(results) != 2:
        problems.append("no evaluation")
    return problems


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m infra demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ns", default=f"demo-{time.strftime('%Y%m%d-%H%M%S')}")
    p.add_argument("--sources", default="math-easy")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--updates", type=int, default=40)
    p.add_argument("--sft-updates", type=int, default=6)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--batch-trajectories", type=int, default=64, help="trajectories per shard (one update)")
    p.add_argument("--max-new-tokens", type=int, default=6)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--eval-episodes", type=int, default=64)
    p.add_argument("--monitor-port", type=int, default=9108)
    p.add_argument("--runs-dir", default="runs")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = parser().parse_args(argv)
    console.print("starting Kafka and MinIO (fetched once into the cache dir)…")
    settings = platform()
    run = Run(args.ns, Path(args.runs_dir) / args.ns, settings)
    bootstrap(settings, args.ns, partitions=2)
    run.services = plan(args, args.ns)
    for service in run.services:
        start(run, service)
    how = supervise(run, args.minutes)
    shutdown(run)
    console.print("evaluating the first and the last checkpoint on held-out tasks…")
    results = evaluate(run, args)
    report(run)
    problems = healthy(run, results, how)
    for r in results:
        console.print(f"v{r['version']}: end-to-end {r['end_to_end']:.3f}, single-step {r['single_step']:.3f}, "
                      f"reward {r['reward_mean']:.3f}")
    console.print(f"report: {run.dir}/")
    console.print("[green]healthy run[/green]" if not problems else f"[red]unhealthy[/red]: {problems}")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
