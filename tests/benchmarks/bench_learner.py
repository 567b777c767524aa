"""Learner benchmark: update steps/s through the full consumer (Kafka manifests + MinIO + disk cache,
prefetched) versus the same batches from memory; the ratio is what the pipeline costs the learner.

    python tests/benchmarks/bench_learner.py [--batches 24 --batch-size 32]
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from consumers.batch_reader import BatchReader, ShardCache  # noqa: E402
from consumers.shards import write_shard  # noqa: E402
from infra.bootstrap import bootstrap  # noqa: E402
from infra.kafka import Publisher  # noqa: E402
from infra.launcher import Launcher  # noqa: E402
from infra.objectstore import ObjectStore  # noqa: E402
from infra.settings import Settings  # noqa: E402
from learner.model import build_policy  # noqa: E402
from learner.update import TrainConfig, Trainer  # noqa: E402
from schemas import codec  # noqa: E402
from schemas.keys import batch_id, shard_key  # noqa: E402
from schemas.records import BatchManifest, Trajectory  # noqa: E402
from schemas.topics import Topics  # noqa: E402
from schemas.packing import pack_floats, pack_ids  # noqa: E402
from schemas.records import SourcePosition, TrajectoryTurn  # noqa: E402
from tests.benchmarks.report import Figure, record, scratch  # noqa: E402


def trajectory(rng: random.Random, ns: str, i: int, gen_tokens: int) -> Trajectory:
    """A GRPO-ready trajectory: a 32-token prompt, about `gen_tokens` generated tokens with log-probs."""
    gen = [rng.randrange(3, 259) for _ in range(rng.randint(gen_tokens // 2, gen_tokens))] + [1]
    reward = float(rng.random() < 0.5)
    turn = TrajectoryTurn(turn=0, policy_version=0, obs_text="", obs_tokens=b"", text="", tokens=pack_ids(gen),
                          logprobs=pack_floats([-5.5] * len(gen)), finish_reason="stop")
    return Trajectory(trajectory_id=f"traj-{i}", episode_id=f"ep-{i}", group_id=f"g-{i // 8}", task_id="t",
                      domain="math", run=ns, status="completed", task_spec="{}", prompt_text="",
                      prompt_tokens=pack_ids(rng.randrange(3, 259) for _ in range(32)), turns=(turn,),
                      reward=reward, reward_components={"outcome/correct": reward}, reward_fn="default",
                      reward_version="1", advantage=reward - 0.5, group_reward_mean=0.5, group_reward_std=0.5,
                      source_topic=f"{ns}.rollout.events", source_offsets=(SourcePosition(0, i),), started_ts=i,
                      ended_ts=i + 1, group_size=8)


def make_batches(ns: str, n: int, size: int, gen_tokens: int) -> list[list[Trajectory]]:
    rng = random.Random(0)
    return [[trajectory(rng, ns, b * size + i, gen_tokens) for i in range(size)] for b in range(n)]


def publish(settings: Settings, store: ObjectStore, topics: Topics, batches: list[list[Trajectory]]) -> None:
    pub = Publisher(settings)
    for b, trajs in enumerate(batches):
        first, last = b * len(trajs), (b + 1) * len(trajs) - 1
        key = shard_key(topics.ns, topics.scored, 0, first, last)
        data = write_shard(trajs, key)
        sha = store.put_verified(key, data)
        m = BatchManifest(batch_id=batch_id(topics.scored, 0, first, last), run=topics.ns, bucket=store.bucket,
                          key=key, sha256=sha, size=len(data), num_trajectories=len(trajs), num_tokens=0,
                          source_topic=topics.scored, partition=0, first_offset=first, last_offset=last,
                          policy_version_min=0, policy_version_max=0, reward_mean=0.0, reward_std=0.0,
                          trajectory_ids=tuple(t.trajectory_id for t in trajs), ts=b)
        pub.send(topics.batches, None, codec.encode(m))
    pub.close()


def trainer() -> Trainer:
    torch.manual_seed(0)
    return Trainer(build_policy(layers=4, width=256, seed=0), TrainConfig(algorithm="grpo", lr=1e-4, max_policy_lag=100))


def from_memory(batches: list[list[Trajectory]]) -> tuple[float, int]:
    t = trainer()
    t.step(batches[0], current_version=0)  # warm-up, not timed (both runs get one)
    tokens = 0
    start = time.perf_counter()
    for trajs in batches[1:]:
        tokens += int(t.step(trajs, current_version=0).get("tokens/trained", 0))
    return time.perf_counter() - start, tokens


def through_pipeline(settings: Settings, ns: str, n: int, cache_dir: str) -> tuple[float, int, float]:
    t = trainer()
    reader = BatchReader(settings, ns, f"{ns}-bench", ShardCache(cache_dir, 1 << 30), prefetch=2)
    first = reader.next_batch(timeout=30)
    assert first is not None
    t.step(list(first.trajectories), current_version=0)
    tokens, waited = 0, 0.0
    start = time.perf_counter()
    for _ in range(n - 1):
        w = time.perf_counter()
        batch = reader.next_batch(timeout=30)
        waited += time.perf_counter() - w
        assert batch is not None
        tokens += int(t.step(list(batch.trajectories), current_version=0).get("tokens/trained", 0))
    elapsed = time.perf_counter() - start
    reader.close()
    return elapsed, tokens, waited


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batches", type=int, default=24)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--gen-tokens", type=int, default=192)
    args = p.parse_args()
    started = time.monotonic()
    torch.set_num_threads(2)
    launcher = Launcher()
    launcher.up()
    settings = launcher.settings()
    ns = scratch("bench-learner-", 6)
    bootstrap(settings, ns, partitions=1)
    store = ObjectStore(settings)
    batches = make_batches(ns, args.batches, args.batch_size, args.gen_tokens)
    publish(settings, store, Topics(ns, 1), batches)
    # memory, pipeline, memory: the baseline is the mean of two runs around the pipeline run, so a
    # drift of the machine's speed (other load, clocks) does not count against either side.
    mem_a, mem_tokens = from_memory(batches)
    with tempfile.TemporaryDirectory() as cache:
        pipe_s, pipe_tokens, waited = through_pipeline(settings, ns, args.batches, cache)
    mem_b, _ = from_memory(batches)
    mem_s = (mem_a + mem_b) / 2
    steps = args.batches - 1
    print(f"tiny Llama (4 layers, width 256), GRPO, {steps} timed updates of {args.batch_size} trajectories "
          f"(32 prompt + up to {args.gen_tokens} generated tokens)")
    print(f"{'source':<32}{'steps/s':>10}{'tokens/s':>12}")
    print(f"{'from memory':<32}{steps / mem_s:>10.2f}{mem_tokens / mem_s:>12.0f}")
    print(f"{'Kafka + MinIO + cache, prefetch':<32}{steps / pipe_s:>10.2f}{pipe_tokens / pipe_s:>12.0f}")
    print(f"ratio pipeline/memory: {mem_s / pipe_s:.3f} (goal >= 0.97); time waiting for data: {waited / pipe_s:.1%}")
    record("bench_learner", f"GRPO, tiny Llama 4x256, {steps} timed updates of {args.batch_size} trajectories "
           f"(32 prompt + up to {args.gen_tokens} generated tokens)", [
               Figure("updates/s from memory", steps / mem_s, "updates/s"),
               Figure("updates/s fed by Kafka manifests + MinIO + disk cache", steps / pipe_s, "updates/s",
                      mem_s / pipe_s, "from memory", "≥ 0.97", mem_s / pipe_s >= 0.97),
               Figure("learner waiting for data", 100 * waited / pipe_s, "% of the time"),
           ], started)


if __name__ == "__main__":
    main()
