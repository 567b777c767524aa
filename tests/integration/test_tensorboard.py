"""The TensorBoard tap against the real broker: metrics on the topic become scalars in event files."""
from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from infra.kafka import Publisher
from infra.settings import Settings
from schemas.codec import codec
from schemas.records import PipelineMetric
from schemas.topics import Topics

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """(step, value) per tag, read back from the TFRecord event files."""
    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(logdir.rglob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack_from("<Q", data, at)
            event = Event.FromString(data[at + 12:at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def test_metrics_become_tensorboard_scalars(stack: Settings, topics: Topics, tmp_path: Path) -> None:
    pub = Publisher(stack)
    for i, loss in enumerate((0.9, 0.7, 0.4)):
        pub.send(topics.metrics, b"loss/total", codec.encode(PipelineMetric(
            source="learner", name="loss/total", value=loss, labels={"version": str(i), "algorithm": "grpo"},
            window_start=1_700_000_000_000 + i, window_end=1_700_000_000_000 + i)))
    pub.send(topics.metrics, b"streams/groups", codec.encode(PipelineMetric(
        source="streams", name="streams/groups", value=3.0, labels={"outcome": "complete"},
        window_start=1_700_000_000_000, window_end=1_700_000_010_000)))
    pub.send(topics.metrics, b"junk", b"not a metric")
    pub.close()
    logdir = tmp_path / "tb"
    env = {**os.environ, **stack.as_env(), "TRAJPIPE_NS": topics.ns}
    done = subprocess.run([sys.executable, "-m", "consumers.tensorboard", "--logdir", str(logdir), "--once"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    got = scalars(logdir)
    assert [(s, round(v, 4)) for s, v in got["learner/loss/total"]] == [(0, 0.9), (1, 0.7), (2, 0.4)]
    assert got["streams/streams/groups/outcome_complete"] == [(0, 3.0)]
