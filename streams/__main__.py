"""`python -m streams --ns NAME [--reward default:1] ...`: run the streams worker until SIGTERM or Ctrl-C."""
from __future__ import annotations

import dataclasses
import gc
import os
import signal
import sys
import time
from typing import Any, Optional

from infra.bootstrap import partition_count
from infra.settings import Settings
from schemas.errors import ConfigError, InfraError, PipelineError
from schemas.topics import STREAM_TABLES, Topics
from streams.app import build_app
from streams.scoring import Scorer
from streams.settings import StreamSettings


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
    add_watchdog(app, argv)
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
UNASSIGNED_LIMIT_S = 30.0


def add_watchdog(app: Any, argv: Optional[list[str]]) -> None:
    """Restart when the consumer holds no partition for UNASSIGNED_LIMIT_S: after a broker restart the
    client can rejoin while the broker still reports the topics missing, and then waits forever."""
    since: list[float] = []

    @app.timer(interval=5.0)
    async def watchdog() -> None:
        if app.consumer.assignment():
            since.clear()
        elif not since:
            since.append(time.monotonic())
        elif time.monotonic() - since[0] > UNASSIGNED_LIMIT_S:
            print(f"no partition assigned for {UNASSIGNED_LIMIT_S:.0f}s", file=sys.stderr, flush=True)
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
    os.execv(sys.executable, [sys.executable, "-m", "streams", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
