"""Chaos the way operations meet it: a supervisor restarts every service while one of them is killed -9 every
20 s; then the broker restarts and MinIO is away for 30 s. Afterwards every id is accounted for, and the final
weights equal those of a learner that trained the same batches, in the same order, without interruption. The
learner stores its optimizer state in every third version only: a restart after a weights-only version trains
the batches since the version before it with moments again."""
from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load

from infra.bootstrap import bootstrap
from infra.kafka import Publisher, read_topic
from infra.objectstore import ObjectStore
from infra.supervisor import Service, Supervisor
from learner import checkpoint_store
from schemas import codec
from schemas.records import BatchManifest
from schemas.topics import Topics
from tests.e2e.pipeline import MODEL, ROOT, PipelineRun, assert_every_id_accounted_for, unclosed_episodes

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CHAOS_S = 140.0
KILL_EVERY_S = 20.0
MINIO_AWAY_S = 30.0
LEARNER = [*MODEL, "--updates-per-checkpoint", "2", "--max-policy-lag", "1000", "--moments-every", "3"]


def test_a_random_kill_every_20s_a_broker_restart_and_minio_away_lose_nothing_and_train_reproducibly(
        tmp_path: Path) -> None:
    run = PipelineRun(tmp_path)
    t, ns = run.topics, run.ns
    sup = Supervisor(run.settings, tmp_path, max_restarts=20, echo=print)  # logs beside run.logs()
    try:
        bootstrap(run.settings, ns, partitions=2)
        sup.add(Service("streams", ["streams", "--ns", ns, "--episode-timeout-s", "12", "--group-timeout-s", "12"]))
        sup.add(Service("writer", ["consumers.shard_writer", "--ns", ns, "--max-trajectories", "16",
                                   "--max-age-s", "2"]))
        sup.add(Service("learner", ["learner", "--ns", ns, *LEARNER, "--cache-dir", str(tmp_path / "cache")]))
        # paced by the learner: at most 32 episodes per version, then a wait of up to 4 s for a newer one
        sup.add(Service("producer", ["producers", "--ns", ns, "--sources", "math-easy", "--group-size", "4",
                                     "--prompts-per-step", "2", "--max-new-tokens", "6", "--max-policy-lag", "1000",
                                     "--max-episodes-per-version", "32", "--quota-wait-s", "4", "--producer-id",
                                     "chaos-producer", "--seed", "1", *MODEL]))
        sup.start_due(lambda s: True)
        rng = random.Random(20)
        kills: list[str] = []
        started = time.monotonic()
        next_kill = started + KILL_EVERY_S
        while time.monotonic() - started < CHAOS_S:
            sup.tick()
            if time.monotonic() >= next_kill:
                running = [s for s in sup.services if s.running]
                if running:
                    victim = rng.choice(running)
                    kills.append(victim.name)
                    sup.kill(victim)
                next_kill += KILL_EVERY_S
            assert not any(s.gave_up for s in sup.services), run.logs()
            time.sleep(0.5)
        run.launcher.stop(run.launcher.kafka)
        tick_for(sup, 3)
        run.launcher.start("kafka")
        run.launcher.kill("minio")
        tick_for(sup, MINIO_AWAY_S)
        run.launcher.start("minio")
        tick_for(sup, 10)
        sup.stop(sup["producer"])  # its in-flight episodes end as aborted, and it flushes
        deadline = time.monotonic() + 300
        while unclosed := unclosed_episodes(run):
            assert time.monotonic() < deadline, unclosed
            tick_for(sup, 5)
        for topic in (t.trajectories, t.scored, t.batches):
            run.settled(topic)
        tick_for(sup, 10)
        for name in ("learner", "writer", "streams"):
            sup.stop(sup[name])
            assert sup[name].rc == 0, f"{name} exited {sup[name].rc}; logs:\n{run.logs()}"
        print(f"killed: {kills}; restarts: {[(s.name, s.restarts) for s in sup.services]}")
        assert len(kills) >= CHAOS_S // KILL_EVERY_S - 1 and set(kills) >= {"learner", "streams"}

        lineage = assert_every_id_accounted_for(run, orphans=False)
        final = lineage[-1].version
        assert final >= 3, "the learner hardly trained: the test proves little"
        replayed = replay_learner(run, tmp_path)
        store = ObjectStore(run.settings)
        assert replayed == final
        chaos = load(checkpoint_store.load_version(store, ns, final).files["model.safetensors"])
        calm = load(checkpoint_store.load_version(store, f"{ns}-replay", final).files["model.safetensors"])
        assert chaos.keys() == calm.keys()
        for name, tensor in chaos.items():
            torch.testing.assert_close(tensor, calm[name], rtol=0, atol=1e-6, msg=name)
    finally:
        sup.stop_all()
        run.close()


def tick_for(sup: Supervisor, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sup.tick()
        time.sleep(0.5)


def replay_learner(run: PipelineRun, tmp_path: Path) -> int:
    """The batches the chaos run trained, in the order it first read them, to a learner that is never
    interrupted; returns its final version."""
    seen: dict[str, BatchManifest] = {}
    for message in read_topic(run.settings, run.topics.batches):
        manifest = codec.decode(message.value(), expect=BatchManifest)
        seen.setdefault(manifest.batch_id, manifest)
    replay = Topics(f"{run.ns}-replay", partitions=2)
    bootstrap(run.settings, replay.ns, partitions=2)
    publisher = Publisher(run.settings)
    for manifest in seen.values():
        publisher.send(replay.batches, None, codec.encode(manifest))
    publisher.close()
    env = {**os.environ, **run.settings.as_env(), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("TRAJPIPE_FAULT", None)
    proc = subprocess.run([sys.executable, "-m", "learner", "--ns", replay.ns, *LEARNER, "--idle-exit", "5",
                           "--replica-of", run.ns,
                           "--cache-dir", str(tmp_path / "replay-cache")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return max(e.version for e in checkpoint_store.published(run.settings, replay) if e.run == replay.ns)
