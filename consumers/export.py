"""Exports trajectories as TRL training data: SFT rows (prompt-completion or messages) and DPO preference rows.

    python -m consumers.export --ns run1 --format sft --out sft.jsonl [--min-reward 1.0] [--style messages]
    python -m consumers.export --ns run1 --format dpo --out dpo.parquet [--min-margin 0.0] [--source shards]

Formats, as TRL's SFTTrainer and DPOTrainer read them:
    sft, style completion  {"prompt": text, "completion": text}
    sft, style messages    {"messages": [{"role": "user", ...}, {"role": "assistant", ...}, ...]}
    dpo, style completion  {"prompt": text, "chosen": text, "rejected": text}
    dpo, style messages    {"prompt": [user message], "chosen": [messages], "rejected": [messages]}

Only trainable trajectories (status completed or truncated, not marked status/not_trainable) are exported.
SFT keeps the successful ones (reward >= --min-reward) and, in completion style, trains on the last turn only:
the prompt is everything the policy saw before it (earlier attempts and sandbox feedback included), because the
earlier turns of a multi-turn episode are the failed attempts. DPO pairs the best and the worst trajectory of
each group (ties broken by trajectory id, groups whose rewards differ by no more than --min-margin skipped).
Trajectories come from <ns>.trajectories.scored, or from the shards the batch manifests name (--source shards).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

from consumers.shards import read_shard
from infra.kafka import read_topic
from infra.objectstore import ObjectStore
from infra.settings import Settings, add_ns_argument
from schemas.codec import codec
from schemas.errors import ConfigError, DecodeError, PipelineError
from schemas.records import BatchManifest, Trajectory
from schemas.topics import Topics

TRAINABLE_STATUSES = ("completed", "truncated")
NOT_TRAINABLE = "status/not_trainable"
STYLES = ("completion", "messages")
Row = dict[str, Any]
Message = dict[str, str]


def trainable(t: Trajectory) -> bool:
    return t.status in TRAINABLE_STATUSES and bool(t.turns) and not t.reward_components.get(NOT_TRAINABLE, 0.0)


def context_before_last(t: Trajectory) -> str:
    """What the policy had read when it generated the last turn."""
    return t.prompt_text + "".join(turn.obs_text + turn.text for turn in t.turns[:-1]) + t.turns[-1].obs_text


def continuation(t: Trajectory) -> str:
    """Everything after the prompt: generations and the sandbox feedback between them."""
    return "".join(turn.obs_text + turn.text for turn in t.turns)


def conversation(t: Trajectory) -> list[Message]:
    """The turns as chat messages: sandbox feedback as the user, generations as the assistant."""
    out: list[Message] = []
    for turn in t.turns:
        if turn.obs_text:
            out.append({"role": "user", "content": turn.obs_text})
        out.append({"role": "assistant", "content": turn.text})
    return out


def prompt_message(t: Trajectory) -> list[Message]:
    return [{"role": "user", "content": t.prompt_text}]


def sft_row(t: Trajectory, style: str = "completion", meta: bool = False) -> Row:
    if style == "messages":
        row: Row = {"messages": prompt_message(t) + conversation(t)}
    else:
        row = {"prompt": context_before_last(t), "completion": t.turns[-1].text}
    return {**row, **_meta(t)} if meta else row


def dpo_row(chosen: Trajectory, rejected: Trajectory, style: str = "completion", meta: bool = False) -> Row:
    if style == "messages":
        row: Row = {"prompt": prompt_message(chosen), "chosen": conversation(chosen),
                    "rejected": conversation(rejected)}
    else:
        row = {"prompt": chosen.prompt_text, "chosen": continuation(chosen), "rejected": continuation(rejected)}
    if meta:
        row.update({"group_id": chosen.group_id, "chosen_id": chosen.trajectory_id,
                    "rejected_id": rejected.trajectory_id, "margin": chosen.reward - rejected.reward})
    return row


def _meta(t: Trajectory) -> Row:
    return {"trajectory_id": t.trajectory_id, "reward": t.reward, "domain": t.domain, "task_id": t.task_id}


@dataclass
class ExportStats:
    read: int = 0
    untrainable: int = 0
    below_threshold: int = 0
    groups_skipped: int = 0
    rows: int = 0


def sft_rows(trajectories: Iterable[Trajectory], min_reward: float, style: str = "completion",
             meta: bool = False, stats: Optional[ExportStats] = None) -> list[Row]:
    stats = stats if stats is not None else ExportStats()
    rows = []
    for t in trajectories:
        stats.read += 1
        if not trainable(t):
            stats.untrainable += 1
        elif t.reward < min_reward:
            stats.below_threshold += 1
        else:
            rows.append(sft_row(t, style, meta))
    stats.rows = len(rows)
    return rows


def best_vs_worst(group: list[Trajectory], min_margin: float) -> Optional[tuple[Trajectory, Trajectory]]:
    # Sorting by id too makes the choice among equal rewards independent of arrival order (replays agree).
    ranked = sorted(group, key=lambda t: (t.reward, t.trajectory_id))
    worst, best = ranked[0], ranked[-1]
    if len(group) < 2 or best.reward - worst.reward <= min_margin:
        return None
    return best, worst


def dpo_rows(trajectories: Iterable[Trajectory], min_margin: float = 0.0, style: str = "completion",
             meta: bool = False, stats: Optional[ExportStats] = None) -> list[Row]:
    stats = stats if stats is not None else ExportStats()
    groups: dict[str, list[Trajectory]] = {}
    for t in trajectories:
        stats.read += 1
        if trainable(t):
            groups.setdefault(t.group_id, []).append(t)
        else:
            stats.untrainable += 1
    rows = []
    for group_id in sorted(groups):
        pair = best_vs_worst(groups[group_id], min_margin)
        if pair is None:
            stats.groups_skipped += 1
        else:
            rows.append(dpo_row(*pair, style=style, meta=meta))
    stats.rows = len(rows)
    return rows


def latest_by_id(trajectories: Iterable[Trajectory]) -> list[Trajectory]:
    """One copy per trajectory id (the last), in first-seen order: redeliveries are not exported twice."""
    out: dict[str, Trajectory] = {}
    for t in trajectories:
        out[t.trajectory_id] = t
    return list(out.values())


def from_scored(settings: Settings, ns: str) -> Iterable[Trajectory]:
    for msg in read_topic(settings, Topics(ns).scored):
        try:
            yield codec.decode(msg.value() or b"", Trajectory)
        except DecodeError:
            continue


def from_shards(settings: Settings, ns: str, store: Optional[ObjectStore] = None) -> Iterable[Trajectory]:
    store = store or ObjectStore(settings)
    for msg in read_topic(settings, Topics(ns).batches):
        manifest = codec.decode(msg.value() or b"", BatchManifest)
        bucket_store = store if manifest.bucket == store.bucket else ObjectStore(settings, bucket=manifest.bucket)
        yield from read_shard(bucket_store.get(manifest.key, sha256=manifest.sha256))


def write_rows(rows: list[Row], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".jsonl":
        with open(out, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    elif out.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), out)
    else:
        raise ConfigError(f"--out {out}: name a .jsonl or .parquet file")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m consumers.export", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_ns_argument(p)
    p.add_argument("--format", choices=("sft", "dpo"), required=True)
    p.add_argument("--out", type=Path, required=True, help="FILE.jsonl or FILE.parquet")
    p.add_argument("--style", choices=STYLES, default="completion", help="plain text or chat messages")
    p.add_argument("--source", choices=("scored", "shards"), default="scored")
    p.add_argument("--min-reward", type=float, default=1.0, help="SFT: reward a trajectory needs to count as a success")
    p.add_argument("--min-margin", type=float, default=0.0, help="DPO: chosen must beat rejected by more than this")
    p.add_argument("--with-meta", action="store_true", help="add ids, rewards and margins as extra columns")
    args = p.parse_args(argv)
    if args.out.suffix not in (".jsonl", ".parquet"):
        p.error(f"--out {args.out}: name a .jsonl or .parquet file")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    try:
        settings = Settings.from_env()
        source = from_shards(settings, args.ns) if args.source == "shards" else from_scored(settings, args.ns)
        trajectories = latest_by_id(source)
        stats = ExportStats()
        if args.format == "sft":
            rows = sft_rows(trajectories, args.min_reward, args.style, args.with_meta, stats)
        else:
            rows = dpo_rows(trajectories, args.min_margin, args.style, args.with_meta, stats)
        write_rows(rows, args.out)
    except PipelineError as exc:
        print(f"export: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"out": str(args.out), "format": args.format, "style": args.style, **stats.__dict__}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
