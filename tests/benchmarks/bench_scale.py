"""Scale-out figures: producer -> consumer events/s on a private 3-broker cluster vs one broker.

    python tests/benchmarks/bench_scale.py [--events 50000]

Both stacks are started here (in temporary state dirs, on free ports) from the same cached jars; each
produces the same encoded PolicyTurn events with the pipeline's idempotent acks=all producer (on the cluster
every write waits for 2 in-sync replicas of 3), then consumes and decodes them. Ratios, not absolute times.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from infra.bootstrap import bootstrap, topic_config  # noqa: E402
from infra.launcher import Launcher  # noqa: E402
from tests.benchmarks.bench_codec import through_broker  # noqa: E402
from tests.integration.test_launcher import free_port_pair  # noqa: E402


def through(launcher: Launcher, n: int) -> tuple[float, float, str]:
    """(produced events/s with delivery confirmed, consumed+decoded events/s, the topic's replication)."""
    settings = launcher.settings()
    ns = f"scale-{uuid.uuid4().hex[:8]}"
    bootstrap(settings, ns, partitions=4)
    topic = f"{ns}.rollout.events"
    produce, consume, _ = through_broker(settings, topic, n)
    replicas = f"min.insync.replicas={topic_config(settings, topic)['min.insync.replicas']}"
    return produce, consume, replicas


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=50_000)
    args = parser.parse_args()
    rows = []
    for brokers in (1, 3):
        with tempfile.TemporaryDirectory(prefix="trajpipe-scale-") as state:
            launcher = Launcher(state_dir=Path(state), kafka_port=free_port_pair(2 * brokers),
                                minio_port=free_port_pair(), brokers=brokers)
            try:
                launcher.up()
                rows.append((brokers, *through(launcher, args.events)))
            finally:
                launcher.down()
    print(f"\n{args.events} encoded PolicyTurn events, idempotent producer, acks=all, 4 partitions")
    print(f"{'brokers':>8}{'produce/s':>12}{'consume/s':>12}  replication")
    for brokers, produce, consume, replicas in rows:
        print(f"{brokers:>8}{produce:>12,.0f}{consume:>12,.0f}  {replicas}")
    (_, p1, c1, _), (_, p3, c3, _) = rows
    print(f"3 brokers vs 1: produce x{p3 / p1:.2f}, consume x{c3 / c1:.2f} (all nodes share this machine's cores)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
