"""Scale-out figures: stream workers, learner ranks and brokers, each as a ratio against one of them.

    python tests/benchmarks/bench_scale.py [--events 50000] [--stream-events 60000] [--updates 8]

1. Brokers: producer -> consumer events/s on a private 3-broker cluster vs one broker. Both stacks are
   started here (in temporary state dirs, on free ports) from the same cached jars; each produces the same
   encoded PolicyTurn events with the pipeline's idempotent acks=all producer (on the cluster every write
   waits for 2 in-sync replicas of 3), then consumes and decodes them.
2. Stream workers: the streams benchmark's realistic mix (bench_streams.py) through 1 and then 2
   `python -m streams` workers sharing 4 partitions on the one-broker stack; the workers join first, so the
   figure is the shared steady state. Events/s and events per CPU-second (all workers' CPU together).
3. Learner ranks: GRPO updates on the same in-memory batches (bench_learner.py's) by `torchrun` with 1 and 2
   ranks (gloo): samples/s. Every rank is a process of this machine; the ratio says what a second rank buys
   here, not on a host with a core (or GPU) per rank.
Ratios, not absolute times.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from infra.bootstrap import bootstrap, topic_config  # noqa: E402
from infra.launcher import Launcher  # noqa: E402
from tests.benchmarks.bench_codec import through_broker  # noqa: E402
from tests.benchmarks.bench_streams import throughput  # noqa: E402
from tests.stack import private_launcher  # noqa: E402
from tests.benchmarks.report import Figure, record, scratch  # noqa: E402


def through(launcher: Launcher, n: int) -> tuple[float, float, str]:
    """(produced events/s with delivery confirmed, consumed+decoded events/s, the topic's replication)."""
    settings = launcher.settings()
    ns = scratch("scale-")
    bootstrap(settings, ns, partitions=4)
    topic = f"{ns}.rollout.events"
    produce, consume, _ = through_broker(settings, topic, n)
    replicas = f"min.insync.replicas={topic_config(settings, topic)['min.insync.replicas']}"
    return produce, consume, replicas


def streams_scaling(launcher: Launcher, events: int) -> list[dict[str, float]]:
    """bench_streams' throughput with 1 and 2 workers on this stack's broker."""
    args = argparse.Namespace(events=events, tokens=64, concurrent=512, partitions=4, timeout=900,
                              log_dir=tempfile.mkdtemp(prefix="trajpipe-scale-streams-"))
    return [throughput(launcher.settings(), args, workers=w, settle_s=25.0) for w in (1, 2)]


def learner_rank() -> int:
    """One rank of the learner figure (run by torchrun): timed GRPO updates on in-memory batches."""
    import torch

    from learner.distributed import join
    from learner.model import build_policy
    from learner.update import TrainConfig, Trainer
    from tests.benchmarks.bench_learner import make_batches

    updates = int(os.environ["BENCH_UPDATES"])
    world = join("cpu")
    torch.manual_seed(0)
    trainer = Trainer(build_policy(layers=4, width=256, seed=0),
                      TrainConfig(algorithm="grpo", lr=1e-4, max_policy_lag=100), world=world)
    batches = make_batches("scale", updates + 1, 32, 192)
    trainer.step(batches[0], current_version=0)  # warm-up
    started = time.perf_counter()
    for batch in batches[1:]:
        trainer.step(batch, current_version=0)
    seconds = time.perf_counter() - started
    if world.leader:
        print(f"samples_per_s {updates * 32 / seconds:.3f}", flush=True)
    world.close()
    return 0


def learner_scaling(updates: int) -> list[float]:
    rates = []
    for ranks in (1, 2):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                               str(ranks), __file__, "--learner-rank"], env={**os.environ, "BENCH_UPDATES": str(updates)},
                              capture_output=True, text=True, timeout=1800)
        found = re.search(r"samples_per_s ([0-9.]+)", proc.stdout)
        if proc.returncode != 0 or not found:
            raise RuntimeError(f"{ranks} rank(s) failed: {proc.stderr[-2000:]}")
        rates.append(float(found.group(1)))
    return rates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=50_000, help="events for the broker figure")
    parser.add_argument("--stream-events", type=int, default=60_000, help="events for the stream-worker figure")
    parser.add_argument("--updates", type=int, default=8, help="timed learner updates per rank count")
    parser.add_argument("--learner-rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.learner_rank:
        return learner_rank()
    started = time.monotonic()
    rows = []
    streams: list[dict[str, float]] = []
    for brokers in (1, 3):
        with tempfile.TemporaryDirectory(prefix="trajpipe-scale-") as state:
            launcher = private_launcher(Path(state), brokers=brokers)
            try:
                launcher.up()
                rows.append((brokers, *through(launcher, args.events)))
                if brokers == 1:
                    streams = streams_scaling(launcher, args.stream_events)
            finally:
                launcher.down()
    learner = learner_scaling(args.updates)

    print(f"\n{args.events} encoded PolicyTurn events, idempotent producer, acks=all, 4 partitions")
    print(f"{'brokers':>8}{'produce/s':>12}{'consume/s':>12}  replication")
    for brokers, produce, consume, replicas in rows:
        print(f"{brokers:>8}{produce:>12,.0f}{consume:>12,.0f}  {replicas}")
    (_, p1, c1, _), (_, p3, c3, _) = rows
    print(f"3 brokers vs 1: produce x{p3 / p1:.2f}, consume x{c3 / c1:.2f} (all nodes share this machine's cores)")

    print(f"\n{args.stream_events} rollout events (code, math, table), 4 partitions, workers joined first")
    print(f"{'workers':>8}{'events/s':>12}{'per CPU-s':>12}{'CPU-s':>8}")
    for workers, run in zip((1, 2), streams):
        print(f"{workers:>8}{run['events_per_s']:>12,.0f}{run['events_per_cpu_s']:>12,.0f}{run['cpu_s']:>8.1f}")
    one, two = streams
    print(f"2 workers vs 1: events/s x{two['events_per_s'] / one['events_per_s']:.2f}, events per CPU-second "
          f"x{two['events_per_cpu_s'] / one['events_per_cpu_s']:.2f} (on {os.cpu_count()} cores)")

    print(f"\nGRPO updates of 32 trajectories (4 layers x 256, ~200 tokens), torchrun + gloo, {args.updates} timed")
    for ranks, rate in zip((1, 2), learner):
        print(f"{ranks:>8} rank(s): {rate:.2f} samples/s")
    print(f"2 ranks vs 1: x{learner[1] / learner[0]:.2f} (one machine, {os.cpu_count()} cores shared by the ranks)")
    record("bench_scale", f"brokers: {args.events:,} PolicyTurn events, acks=all, 4 partitions; stream workers: "
           f"{args.stream_events:,} events of the realistic mix; learner: GRPO updates of 32 trajectories, torchrun "
           "+ gloo; every instance on this machine's cores", [
               Figure("3 brokers (replication 3, min.insync 2): produced", p3, "events/s", p3 / p1, "1 broker"),
               Figure("3 brokers: consumed and decoded", c3, "events/s", c3 / c1, "1 broker"),
               Figure("2 stream workers", two["events_per_s"], "events/s", two["events_per_s"] / one["events_per_s"],
                      "1 worker"),
               Figure("2 stream workers, per CPU-second", two["events_per_cpu_s"], "events/CPU-s",
                      two["events_per_cpu_s"] / one["events_per_cpu_s"], "1 worker"),
               Figure("2 learner ranks", learner[1], "samples/s", learner[1] / learner[0], "1 rank"),
           ], started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
