"""Rebuild a run's checkpoints from its batch log: the log reproduces the model.

    python -m learner.rebuild --from-ns run1 --to-ns run1-rebuilt             # every version, then compare
    python -m learner.rebuild --from-ns run1 --to-ns run1-v6 --until 6
    python -m learner.rebuild --from-ns run1 --to-ns run1-lr3e4 -- --lr 3e-4   # "what if": a new lineage

The batches the source run trained into versions 1..K (its checkpoint manifests name them, trained or
skipped) are published to the new namespace's batches topic in the order the source read them (its
batches topic), and a learner started with the options the source recorded in each checkpoint
(`trainer_state.json`: learner_args) trains them, never interrupted, up to the source's update count at
vK. Then every version's weights are compared with the source's: on CPU they are bit-identical.

When retention dropped the source's batches topic, the batch manifests are rebuilt from the shards in the
object store, in the order each checkpoint manifest recorded (`read_order`).

Options after `--` change the learner (another learning rate, loss or clip): a new lineage from the same
batches, which are then off-policy data for it (their behaviour log-probs are the source's policies');
the comparison is still printed, as differences.

`--rescored NS2` changes the rewards instead: NS2 is the source's history re-scored (`python -m
consumers.replay --from-ns run1 --to-ns NS2 --score default:2`), and every batch is made again from NS2's
scored trajectories (new rewards and group advantages), with the same trajectories in the same order, as
shards of the new namespace. A trajectory NS2 did not score (its group has no variance under the new
reward, so streams dropped it) is left out of its batch, counted. The data and its order are the
source's; only the reward differs: the "what if it had been trained with that reward" experiment.

    python -m learner.rebuild --from-ns run1 --to-ns run1-r2-train --rescored run1-r2
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from consumers.batch_reader import parse_batch_id
from consumers.shard_writer import build_manifest
from consumers.shards import read_shard, write_shard
from infra.bootstrap import bootstrap
from infra.kafka import Publisher, read_topic
from infra.objectstore import ObjectStore
from infra.settings import Settings, add_ns_argument
from learner import checkpoint_store
from learner.checkpoint_files import MODEL_FILE, TRAINER_STATE_FILE
from schemas.codec import codec
from schemas.errors import ConfigError, DecodeError, PipelineError
from schemas.keys import checkpoint_prefix, shard_key
from schemas.manifests import CheckpointManifest
from schemas.packing import sha256_hex
from schemas.records import BatchManifest, Trajectory
from schemas.topics import Topics

ROOT = Path(__file__).resolve().parents[1]


def source_lineage(settings: Settings, store: ObjectStore, ns: str, until: Optional[int]
                   ) -> list[CheckpointManifest]:
    versions = sorted(e.version for e in checkpoint_store.published(settings, Topics(ns)) if e.run == ns)
    if not versions:
        raise ConfigError(f"{ns} announced no checkpoint")
    final = versions[-1] if until is None else until
    if final not in versions:
        raise ConfigError(f"--until {until}: {ns} announced v{versions[0]}..v{versions[-1]}")
    return [checkpoint_store.read_manifest(store, ns, v) for v in range(final + 1)]


def recorded_args(store: ObjectStore, manifest: CheckpointManifest) -> list[str]:
    key = checkpoint_prefix(manifest.run, manifest.version) + TRAINER_STATE_FILE
    state = json.loads(store.get(key, sha256=manifest.files[TRAINER_STATE_FILE].sha256))
    args = state.get("learner_args")
    if not args:
        raise ConfigError(f"v{manifest.version} of {manifest.run} records no learner options (written before "
                          "checkpoints recorded them): give them after --")
    return [str(a) for a in args]


def batches_in_read_order(settings: Settings, store: ObjectStore, ns: str,
                          lineage: list[CheckpointManifest]) -> tuple[list[BatchManifest], str]:
    """The source's manifests of the lineage's batches in the order its learner read them, and where they came
    from: its batches topic, else (retention dropped them) rebuilt from the shards in the object store in the
    order each checkpoint recorded (`read_order`)."""
    wanted = {b for m in lineage for b in [*m.batch_ids, *m.skipped_batches]}
    seen: dict[str, BatchManifest] = {}
    for message in read_topic(settings, Topics(ns).batches):
        try:
            manifest = codec.decode(message.value() or b"", expect=BatchManifest)
        except DecodeError:
            continue
        if manifest.batch_id in wanted:
            seen.setdefault(manifest.batch_id, manifest)
    missing = wanted - set(seen)
    if not missing:
        return list(seen.values()), Topics(ns).batches
    unordered = [m.version for m in lineage if m.version > 0 and not m.read_order and (m.batch_ids or m.skipped_batches)]
    if unordered:
        raise ConfigError(f"{len(missing)} batches of the lineage are no longer on {Topics(ns).batches} (e.g. "
                          f"{sorted(missing)[0]}), and v{unordered[0]} records no read order (written before "
                          "checkpoints did): it cannot be rebuilt from the shards")
    return [from_shard(store, ns, batch) for m in lineage for batch in m.read_order], "the shards in the object store"


def from_shard(store: ObjectStore, ns: str, batch: str) -> BatchManifest:
    """A batch's manifest made again from its shard, as the shard writer made it (its key follows from the
    batch id); a shard that is gone gives a manifest of a missing shard, which the learner skips as the
    source did."""
    (topic, partition), first, last = parse_batch_id(batch)
    key = shard_key(ns, topic, partition, first, last)
    try:
        data = store.get(key)
        return build_manifest(read_shard(data), key=key, sha256=sha256_hex(data), size=len(data),
                              bucket=store.bucket, topic=topic, partition=partition, first=first, last=last)
    except PipelineError:
        return BatchManifest(batch_id=batch, run=ns, bucket=store.bucket, key=key, sha256="", size=0,
                             num_trajectories=0, num_tokens=0, source_topic=topic, partition=partition,
                             first_offset=first, last_offset=last, policy_version_min=0, policy_version_max=0,
                             reward_mean=0.0, reward_std=0.0, trajectory_ids=(), ts=0)


def rescored_batches(settings: Settings, store: ObjectStore, ordered: list[BatchManifest], rescored: str,
                     to_ns: str) -> tuple[list[BatchManifest], int]:
    """The batches again, each of the same trajectories in the same order as scored in `rescored`, written as
    shards of `to_ns` under the same batch ids; and how many trajectories `rescored` did not score."""
    scored: dict[str, Trajectory] = {}
    for message in read_topic(settings, Topics(rescored).scored):
        try:
            trajectory = codec.decode(message.value() or b"", expect=Trajectory)
        except DecodeError:
            continue
        scored[trajectory.trajectory_id] = trajectory
    if not scored:
        raise ConfigError(f"{Topics(rescored).scored} is empty: re-score first (python -m consumers.replay "
                          f"--from-ns SRC --to-ns {rescored} --score REWARD)")
    made, left_out = [], 0
    for manifest in ordered:
        kept = [scored[i] for i in manifest.trajectory_ids if i in scored]
        left_out += len(manifest.trajectory_ids) - len(kept)
        if not kept or not manifest.sha256:  # nothing left, or a shard the source found missing: skipped there too
            made.append(replace(manifest, sha256="", size=0, num_trajectories=0, trajectory_ids=()))
            continue
        key = shard_key(to_ns, manifest.source_topic, manifest.partition, manifest.first_offset, manifest.last_offset)
        data = write_shard(kept, key)
        store.put_verified(key, data)
        made.append(build_manifest(kept, key=key, sha256=sha256_hex(data), size=len(data), bucket=store.bucket,
                                   topic=manifest.source_topic, partition=manifest.partition,
                                   first=manifest.first_offset, last=manifest.last_offset))
    return made, left_out


def rebuild(settings: Settings, from_ns: str, to_ns: str, until: Optional[int] = None,
            extra: Optional[list[str]] = None, cache_dir: Optional[str] = None,
            rescored: Optional[str] = None) -> dict[str, Any]:
    if from_ns == to_ns:
        raise ConfigError("--to-ns must be a new namespace")
    store = ObjectStore(settings)
    lineage = source_lineage(settings, store, from_ns, until)
    final = lineage[-1]
    args = recorded_args(store, final)
    ordered, origin = batches_in_read_order(settings, store, from_ns, lineage)
    left_out = 0
    if rescored:
        ordered, left_out = rescored_batches(settings, store, ordered, rescored, to_ns)
        origin += f", re-scored as in {rescored} ({left_out} trajectories it did not score left out)"
    target = Topics(to_ns)
    bootstrap(settings, to_ns, partitions=1)
    if any(e.run == to_ns for e in checkpoint_store.published(settings, target)):
        raise ConfigError(f"{to_ns} already has checkpoints: rebuild into a new namespace")
    publisher = Publisher(settings)
    for manifest in ordered:
        publisher.send(target.batches, None, codec.encode(manifest))
    publisher.close()
    print(f"rebuilding v0..v{final.version} of {from_ns} into {to_ns}: {len(ordered)} batches from {origin}, "
          f"{final.step} updates, learner {' '.join(args + (extra or []))}", file=sys.stderr, flush=True)
    command = [sys.executable, "-m", "learner", "--ns", to_ns, *args, *(extra or []), "--max-updates",
               str(final.step), "--idle-exit", "30", "--replica-of", from_ns]  # versions numbered as the source's
    if cache_dir:
        command += ["--cache-dir", cache_dir]
    done = subprocess.run(command, cwd=ROOT, env={**os.environ, **settings.as_env()}, check=False)
    if done.returncode != 0:
        raise PipelineError(f"the rebuilding learner exited {done.returncode}")
    return {"from": from_ns, "to": to_ns, "batches": len(ordered), "batches_from": origin, "updates": final.step,
            "what_if": bool(extra or rescored), "rescored": rescored, "left_out": left_out,
            "versions": compare(store, from_ns, to_ns, final.version)}


def compare(store: ObjectStore, a: str, b: str, final: int) -> dict[int, str]:
    """Per version: "identical", or the largest absolute difference of any weight."""
    from safetensors.torch import load

    out: dict[int, str] = {}
    for version in range(final + 1):
        try:
            ours = load(checkpoint_store.load_version(store, b, version).files[MODEL_FILE])
        except PipelineError as exc:
            out[version] = f"missing ({exc})"
            continue
        theirs = load(checkpoint_store.load_version(store, a, version).files[MODEL_FILE])
        if ours.keys() != theirs.keys():
            out[version] = "other tensors"
        elif all(ours[k].equal(theirs[k]) for k in ours):
            out[version] = "identical"
        else:
            out[version] = f"max |diff| {max(float((ours[k] - theirs[k]).abs().max()) for k in ours):.3g}"
    return out


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="python -m learner.rebuild", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_ns_argument(p, "--from-ns", help="the run whose checkpoints to rebuild")
    p.add_argument("--to-ns", required=True, help="a new namespace for the rebuilt lineage")
    p.add_argument("--until", type=int, default=None, help="the last version to rebuild (default: the newest)")
    p.add_argument("--cache-dir", default=None, help="the rebuilding learner's shard cache")
    p.add_argument("--rescored", default=None, metavar="NS2",
                   help="train the same batches with the rewards NS2 (the source re-scored) gave them")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(own)
    try:
        report = rebuild(Settings.from_env(), args.from_ns, args.to_ns, args.until, extra, args.cache_dir,
                         args.rescored)
    except PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report))
    else:
        for version, verdict in report["versions"].items():
            print(f"v{version}: {verdict}")
        if report["rescored"]:
            print(f"a new lineage with the rewards of {report['rescored']} ({report['left_out']} trajectories "
                  "left out): the batches are off-policy data for it")
        elif report["what_if"]:
            print(f"a new lineage with {' '.join(extra)}: the batches are off-policy data for it")
    same = all(v == "identical" for v in report["versions"].values())
    return 0 if same or report["what_if"] else 1


if __name__ == "__main__":
    sys.exit(main())
