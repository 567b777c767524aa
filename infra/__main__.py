"""`python -m infra up|down|status|fetch|bootstrap|env|smoke|demo`: the local platform from the command line."""
from __future__ import annotations

import argparse
import os
import json
import subprocess
import sys

from infra.launcher import BROKERS_VAR, Launcher
from infra.settings import NS_VAR, Settings, add_ns_argument
from schemas.errors import PipelineError


def _print(obj: object) -> None:
    print(json.dumps(obj, indent=2, default=str))


def cmd_up(args: argparse.Namespace) -> int:
    _print(Launcher(brokers=args.brokers).up())
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


def cmd_doctor(args: argparse.Namespace) -> int:
    from infra.doctor import main as doctor

    return doctor()


def cmd_namespaces(args: argparse.Namespace) -> int:
    from infra.namespaces import survey

    rows = [entry.row() for entry in survey(Settings.from_env()).values()]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'namespace':<32} {'topics':>6} {'records':>10} {'objects':>8} {'MB':>9}  running consumers")
    for r in rows:
        print(f"{r['ns']:<32} {r['topics']:>6} {r['records']:>10} {r['objects']:>8} {r['object_mb']:>9.2f}  "
              f"{', '.join(r['running_consumers']) or '-'}")
    return 0


def cmd_delete_namespace(args: argparse.Namespace) -> int:
    from infra.namespaces import delete_namespace

    result = delete_namespace(Settings.from_env(), args.ns, force=args.force)
    _print(result)
    return 1 if result["failed"] else 0


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
    args = parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m infra", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("up", help="start Kafka and MinIO (fetched once into the cache dir)")
    p.add_argument("--brokers", type=int, default=None, metavar="N",
                   help=f"Kafka brokers: 1 (default), or a cluster of N on consecutive ports, topics replicated "
                        f"min(N, 3) times with min.insync.replicas 2 from 3 on (default ${BROKERS_VAR}, else what "
                        f"the state dir was formatted with, else 1)")
    p.set_defaults(fn=cmd_up)
    for name, fn in (("down", cmd_down), ("status", cmd_status), ("fetch", cmd_fetch), ("env", cmd_env)):
        sub.add_parser(name).set_defaults(fn=fn)
    p = sub.add_parser("bootstrap", help="create the topics and bucket of a namespace")
    add_ns_argument(p)
    p.add_argument("--partitions", type=int, default=4)
    p.set_defaults(fn=cmd_bootstrap)
    sub.add_parser("doctor", help="check the system tools (bubblewrap, Java 17, Maven, Go 1.24)").set_defaults(
        fn=cmd_doctor)
    p = sub.add_parser("namespaces", help="every namespace with its topics, records, objects and consumers")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_namespaces)
    p = sub.add_parser("delete-namespace", help="delete a namespace's topics, objects and consumer groups")
    p.add_argument("ns", help="the namespace")
    p.add_argument("--force", action="store_true", help="even while a consumer of it is running")
    p.set_defaults(fn=cmd_delete_namespace)
    p = sub.add_parser("smoke", help="bring the stack up and run a round trip through it")
    p.add_argument("--ns", default=os.environ.get(NS_VAR), help="default: $TRAJPIPE_NS, else a fresh one")
    p.set_defaults(fn=cmd_smoke)
    sub.add_parser("demo", help="the main job: every service as a process (python -m infra demo --help)")
    return parser


if __name__ == "__main__":
    sys.exit(main())
