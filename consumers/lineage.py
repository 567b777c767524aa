"""Where a trajectory came from and where it went: source events, policy versions, reward, batch, checkpoint.

    python -m consumers.lineage --ns NS TRAJECTORY_ID          # readable
    python -m consumers.lineage --ns NS TRAJECTORY_ID --json   # one JSON document

The trajectory is found through the batch manifests (each names the trajectory ids of its batch and the few
offsets of the scored topic they cover, and its shard in the object store), so a query reads the small batches
topic and a batch's range, never a whole trajectory topic; only a trajectory no batch carries yet is searched
for on both trajectory topics. Source events are read at their offsets from the topic the trajectory names, or
from the archive when retention removed them.
Checkpoints come from <ns>.policy.checkpoints (one announcement per version), else from the checkpoint manifests
in the object store. Each manifest records the trajectories of its batches that did not train and why (stale,
untrainable, a skipped batch): lineage says "trained into vN" only for the others.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from rich.console import Console
from rich.markup import escape

from consumers.history import ArchiveHistory, KafkaHistory
from consumers.shards import read_shard
from infra.kafka import admin, end_offsets, read_topic
from infra.objectstore import ObjectStore
from infra.settings import Settings, add_ns_argument
from schemas.archive import ArchivedEvent
from schemas.codec import codec
from schemas.errors import DecodeError, ManifestError, PipelineError
from schemas.keys import checkpoint_prefix
from schemas.manifests import CheckpointManifest
from schemas.records import (
    BatchManifest,
    CheckpointPublished,
    EpisodeEnded,
    EpisodeStarted,
    PolicyTurn,
    RolloutEvent,
    SandboxResult,
    Trajectory,
)
from schemas.topics import Topics

EVENTS_SUFFIX = ".rollout.events"


@dataclass
class Lineage:
    trajectory_id: str
    found_on: dict[str, Any] = field(default_factory=dict)
    trajectory: dict[str, Any] = field(default_factory=dict)
    policy_versions: list[int] = field(default_factory=list)
    reward: dict[str, Any] = field(default_factory=dict)
    source_events: list[dict[str, Any]] = field(default_factory=list)
    missing_source_offsets: list[str] = field(default_factory=list)
    batches: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)


def find_trajectory(settings: Settings, topics: Topics) -> Iterable[tuple[str, int, int, Trajectory]]:
    """Every trajectory on the scored topic, then on the unscored one, with where it was found."""
    for topic in (topics.scored, topics.trajectories):
        for msg in read_topic(settings, topic):
            try:
                yield topic, msg.partition() or 0, msg.offset() or 0, codec.decode(msg.value() or b"", Trajectory)
            except DecodeError:
                continue


Located = tuple[str, int, int, Trajectory]  # topic (or object key), partition, offset, the record


def in_batch(settings: Settings, store: ObjectStore, batch: BatchManifest, trajectory_id: str) -> Optional[Located]:
    """The trajectory in the scored-topic range its batch covers, else in the batch's shard (retention)."""
    found = None
    marks = end_offsets(settings, batch.source_topic).get(batch.partition, (0, 0))
    start, end = max(batch.first_offset, marks[0]), min(batch.last_offset + 1, marks[1])
    for record in KafkaHistory(settings, batch.source_topic, {batch.partition: start}, {batch.partition: end}).records():
        try:
            trajectory = codec.decode(record.value, Trajectory)
        except DecodeError:
            continue
        if trajectory.trajectory_id == trajectory_id:
            found = (batch.source_topic, record.partition, record.offset, trajectory)
    if found is None:
        try:
            shard = read_shard(store.get(batch.key, sha256=batch.sha256))
        except PipelineError:
            return None
        for trajectory in shard:
            if trajectory.trajectory_id == trajectory_id:
                found = (f"s3://{batch.bucket}/{batch.key}", batch.partition, -1, trajectory)
    return found


def locate(settings: Settings, topics: Topics, trajectory_id: str, batches: Iterable[BatchManifest] = (),
           store: Optional[ObjectStore] = None) -> Optional[Located]:
    """Where a batch carrying it says it is; else (no batch yet) the last copy on the first trajectory topic
    that has it (at-least-once may repeat a record)."""
    for batch in batches:
        where = in_batch(settings, store or ObjectStore(settings), batch, trajectory_id)
        if where is not None:
            return where
    found = None
    for where in find_trajectory(settings, topics):
        if where[3].trajectory_id == trajectory_id:
            found = where
        elif found is not None and where[0] != found[0]:
            break
    return found


def describe(event: RolloutEvent) -> str:
    body = event.body
    if isinstance(body, EpisodeStarted):
        return f"prompt of {len(body.prompt_text)} chars, group of {body.group_size}, up to {body.max_turns} turns"
    if isinstance(body, PolicyTurn):
        return f"turn {body.turn}: {len(body.tokens) // 4} tokens, finish {body.finish_reason}"
    if isinstance(body, SandboxResult):
        return (f"turn {body.turn}: {body.outcome} {body.tests_passed}/{body.tests_total} tests "
                f"in {body.duration_ms} ms ({body.backend})")
    if isinstance(body, EpisodeEnded):
        return f"{body.status} after {body.num_turns} turns" + (f": {body.detail}" if body.detail else "")
    return type(body).__name__


def event_summary(rec: ArchivedEvent, origin: str) -> dict[str, Any]:
    out: dict[str, Any] = {"topic": rec.topic, "partition": rec.partition, "offset": rec.offset,
                           "timestamp": rec.timestamp, "from": origin}
    try:
        event = codec.decode(rec.value, RolloutEvent)
    except DecodeError as exc:
        return {**out, "type": "undecodable", "summary": str(exc)}
    return {**out, "type": type(event.body).__name__, "event_id": event.event_id, "seq": event.seq,
            "policy_version": event.policy_version, "ts": event.ts, "summary": describe(event)}


def wanted_by_partition(trajectory: Trajectory) -> dict[int, set[int]]:
    wanted: dict[int, set[int]] = {}
    for pos in trajectory.source_offsets:
        wanted.setdefault(pos.partition, set()).add(pos.offset)
    return wanted


def from_topic(settings: Settings, topic: str, wanted: dict[int, set[int]]) -> dict[tuple[int, int], ArchivedEvent]:
    if topic not in admin(settings).list_topics(timeout=10).topics:
        return {}
    marks = end_offsets(settings, topic)
    starts = {p: max(min(offs), marks[p][0]) for p, offs in wanted.items() if p in marks}
    ends = {p: min(max(offs) + 1, marks[p][1]) for p, offs in wanted.items() if p in marks}
    history = KafkaHistory(settings, topic, starts, ends)
    return {(r.partition, r.offset): r for r in history.records() if r.offset in wanted[r.partition]}


def from_archive(store: ObjectStore, topic: str, wanted: dict[int, set[int]]) -> dict[tuple[int, int], ArchivedEvent]:
    ns = topic.removesuffix(EVENTS_SUFFIX)
    history = ArchiveHistory(store, ns, topic)
    history.objects = [o for o in history.objects
                       if any(o.first <= off <= o.last for off in wanted.get(o.partition, ()))]
    return {(r.partition, r.offset): r for r in history.records() if r.offset in wanted.get(r.partition, ())}


def source_events(settings: Settings, store: ObjectStore,
                  trajectory: Trajectory) -> tuple[list[dict[str, Any]], list[str]]:
    """Summaries of the trajectory's source events in offset order, and the positions found nowhere."""
    wanted = wanted_by_partition(trajectory)
    found = {k: (r, "topic") for k, r in from_topic(settings, trajectory.source_topic, wanted).items()}
    left = {p: {o for o in offs if (p, o) not in found} for p, offs in wanted.items()}
    if any(left.values()) and trajectory.source_topic.endswith(EVENTS_SUFFIX):
        found.update({k: (r, "archive") for k, r in from_archive(store, trajectory.source_topic, left).items()})
    positions = sorted((p, o) for p, offs in wanted.items() for o in offs)
    events = [event_summary(*found[pos]) for pos in positions if pos in found]
    missing = [f"{p}:{o}" for p, o in positions if (p, o) not in found]
    return events, missing


def carrying_batches(settings: Settings, topics: Topics, trajectory_id: str) -> list[BatchManifest]:
    out: list[BatchManifest] = []
    for msg in read_topic(settings, topics.batches):
        try:
            manifest = codec.decode(msg.value() or b"", BatchManifest)
        except DecodeError:
            continue
        if trajectory_id in manifest.trajectory_ids and manifest.batch_id not in {b.batch_id for b in out}:
            out.append(manifest)
    return out


def announced_checkpoints(settings: Settings, topics: Topics, batch_ids: set[str]) -> list[dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for msg in read_topic(settings, topics.checkpoints):
        try:
            ckpt = codec.decode(msg.value() or b"", CheckpointPublished)
        except DecodeError:
            continue
        if batch_ids & set(ckpt.batch_ids):
            out[ckpt.version] = {"version": ckpt.version, "step": ckpt.step, "run": ckpt.run,
                                 "algorithm": ckpt.algorithm, "prefix": ckpt.prefix,
                                 "manifest_key": ckpt.manifest_key, "ts": ckpt.ts, "from": "topic",
                                 "batch_ids": sorted(batch_ids & set(ckpt.batch_ids))}
    return [out[v] for v in sorted(out)]


def stored_checkpoints(store: ObjectStore, ns: str, batch_ids: set[str]) -> list[dict[str, Any]]:
    """Checkpoint manifests under checkpoints/<ns>/ that list one of `batch_ids`."""
    prefix = checkpoint_prefix(ns, 0).rsplit("v0/", 1)[0]
    out = []
    for key in store.list(prefix):
        if not key.endswith(".json"):
            continue
        try:
            manifest = CheckpointManifest.from_json(store.get(key))
        except ManifestError:
            continue  # config.json and other files beside the weights
        if batch_ids & set(manifest.batch_ids):
            out.append({"version": manifest.version, "step": manifest.step, "run": manifest.run,
                        "algorithm": manifest.algorithm, "manifest_key": key, "from": "object store",
                        "batch_ids": sorted(batch_ids & set(manifest.batch_ids))})
    return sorted(out, key=lambda c: c["version"])


def trajectory_fields(t: Trajectory) -> dict[str, Any]:
    return {"episode_id": t.episode_id, "group_id": t.group_id, "task_id": t.task_id, "domain": t.domain,
            "run": t.run, "status": t.status, "turns": len(t.turns), "started_ts": t.started_ts,
            "ended_ts": t.ended_ts, "source_topic": t.source_topic}


def reward_fields(t: Trajectory) -> dict[str, Any]:
    return {"reward": t.reward, "reward_fn": t.reward_fn, "reward_version": t.reward_version,
            "components": dict(sorted(t.reward_components.items())), "advantage": t.advantage,
            "group_reward_mean": t.group_reward_mean, "group_reward_std": t.group_reward_std}


def trace(settings: Settings, ns: str, trajectory_id: str, store: Optional[ObjectStore] = None) -> Optional[Lineage]:
    """The lineage of one trajectory, or None when neither trajectory topic holds it."""
    topics = Topics(ns)
    store = store or ObjectStore(settings)
    batches = carrying_batches(settings, topics, trajectory_id)
    where = locate(settings, topics, trajectory_id, batches, store)
    if where is None:
        return None
    topic, partition, offset, traj = where
    lineage = Lineage(trajectory_id, {"topic": topic, "partition": partition, "offset": offset},
                      trajectory_fields(traj), sorted({t.policy_version for t in traj.turns}), reward_fields(traj))
    lineage.source_events, lineage.missing_source_offsets = source_events(settings, store, traj)
    lineage.batches = [{"batch_id": b.batch_id, "key": b.key, "sha256": b.sha256,
                        "num_trajectories": b.num_trajectories, "first_offset": b.first_offset,
                        "last_offset": b.last_offset, "ts": b.ts} for b in batches]
    batch_ids = {b.batch_id for b in batches}
    if batch_ids:
        lineage.checkpoints = (announced_checkpoints(settings, topics, batch_ids)
                               or stored_checkpoints(store, ns, batch_ids))
    for checkpoint in lineage.checkpoints:
        checkpoint["not_trained"] = not_trained_because(store, checkpoint, trajectory_id)
    return lineage


def not_trained_because(store: ObjectStore, checkpoint: dict[str, Any], trajectory_id: str) -> Optional[str]:
    """Why the trajectory did not train into this checkpoint though its batch is listed; None when it trained
    (or the manifest is not readable: then the batch's listing is all there is to go by)."""
    try:
        manifest = CheckpointManifest.from_json(store.get(checkpoint["manifest_key"]))
    except PipelineError:
        return None
    return manifest.untrained.get(trajectory_id)


def render(lineage: Lineage, console: Console) -> None:
    t, r = lineage.trajectory, lineage.reward
    where = lineage.found_on
    console.print(f"[bold]{lineage.trajectory_id}[/] " + (f"on {where['topic']} p{where['partition']}@{where['offset']}"
                                                          if where["offset"] >= 0 else f"in shard {where['topic']}"))
    console.print(escape(f"  episode {t['episode_id']}  group {t['group_id']}  task {t['task_id']} ({t['domain']})  "
                         f"status {t['status']}  {t['turns']} turns"))
    console.print(f"  policy versions {lineage.policy_versions}")
    console.print(f"  reward {r['reward']:.4f} by {r['reward_fn']} v{r['reward_version']}  "
                  f"advantage {r['advantage']:+.4f}")
    for name, value in r["components"].items():
        console.print(f"    {name} = {value:.4f}")
    console.print(f"  source events ({t['source_topic']}):")
    for e in lineage.source_events:
        console.print(f"    p{e['partition']}@{e['offset']} ({e['from']}) {e['type']}  {escape(e['summary'])}")
    if lineage.missing_source_offsets:
        console.print(f"    [red]not found (topic nor archive): {', '.join(lineage.missing_source_offsets)}")
    console.print("  batches: " + (", ".join(b["batch_id"] for b in lineage.batches) or "none yet"))
    console.print("  checkpoints: " + (", ".join(
        f"v{c['version']} (step {c['step']}, {c['from']})" + (f": NOT trained ({c['not_trained']})"
                                                              if c.get("not_trained") else ": trained")
        for c in lineage.checkpoints) or "none yet"))


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m consumers.lineage", description=__doc__.splitlines()[0])
    add_ns_argument(p)
    p.add_argument("trajectory_id")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    console = Console()
    try:
        lineage = trace(Settings.from_env(), args.ns, args.trajectory_id)
    except PipelineError as exc:
        console.print(f"[red]lineage: {exc}")
        return 1
    if lineage is None:
        topics = Topics(args.ns)
        print(f"lineage: {args.trajectory_id} is on neither {topics.scored} nor {topics.trajectories}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(lineage.__dict__, indent=1, sort_keys=True))
    else:
        render(lineage, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
