"""The Faust app: two agents (events -> trajectories, trajectories -> scored), four tables, two timers.

    app = build_app(settings, platform)      # settings.partitions must be known (see __main__)
    app.pipeline                             # the stages the agents and timers call
    app.Worker(loglevel="info").execute_from_commandline()   # what `python -m streams --ns NAME` runs

Agents are thin loops over `streams.pipeline`; each keeps concurrency=1 so offsets commit in order.
Every topic, changelogs included, is pre-created by `python -m infra bootstrap`; the app never declares one.
"""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Optional

import faust
from faust.types import StreamT

from infra import faults
from infra.faults import fault_hit
from infra.metrics import process_id
from infra.settings import Settings, cache_dir
from schemas.topics import STREAM_TABLES, Topics
from streams.metrics import streams_metrics
from streams.outbox import KafkaOutbox, Outbox
from streams.pipeline import ClaimResolver, Pipeline, Tables
from streams.runtime import PartitionedTable, StreamsApp, batches
from streams.scoring import Scorer
from streams.settings import StreamSettings
from streams.state import (
    CLOSED_EPISODE_CODEC,
    EPISODE_CODEC,
    GROUP_CODEC,
    TASK_COUNT_CODEC,
    dump_closed_episode,
    dump_episode,
    dump_group,
    dump_task_count,
)

log = logging.getLogger(__name__)
# Table name -> (faust codec reading its changelog, how a value is written).
TABLE_FORMATS: dict[str, tuple[str, Any]] = {
    "episodes": (EPISODE_CODEC, dump_episode),
    "seen": (CLOSED_EPISODE_CODEC, dump_closed_episode),
    "groups": (GROUP_CODEC, dump_group),
    "taskstats": (TASK_COUNT_CODEC, dump_task_count),
}
assert tuple(TABLE_FORMATS) == STREAM_TABLES, "every table of schemas.topics.STREAM_TABLES needs a format"


def faust_config(settings: StreamSettings, platform: Optional[Settings]) -> dict[str, Any]:
    partitions = _partitions(settings)
    broker = platform.kafka_bootstrap if platform is not None else "localhost:9092"
    return dict(
        broker=[f"kafka://{host}" for host in broker.split(",")],
        store="memory://",  # the changelog is the durable copy; recovery reads it back on start
        processing_guarantee="at_least_once",  # never exactly_once (faust #517, #323)
        topic_partitions=partitions,
        topic_allow_declare=False,  # bootstrap created every topic with the right partition count
        topic_disable_leader=True,
        table_standby_replicas=0,
        consumer_auto_offset_reset="earliest",
        stream_buffer_maxsize=settings.buffer_maxsize,
        # Fetch far ahead of the batch being processed: the worker idles whenever a batch waits on a fetch.
        broker_max_poll_records=max(settings.batch_max * 4, 10_000),
        consumer_max_fetch_size=16 * 1024 * 1024,
        broker_commit_every=max(10_000, settings.batch_max * 2),
        # A worker killed with -9 holds its partitions until its session expires: keep that short.
        broker_session_timeout=10.0,
        broker_heartbeat_interval=2.0,
        web_enabled=False,
        autodiscover=False,
        datadir=str(cache_dir() / "streams" / Topics(settings.ns).streams_app_id),
    )


def build_app(settings: StreamSettings, platform: Optional[Settings] = None, outbox: Optional[Outbox] = None,
              scorer: Optional[Scorer] = None, worker: Optional[str] = None) -> StreamsApp:
    """The app, its tables, agents and timers; `outbox` defaults to an idempotent producer on `platform`;
    `worker` labels its metric windows (host-pid unless given)."""
    topics = Topics(settings.ns, _partitions(settings))
    config = faust_config(settings, platform)
    Path(config["datadir"]).parent.mkdir(parents=True, exist_ok=True)
    app = StreamsApp(topics.streams_app_id, **config)
    if outbox is None:
        if platform is None:
            raise ValueError("build_app needs a platform (Kafka) or an outbox")
        outbox = KafkaOutbox(platform)
    app.outbox = outbox
    app.batch_topics = frozenset({topics.events, topics.trajectories})  # each read by one agent, in batches
    app.batch_max = settings.batch_max
    tables = _tables(app, topics)
    pipeline = Pipeline(settings, topics, tables, outbox, scorer or Scorer.load(settings.reward_fn, settings.reward_version),
                        claims=ClaimResolver(platform), metrics=streams_metrics(worker or process_id()),
                        ready=lambda: not (app.rebalancing or app.in_recovery))
    app.pipeline = pipeline  # type: ignore[attr-defined]

    @app.on_partitions_assigned.connect
    async def on_assigned(sender: Any, /, *args: Any, signal: Any, **kwargs: Any) -> None:  # args: (assigned,)
        await pipeline.keep_partitions({tp.partition for tp in args[0] if tp.topic == topics.events})
    app.on_stopping = pipeline.flush_metrics
    app.stage_agents = _agents(app, topics, settings, pipeline)  # type: ignore[attr-defined]
    _timers(app, settings, pipeline)
    return app


def _partitions(settings: StreamSettings) -> int:
    if settings.partitions is None:
        raise ValueError("settings.partitions is unknown: read it from the broker first (streams.__main__)")
    return settings.partitions


def _tables(app: faust.App, topics: Topics) -> Tables:
    made: dict[str, PartitionedTable[Any]] = {}
    for name, (value_codec, dump) in TABLE_FORMATS.items():
        # The changelog topic as Faust would make it, but read with our codec (Faust only knows json and
        # Records): recovery decodes it with this topic's serializers.
        changelog = app.topic(topics.changelog(name), key_type=bytes, key_serializer="raw",
                              value_serializer=value_codec, partitions=topics.partitions, compacting=True,
                              acks=False, internal=True, maxsize=131_072, allow_empty=True)
        table = app.Table(name, partitions=topics.partitions, key_type=bytes, changelog_topic=changelog,
                          recovery_buffer_size=10_000)
        assert table.changelog_topic.get_topic_name() == topics.changelog(name)
        made[name] = PartitionedTable(table, dump)
    return Tables(**made)


def _agents(app: faust.App, topics: Topics, settings: StreamSettings, pipeline: Pipeline) -> dict[str, Any]:
    def topic(name: str) -> faust.TopicT:
        return app.topic(name, partitions=topics.partitions, key_serializer="raw", value_serializer="raw",
                         key_type=bytes, value_type=bytes)

    @app.agent(topic(topics.events), name="assemble", concurrency=1)
    async def assemble(stream: StreamT) -> AsyncIterator[int]:
        """clean -> assemble -> score: rollout events in, trajectories and dead letters out."""
        async for batch in batches(stream, settings.batch_max, settings.batch_wait_s):
            if fault_hit("wedged_batch"):  # a crash test's stuck agent: only the stall watchdog gets it going
                await asyncio.Event().wait()
            await _or_stop(app, pipeline.on_events(batch.messages))  # type: ignore[arg-type]
            if fault_hit("processed_batch"):  # a crash test's kill -9 between a batch's outputs and its commit
                await pipeline.flush_metrics()
                await pipeline.outbox.flush()
                faults.kill()
            batch.ack()
            yield len(batch)  # lets agent.test_context() see each batch done

    @app.agent(topic(topics.trajectories), name="group", concurrency=1)
    async def group(stream: StreamT) -> AsyncIterator[int]:
        """Scored trajectories in, groups with advantages and per-task pass rates out."""
        async for batch in batches(stream, settings.batch_max, settings.batch_wait_s):
            await _or_stop(app, pipeline.on_trajectories(batch.messages))  # type: ignore[arg-type]
            batch.ack()
            yield len(batch)

    return {"assemble": assemble, "group": group}


async def _or_stop(app: StreamsApp, batch: Awaitable[None]) -> None:
    """Run a batch; if it fails (bad records never do: they are dead-lettered) stop the worker.

    A failed batch leaves the in-memory tables ahead of the changelog, and Faust would restart only the
    agent, with its events never acked. Stopping instead restarts from the changelog and the last
    committed offset: the batch is processed again, its outputs re-sent identically.
    """
    try:
        await batch
    except Exception as exc:
        log.critical("a batch failed (%r): stopping the worker, to restart from the last commit", exc,
                     exc_info=True)
        app.failure = exc
        if app.stop_worker is None:
            raise
        app.stop_worker()
        await asyncio.Event().wait()  # the batch is never acked; the stop cancels this agent


def _timers(app: faust.App, settings: StreamSettings, pipeline: Pipeline) -> None:
    @app.timer(settings.sweep_interval_s, name="sweep")
    async def sweep() -> None:
        await pipeline.sweep()

    @app.timer(settings.metrics_window_s, name="metrics")
    async def metrics() -> None:
        await pipeline.flush_metrics()
