"""Replays recorded rollout events into a new namespace, so derived views are rebuilt while the live run goes on.

    python -m consumers.replay --from-ns run1 --to-ns run1-r2                      # the whole log
    python -m consumers.replay --from-ns run1 --to-ns run1-day --since 2025-01-31T00:00Z --until 2025-02-01
    python -m consumers.replay --from-ns run1 --to-ns run1-p --from-offsets 0:100,1:80 --to-offsets 0:900,1:700
    python -m consumers.replay --from-ns run1 --to-ns run1-a --from-archive --domain math --policy-max 5
    python -m consumers.replay --from-ns run1 --to-ns run1-r2 --score default:2    # and re-score it

Then, by hand or through --score:
    python -m streams --ns run1-r2 --reward default:2     # re-score history without regenerating it
    python -m learner --ns run1-r2                        # retrain from history

Each event keeps its bytes, key, headers, timestamp and partition, so every episode stays in order in the
same partition. Episodes are copied whole: the window and the filters choose episodes by their first event
(consumers.selection says exactly how). The target is bootstrapped here and must differ from the source;
an offset a partition lacks in --from-offsets / --to-offsets means its beginning / its current end.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import Any, Callable, Optional, Protocol, Union

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from consumers.history import ArchiveHistory, KafkaHistory, kafka_bounds
from consumers.rescore import format_summary, parse_reward, rescore
from consumers.selection import EpisodeSelector, EventFilter, SelectionStats, Window, parse_offsets, parse_time
from infra.bootstrap import bootstrap, partition_count
from infra.kafka import Publisher, admin, end_offsets
from infra.objectstore import ObjectStore
from infra.settings import Settings, add_ns_argument
from schemas.archive import ArchivedEvent
from schemas.codec import codec
from schemas.errors import ConfigError, DecodeError, PipelineError
from schemas.records import RolloutEvent
from schemas.topics import Topics

History = Union[KafkaHistory, ArchiveHistory]
PROGRESS_EVERY = 2000


class Sink(Protocol):
    def send(self, rec: ArchivedEvent) -> None: ...
    def close(self) -> None: ...


class TopicSink:
    """Writes replayed records to the events topic of the target namespace."""

    def __init__(self, settings: Settings, topic: str) -> None:
        self.topic = topic
        self.publisher = Publisher(settings)

    def send(self, rec: ArchivedEvent) -> None:
        # Same partition, key, headers and record timestamp: the copy keeps the original's order and time index.
        self.publisher.send(self.topic, rec.key, rec.value, headers=list(rec.headers) or None,
                            partition=rec.partition, timestamp=rec.timestamp)

    def close(self) -> None:
        self.publisher.close()


def decode_event(value: bytes) -> Optional[RolloutEvent]:
    try:
        return codec.decode(value, RolloutEvent)  # type: ignore[no-any-return]
    except DecodeError:
        return None


def replay(history: History, selector: EpisodeSelector, sink: Sink,
           on_progress: Optional[Callable[[int], None]] = None) -> SelectionStats:
    """Copy what the selector admits, in each partition's order; stop a partition once nothing more is needed."""
    scanned = 0
    for rec in history.records():
        event = decode_event(rec.value) if selector.needs_decoding else None
        if selector.admit(rec, event):
            sink.send(rec)
        if selector.finished(rec.partition, rec.offset, rec.timestamp):
            history.stop(rec.partition)
        scanned += 1
        if on_progress is not None and scanned % PROGRESS_EVERY == 0:
            on_progress(scanned)
    sink.close()
    if on_progress is not None:
        on_progress(scanned)
    return selector.stats


class RateColumn(ProgressColumn):
    """Events per second, as rich measures the task's speed."""

    def render(self, task: Task) -> Text:
        return Text(f"{task.speed:,.0f} ev/s" if task.speed else "- ev/s", style="progress.data.speed")


def progress_bar(console: Console) -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), RateColumn(),
                    TextColumn("ETA"), TimeRemainingColumn(), console=console, transient=False)


def completed_of(bar: Progress, task: TaskID) -> float:
    return next(t.completed for t in bar.tasks if t.id == task)


def build_window(args: argparse.Namespace) -> Window:
    return Window(start=parse_offsets(args.from_offsets), end=parse_offsets(args.to_offsets),
                  since=parse_time(args.since), until=parse_time(args.until))


def build_filter(args: argparse.Namespace) -> EventFilter:
    return EventFilter(domains=frozenset(args.domain or ()), task_ids=frozenset(args.task_id or ()),
                       policy_min=args.policy_min, policy_max=args.policy_max)


def open_history(settings: Settings, args: argparse.Namespace, window: Window) -> tuple[History, int]:
    """The source and the number of partitions the target needs."""
    topic = Topics(args.from_ns).events
    history, partitions = _open(settings, args, window, topic)
    unknown = sorted(p for p in {*window.start, *window.end} if p >= partitions)
    if unknown:
        raise ConfigError(f"{topic} has no partition {unknown[0]} (it has {partitions})")
    return history, partitions


def _open(settings: Settings, args: argparse.Namespace, window: Window, topic: str) -> tuple[History, int]:
    if args.from_archive:
        history = ArchiveHistory(ObjectStore(settings), args.from_ns, topic, window)
        if not history.objects:
            raise ConfigError(f"no archive objects of {topic}; "
                              f"run `python -m consumers.archive --ns {args.from_ns} --once`")
        return history, max(history.partitions) + 1
    starts, ends = kafka_bounds(settings, topic, window)
    return KafkaHistory(settings, topic, starts, ends), partition_count(settings, topic)


def prepare_target(settings: Settings, from_ns: str, to_ns: str, partitions: int, append: bool) -> str:
    """Bootstrap the target namespace; refuse the source itself, too few partitions, or events already there."""
    if to_ns == from_ns:
        raise ConfigError(f"--to-ns must differ from --from-ns ({from_ns}): replay never writes into the live run")
    topic = Topics(to_ns, partitions).events
    if topic in admin(settings).list_topics(timeout=10).topics:
        have = partition_count(settings, topic)
        if have < partitions:
            raise ConfigError(f"{topic} has {have} partitions, the source {partitions}: choose a new --to-ns")
        if not append and any(hi > lo for lo, hi in end_offsets(settings, topic).values()):
            raise ConfigError(f"{topic} already holds events: choose a new --to-ns (or pass --append)")
    bootstrap(settings, to_ns, partitions)
    return topic


def run(settings: Settings, args: argparse.Namespace, console: Console) -> dict[str, Any]:
    window, event_filter = build_window(args), build_filter(args)
    history, partitions = open_history(settings, args, window)
    target = prepare_target(settings, args.from_ns, args.to_ns, partitions, args.append)
    selector = EpisodeSelector(window, event_filter)
    with progress_bar(console) as bar:
        task = bar.add_task(f"replay {args.from_ns} -> {args.to_ns}", total=history.total or None,
                            visible=not args.no_progress)
        stats = replay(history, selector, TopicSink(settings, target),
                       lambda n: bar.update(task, completed=n, total=max(n, history.total)))
        # Whole-episode selection stops a partition early, so what was read is the true total.
        bar.update(task, total=completed_of(bar, task))
    return {"from_ns": args.from_ns, "to_ns": args.to_ns, "source": "archive" if args.from_archive else "kafka",
            "target_topic": target, **asdict(stats)}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m consumers.replay", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_ns_argument(p, "--from-ns", help="namespace whose rollout events are replayed")
    p.add_argument("--to-ns", required=True, help="new namespace to write them into (bootstrapped here)")
    p.add_argument("--from-offsets", help="first offset per partition, e.g. 0:100,1:80")
    p.add_argument("--to-offsets", help="end offset (exclusive) per partition, e.g. 0:900,1:700")
    p.add_argument("--since", help="record time from (inclusive): ISO 8601 or ms since the epoch")
    p.add_argument("--until", help="record time to (exclusive): ISO 8601 or ms since the epoch")
    p.add_argument("--from-archive", action="store_true", help="read the archived objects instead of the topic")
    p.add_argument("--domain", action="append", help="keep episodes of this domain (repeatable)")
    p.add_argument("--task-id", action="append", help="keep episodes of this task (repeatable)")
    p.add_argument("--policy-min", type=int, help="keep episodes started with policy version >= this")
    p.add_argument("--policy-max", type=int, help="keep episodes started with policy version <= this")
    p.add_argument("--append", action="store_true", help="allow a target whose events topic is not empty")
    p.add_argument("--score", metavar="REWARD", help="then run `python -m streams --ns TO --reward REWARD` until "
                   "the scored output settles, and summarise it against the source")
    p.add_argument("--settle", type=float, default=15.0, help="seconds without new scored output that mean done")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = p.parse_args(argv)
    if args.score:
        parse_reward(args.score)
    return args


def main(argv: Optional[list[str]] = None) -> int:
    console = Console(stderr=True)
    try:
        args = parse_args(argv)
        settings = Settings.from_env()
        summary = run(settings, args, console)
        if args.score:
            scored = rescore(settings, args.to_ns, args.score, compare_ns=args.from_ns, settle_s=args.settle)
            summary["scored"] = asdict(scored)
            console.print(format_summary(scored, args.from_ns))
    except PipelineError as exc:
        console.print(f"[red]replay: {exc}")
        return 1
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    else:
        console.print(summary)
        console.print(f"next: python -m streams --ns {args.to_ns} --reward default:2   |   "
                      f"python -m learner --ns {args.to_ns}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
