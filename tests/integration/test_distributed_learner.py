"""The learner as a torchrun job (gloo, 2 ranks on CPU) against the real broker and store: the same weights
as one process on the same batches, a resume with another number of ranks, and a rank killed mid-update."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from infra.bootstrap import bootstrap
from infra.objectstore import ObjectStore
from infra.settings import Settings
from schemas.topics import Topics
from tests.integration.test_learner_service import announced_lineage, final_weights, publish_batches, run_learner

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# SFT, then GRPO with a KL term to v0 and two micro-batches per rank: the reference, the phase switch and the
# accumulation all run on every rank.
FLAGS = ("--sft-updates", "2", "--kl-coef", "0.5", "--max-policy-lag", "100", "--grad-accum", "2")
TWO_RANKS = ("--standalone", "--nproc-per-node", "2")


def uninterrupted(stack: Settings, store: ObjectStore, topics: Topics, tmp: Path) -> str:
    """The same 12 batches trained by one process, never interrupted: the weights to compare with."""
    calm = Topics(f"{topics.ns}-calm")
    bootstrap(stack, calm.ns, partitions=1)
    publish_batches(stack, store, calm, 12)
    proc = run_learner(stack, calm.ns, tmp / "calm", None, *FLAGS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return calm.ns


def assert_same_weights(store: ObjectStore, ns: str, other: str, version: int) -> None:
    mine, theirs = final_weights(store, ns, version), final_weights(store, other, version)
    assert mine.keys() == theirs.keys()
    for name, tensor in mine.items():
        torch.testing.assert_close(tensor, theirs[name], rtol=0, atol=1e-5, msg=f"v{version} {name}")


def assert_each_batch_once_and_the_uninterrupted_weights(stack: Settings, store: ObjectStore, topics: Topics,
                                                         tmp: Path, published: list[str]) -> None:
    """Every published batch trained (or skipped) once over the lineage, and at every version the weights one
    uninterrupted process makes of the same batches."""
    lineage = announced_lineage(stack, store, topics)
    trained = [b for m in lineage for b in m.batch_ids] + [b for m in lineage for b in m.skipped_batches]
    assert sorted(trained) == sorted(published)
    calm = uninterrupted(stack, store, topics, tmp)
    for manifest in lineage[1:]:
        assert_same_weights(store, topics.ns, calm, manifest.version)


def test_two_ranks_train_the_weights_one_process_does_and_a_run_resumes_on_one_rank(
        stack: Settings, topics: Topics, store: ObjectStore, tmp_path: Path) -> None:
    published = publish_batches(stack, store, topics, 12)
    proc = run_learner(stack, topics.ns, tmp_path, None, *FLAGS, "--max-updates", "4", launch=TWO_RANKS)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "rank 1/2: trained its share of" in proc.stderr
    halfway = announced_lineage(stack, store, topics)[-1]
    assert halfway.step == 4

    proc = run_learner(stack, topics.ns, tmp_path, None, *FLAGS)  # the rest on one process
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed v{halfway.version}" in proc.stderr
    assert_each_batch_once_and_the_uninterrupted_weights(stack, store, topics, tmp_path, published)


def test_a_rank_killed_mid_update_restarts_the_job_from_the_last_announced_checkpoint(
        stack: Settings, topics: Topics, store: ObjectStore, tmp_path: Path) -> None:
    published = publish_batches(stack, store, topics, 12)
    # Rank 1 dies with SIGKILL in its third update; torchrun restarts both ranks once, and the fault does not
    # fire again in the restarted job.
    proc = run_learner(stack, topics.ns, tmp_path, "mid_update:3@1", *FLAGS,
                       launch=(*TWO_RANKS, "--max-restarts", "1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "failed (exitcode: -9) local_rank: 1" in proc.stderr, proc.stderr[-4000:]
    assert "resumed v1 after 2 updates" in proc.stderr  # the checkpoint at the end of SFT, announced

    lineage = announced_lineage(stack, store, topics)
    trained = [b for m in lineage for b in m.batch_ids] + [b for m in lineage for b in m.skipped_batches]
    assert sorted(trained) == sorted(published)  # no batch trained twice, none skipped
    assert [m.version for m in lineage] == list(range(len(lineage)))
    calm = uninterrupted(stack, store, topics, tmp_path)
    assert_same_weights(store, topics.ns, calm, lineage[-1].version)


def test_fsdp_ranks_train_the_weights_one_process_does_and_resume_with_the_moments_sharded_again(
        stack: Settings, topics: Topics, store: ObjectStore, tmp_path: Path) -> None:
    """--fsdp: every weight, gradient and Adam moment sharded over 2 ranks; the checkpoints gathered whole (rank
    1 takes part in each), and a resumed job moves the restored moments into its shards again."""
    published = publish_batches(stack, store, topics, 12)
    proc = run_learner(stack, topics.ns, tmp_path, None, *FLAGS, "--fsdp", "--max-updates", "4", launch=TWO_RANKS)
    assert proc.returncode == 0, proc.stderr[-4000:]
    proc = run_learner(stack, topics.ns, tmp_path, None, *FLAGS, "--fsdp", launch=TWO_RANKS)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resumed v2 after 4 updates" in proc.stderr
    assert_each_batch_once_and_the_uninterrupted_weights(stack, store, topics, tmp_path, published)
