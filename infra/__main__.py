"""`python -m infra up|down|status|fetch|bootstrap|env|smoke|demo`: the local platform from the command line."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

from infra.launcher import Launcher
from infra.settings import Settings
from schemas.errors import PipelineError


def _print(obj: object) -> None:
    print(json.dumps(obj, indent=2, default=str))


def cmd_up(args: argparse.Namespace) -> int:
    _print(Launcher().up())
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    _print(Launcher().down())
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    status = Launcher().status()
    _print(status)
    return 0 if all(s["ready"] for s in status.values()) else 1


def cmd_fetch(args: argparse.Namespace) -> int:
    Launcher().fetch()
    print("kafka and minio are in the cache")
    return 0


def cmd_bootstrap(args: argparse.Namespace) -> int:
    from infra.bootstrap import bootstrap

    report = bootstrap(Settings.from_env(), args.ns, args.partitions)
    _print(report.__dict__)
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    for k, v in Settings.from_env().as_env().items():
        print(f"export {k}={v}")
    return 0


def cmd_smoke(args: argparse.Namespace) -> int:
    from infra.smoke import run_smoke

    Launcher().up()
    result = run_smoke(Settings.from_env(), args.ns)
    _print(result)
    return 0 if result["events_read_back_equal"] else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["demo"]:  # its own options: see `python -m infra demo --help`
        return subprocess.call([sys.executable, "-m", "infra.demo", *argv[1:]])
    parser = argparse.ArgumentParser(prog="python -m infra", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn in (("up", cmd_up), ("down", cmd_down), ("status", cmd_status), ("fetch", cmd_fetch),
                     ("env", cmd_env)):
        sub.add_parser(name).set_defaults(fn=fn)
    p = sub.add_parser("bootstrap", help="create the topics and bucket of a namespace")
    p.add_argument("--ns", required=True)
    p.add_argument("--partitions", type=int, default=4)
    p.set_defaults(fn=cmd_bootstrap)
    p = sub.add_parser("smoke", help="bring the stack up and run a round trip through it")
    p.add_argument("--ns", default=None)
    p.set_defaults(fn=cmd_smoke)
    sub.add_parser("demo", help="the main job: every service as a process (python -m infra demo --help)")
    args = parser.parse_args(argv)
    try:
        return int(args.fn(args))
    except PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
