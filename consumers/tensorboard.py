"""A namespace's metrics topic as TensorBoard event files: every PipelineMetric becomes a scalar.

    python -m consumers.tensorboard --ns run1 --logdir runs/run1/tensorboard          # follows until Ctrl-C
    python -m consumers.tensorboard --ns run1 --logdir runs/run1/tensorboard --once   # what is there, then exits
    tensorboard --logdir runs/run1/tensorboard

The tag is `<source>/<name>`, with the labels that tell series apart appended (e.g.
`streams/streams/groups/outcome_timed_out`; the learner's version and algorithm labels are not: they
change along one series). The step is the series' own count (the learner's n-th update, the n-th
metrics window of the streams), the wall time the end of the metric's window. It reads as consumer group
`<ns>-tensorboard`, so a restarted tap goes on where it stopped. Needs the `tensorboardX` package
(the `tracking` extra).
"""
from __future__ import annotations

import argparse
import re
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional

from confluent_kafka import TopicPartition

from consumers.monitoring import SERIES_LABELS_IGNORED
from infra.kafka import consumer, end_offsets
from infra.settings import Settings, add_ns_argument
from schemas.codec import codec
from schemas.errors import DecodeError, PipelineError
from schemas.records import PipelineMetric
from schemas.topics import Topics


def tag_of(metric: PipelineMetric) -> str:
    """`source/name`, then `/label_value` per label that tells series apart, in TensorBoard's tag characters."""
    parts = [metric.source, metric.name] + [f"{k}_{v}" for k, v in sorted(metric.labels.items())
                                             if k not in SERIES_LABELS_IGNORED]
    return re.sub(r"[^A-Za-z0-9_./-]", "_", "/".join(parts))


class TensorBoardTap:
    def __init__(self, settings: Settings, ns: str, logdir: Path) -> None:
        try:
            from tensorboardX import SummaryWriter
        except ImportError as exc:
            raise PipelineError("the TensorBoard tap needs tensorboardX: pip install -e '.[tracking]'") from exc
        self.topic = Topics(ns).metrics
        self.settings = settings
        self.writer: Any = SummaryWriter(logdir=str(logdir), flush_secs=5)
        self.consumer = consumer(settings, f"{ns}-tensorboard", **{"enable.auto.commit": True})
        self.consumer.subscribe([self.topic])
        self.steps: dict[str, int] = defaultdict(int)
        self.written = 0
        self.skipped = 0

    def take(self, timeout: float) -> int:
        """Write what arrives within `timeout`; returns how many records came."""
        messages = self.consumer.consume(1000, timeout=timeout)
        for message in messages:
            if message.error() is not None:
                continue
            try:
                metric = codec.decode(message.value() or b"", expect=PipelineMetric)
            except DecodeError:
                self.skipped += 1  # not a metric: the monitor and the dead weight of the topic say so
                continue
            if metric.value != metric.value:  # NaN: TensorBoard would draw nothing sensible
                continue
            tag = tag_of(metric)
            self.writer.add_scalar(tag, metric.value, global_step=self.steps[tag], walltime=metric.window_end / 1000)
            self.steps[tag] += 1
            self.written += 1
        return len(messages)

    def caught_up(self) -> bool:
        assigned = self.consumer.assignment()
        if not assigned:
            return False
        ends = end_offsets(self.settings, self.topic)
        positions = self.consumer.position([TopicPartition(tp.topic, tp.partition) for tp in assigned])
        return all(p.offset >= ends[p.partition][1] or ends[p.partition][1] == 0 for p in positions)

    def close(self) -> None:
        self.writer.close()
        self.consumer.close()


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m consumers.tensorboard", description=__doc__.splitlines()[0])
    add_ns_argument(p)
    p.add_argument("--logdir", type=Path, required=True, help="where the event files go")
    p.add_argument("--once", action="store_true", help="write what the topic holds now, then exit")
    args = p.parse_args(argv)
    try:
        tap = TensorBoardTap(Settings.from_env(), args.ns, args.logdir)
    except PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        deadline = time.monotonic() + 120
        while True:
            tap.take(1.0)
            if args.once and (tap.caught_up() or time.monotonic() > deadline):
                break
    except KeyboardInterrupt:
        pass
    finally:
        tap.close()
    print(f"{tap.written} scalars in {len(tap.steps)} series to {args.logdir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
