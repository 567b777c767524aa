"""`python -m streams --ns NAME [--reward default:1] ...`: run the streams worker until SIGTERM or Ctrl-C."""
from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
import signal
import sys
import time
from typing import Any, Optional

from infra import faults
from infra.bootstrap import partition_count
from infra.kafka import end_offsets, group_assignment
from infra.settings import Settings
from schemas.errors import ConfigError, InfraError, PipelineError
from schemas.topics import STREAM_TABLES, Topics
from streams.app import build_app
from streams.scoring import Scorer
from streams.settings import StreamSettings

log = logging.getLogger("streams")


def with_partitions(settings: StreamSettings, platform: Settings) -> StreamSettings:
    """Settings whose partition count is the one the namespace was bootstrapped with; refuse a mismatch."""
    topics = Topics(settings.ns)
    try:
        found = partition_count(platform, topics.events)
    except InfraError as exc:
        raise ConfigError(f"{exc} (e.g. `python -m infra bootstrap --ns {settings.ns} --partitions 4`)") from exc
    if settings.partitions is not None and settings.partitions != found:
        raise ConfigError(f"--partitions {settings.partitions} but {topics.events} has {found}: "
                          f"pass --partitions {found} (or omit it)")
    for name in (topics.trajectories, *(topics.changelog(t) for t in STREAM_TABLES)):
        n = partition_count(platform, name)
        if n != found:
            raise ConfigError(f"{name} has {n} partitions, {topics.events} has {found}: a table's changelog must "
                              "match its source; re-bootstrap the namespace with one --partitions")
    return dataclasses.replace(settings, partitions=found)


def tune_gc() -> None:
    """Collect garbage less often: the tables keep many long-lived objects, and with the default thresholds
    the collector walks them every few hundred allocations (a quarter of the worker's CPU, measured)."""
    gc.freeze()  # what is loaded at start is never garbage
    gc.set_threshold(50_000, 20, 100)


def main(argv: Optional[list[str]] = None) -> int:
    try:
        settings = StreamSettings.from_args(argv)
        scorer = Scorer.load(settings.reward_fn, settings.reward_version)
        platform = Settings.from_env()
        settings = with_partitions(settings, platform)
    except PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    app = build_app(settings, platform, scorer=scorer)
    # stopped as by SIGTERM, from the worker's own loop: an agent cannot stop the app it runs in
    app.stop_worker = lambda: os.kill(os.getpid(), signal.SIGTERM)
    add_watchdogs(app, settings, platform, argv)
    tune_gc()
    worker = app.Worker(loglevel=settings.log_level, logfile=None, quiet=True)
    try:
        worker.execute_from_commandline()  # handles SIGTERM/SIGINT: stops the agents, flushes, commits
    except SystemExit as exc:  # mode always ends the worker this way
        code = exc.code if isinstance(exc.code, int) else 1
    else:
        code = worker.exit_code or 0
    if app.failure is not None:  # a batch failed and stopped the worker (see streams.app)
        code = code or 1
    if code != 0:  # a stop by SIGTERM/SIGINT exits 0: only failures restart
        restart(argv)  # the worker state lives in changelogs and committed offsets: a fresh process resumes
    return code


MAX_RESTARTS = 100
WATCH_EVERY_S = 5.0


def add_watchdogs(app: Any, settings: StreamSettings, platform: Settings, argv: Optional[list[str]]) -> None:
    """Restart (a fresh process, resuming from the changelogs and committed offsets) when the worker is stuck:

    - it holds no partition for --unassigned-restart-s while some partition has no worker either: after a
      broker restart the client can rejoin while the broker still reports the topics missing, and then
      waits forever (a spare worker, with every partition held by others, idles instead);
    - records wait on a partition it holds, and for --stall-restart-s it neither read nor committed
      anything (a client wedged after a broker restart, a rebalance or recovery that never ends).
    """
    # Reads Faust's Consumer._read_offset and _committed_offset (private, faust-streaming 0.15.3):
    # test_streams.py::test_a_wedged_worker_notices_it_and_restarts_within_the_stall_limit fails if renamed.
    topics = Topics(settings.ns, settings.partitions or 1)
    inputs = {topics.events, topics.trajectories}
    unassigned: list[float] = []
    last: dict[str, Any] = {"progress": None, "since": time.monotonic()}

    @app.timer(interval=WATCH_EVERY_S)
    async def watchdog() -> None:
        consumer = app.consumer
        assigned = set(consumer.assignment())
        now = time.monotonic()
        if assigned:
            unassigned.clear()
        elif not unassigned:
            unassigned.append(now)
        elif now - unassigned[0] > settings.unassigned_restart_s:
            others = await asyncio.get_running_loop().run_in_executor(
                None, held_by_others, platform, topics.streams_app_id, topics.events, topics.partitions)
            if others:  # more workers than partitions: a spare one waits for a rebalance that needs it
                if len(unassigned) == 1:
                    log.info("every partition is held by another worker; this one idles until a rebalance")
                    unassigned.append(now)
                return
            give_up(argv, f"no partition assigned for {now - unassigned[0]:.0f} s")
        progress = (frozenset(assigned), tuple(sorted((str(tp), consumer._read_offset.get(tp)) for tp in assigned)),
                    tuple(sorted((str(tp), consumer._committed_offset.get(tp)) for tp in assigned)))
        if progress != last["progress"]:
            last.update(progress=progress, since=now)
            return
        if now - last["since"] < settings.stall_restart_s:
            return
        held = [tp for tp in assigned if tp.topic in inputs]
        waiting = await asyncio.get_running_loop().run_in_executor(
            None, records_waiting, platform, held, {tp: consumer._committed_offset.get(tp) for tp in held})
        if waiting:
            give_up(argv, f"no progress for {now - last['since']:.0f} s with {sum(waiting.values())} records "
                          f"waiting on {', '.join(sorted(waiting))}")
        last["since"] = now  # idle, not stuck: nothing to read


def held_by_others(platform: Settings, group: str, topic: str, partitions: int) -> bool:
    """Whether the other members of the group hold every partition of `topic` (False if it cannot be told)."""
    try:
        held = group_assignment(platform, group, topic)
    except Exception as exc:  # the broker is away: the restart rule applies as before
        print(f"watchdog: no assignment of group {group} ({exc})", file=sys.stderr, flush=True)
        return False
    return set().union(*held.values(), set()) >= set(range(partitions))


def records_waiting(platform: Settings, held: list[Any], committed: dict[Any, Optional[int]]) -> dict[str, int]:
    """Records past the committed offset on each held input partition (a conservative count: >= 2 only)."""
    waiting: dict[str, int] = {}
    for topic in {tp.topic for tp in held}:
        try:
            ends = end_offsets(platform, topic)
        except Exception as exc:  # the broker is away: not this worker's stall
            print(f"stall check: no end offsets of {topic} ({exc})", file=sys.stderr, flush=True)
            continue
        for tp in (tp for tp in held if tp.topic == topic):
            low, high = ends.get(tp.partition, (0, 0))
            done = committed.get(tp)
            behind = high - (low if done is None else done + 1)
            if behind >= 2:
                waiting[f"{topic}:{tp.partition}"] = behind
    return waiting


def give_up(argv: Optional[list[str]], why: str) -> None:
    print(f"streams worker stuck: {why}", file=sys.stderr, flush=True)
    logging.getLogger("streams").error("stuck: %s; restarting", why)
    restart(argv)


def restart(argv: Optional[list[str]]) -> None:
    """Start over in a fresh process after a failure (e.g. the broker went away while the worker started),
    as a supervisor would, instead of leaving a hole in the pipeline; bounded so a bug cannot loop forever."""
    count = int(os.environ.get("TRAJPIPE_STREAMS_RESTARTS", "0")) + 1
    if count > MAX_RESTARTS:
        print(f"error: the streams worker failed {MAX_RESTARTS} times in a row; giving up", file=sys.stderr)
        return
    print(f"streams worker failed; restarting (attempt {count}) in 3 s", file=sys.stderr, flush=True)
    time.sleep(3)
    os.environ["TRAJPIPE_STREAMS_RESTARTS"] = str(count)
    os.environ.pop(faults.ENV_VAR, None)  # an injected fault fires once, not in every restarted process
    os.execv(sys.executable, [sys.executable, "-m", "streams", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
