"""Creates every topic of a namespace and the object-store bucket, idempotently."""
from __future__ import annotations

import time

from dataclasses import dataclass, field
from typing import Optional

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, ClusterMetadata, ConfigResource, NewTopic

from infra.kafka import admin, while_broker_away
from infra.objectstore import ObjectStore
from infra.settings import Settings
from schemas.errors import InfraError
from schemas.topics import Topics


@dataclass
class BootstrapReport:
    created: list[str] = field(default_factory=list)
    existing: list[str] = field(default_factory=list)
    bucket_created: bool = False
    brokers: list[int] = field(default_factory=list)  # each listed every topic before bootstrap returned


def create_topics(settings: Settings, topics: Topics, timeout: float = 30.0) -> BootstrapReport:
    client = admin(settings)
    report = BootstrapReport()
    existing = set(client.list_topics(timeout=timeout).topics)
    missing = [s for s in topics.specs() if s.name not in existing]
    report.existing = [s.name for s in topics.specs() if s.name in existing]
    if missing:
        futures = client.create_topics(
            # replication factor -1: the cluster's default.replication.factor decides (1 on one broker, 3 on a
            # cluster configured so), and its min.insync.replicas applies: settings, not code
            [NewTopic(s.name, num_partitions=s.partitions, replication_factor=-1, config=s.config) for s in missing],
            operation_timeout=timeout, request_timeout=timeout,
        )
        for name, fut in futures.items():
            try:
                fut.result()
                report.created.append(name)
            except KafkaException as exc:
                if exc.args[0].name() != "TOPIC_ALREADY_EXISTS":
                    raise InfraError(f"cannot create topic {name}: {exc}") from exc
                report.existing.append(name)
    report.brokers = wait_until_every_broker_knows(settings, [s.name for s in topics.specs()], timeout)
    return report


def _known(meta: ClusterMetadata, name: str) -> bool:
    found = meta.topics.get(name)
    return (found is not None and found.error is None and bool(found.partitions)
            and all(p.leader >= 0 for p in found.partitions.values()))


def _answered_by(meta: ClusterMetadata, ids_by_address: dict[str, int]) -> Optional[int]:
    """The id of the broker that answered: librdkafka names its first connection "host:port/bootstrap" (id -1)."""
    if meta.orig_broker_id >= 0:
        return int(meta.orig_broker_id)
    return ids_by_address.get(str(meta.orig_broker_name).rsplit("/", 1)[0])


def wait_until_every_broker_knows(settings: Settings, names: list[str], timeout: float = 30.0) -> list[int]:
    """Return (the ids of the cluster's brokers) once each broker has listed every topic in `names` with a leader
    for each partition. CreateTopics answers when the controller has committed the topics; a broker applies that
    a moment later, and a client that asks it in between hears "unknown topic".

    Which broker answers a metadata request is librdkafka's choice, not the address the client was given: a client
    bootstrapped at broker 1 was answered by broker 2 fifteen times in fifteen. So each answer counts for the
    broker whose id it carries, and a broker that does not answer yet (starting, paused) is asked again."""
    brokers = {b.id: f"{b.host}:{b.port}" for b in admin(settings).list_topics(timeout=timeout).brokers.values()}
    ids_by_address = {address: i for i, address in brokers.items()}
    deadline = time.monotonic() + timeout
    confirmed: set[int] = set()
    lacking: dict[int, list[str]] = {}
    while True:
        for address in [a for i, a in brokers.items() if i not in confirmed]:
            try:
                meta = AdminClient({"bootstrap.servers": address}).list_topics(
                    timeout=max(1.0, min(5.0, deadline - time.monotonic())))
            except KafkaException:
                continue
            broker = _answered_by(meta, ids_by_address)
            if broker is None:
                continue
            missing = [n for n in names if not _known(meta, n)]
            if missing:
                lacking[broker] = missing
            else:
                confirmed.add(broker)
                lacking.pop(broker, None)
        if confirmed >= set(brokers):
            return sorted(brokers)
        if time.monotonic() >= deadline:
            unheard = sorted(set(brokers) - confirmed - set(lacking))
            raise InfraError("; ".join(
                [f"broker {i} ({brokers[i]}) still does not list {', '.join(m)}" for i, m in sorted(lacking.items())]
                + [f"broker {i} ({brokers[i]}) did not answer" for i in unheard])
                + f" {timeout:.0f} s after the topics were created")
        time.sleep(0.1)


def topic_config(settings: Settings, topic: str, timeout: float = 10.0) -> dict[str, str]:
    client = admin(settings)
    resource = ConfigResource(ConfigResource.Type.TOPIC, topic)
    entries = client.describe_configs([resource], request_timeout=timeout)[resource].result()
    return {k: v.value for k, v in entries.items()}


def partition_count(settings: Settings, topic: str, timeout: float = 10.0, settle_s: float = 15.0) -> int:
    """Partitions of `topic`. A broker that has just started can deny a topic bootstrap created seconds
    earlier (its metadata still loading): asked again for up to `settle_s` before the topic is called missing."""
    client = admin(settings)
    deadline = time.monotonic() + settle_s
    while True:
        meta = while_broker_away(f"metadata of {topic}", lambda: client.list_topics(topic, timeout=timeout))
        found = meta.topics.get(topic)
        if found is not None and found.error is None and found.partitions:
            return len(found.partitions)
        if time.monotonic() >= deadline:
            raise InfraError(f"topic {topic} does not exist; run `python -m infra bootstrap --ns NAME`")
        time.sleep(1.0)


def delete_topics(settings: Settings, names: list[str], timeout: float = 30.0) -> None:
    client = admin(settings)  # held until the futures resolve: a collected client fails them with _DESTROY
    for fut in client.delete_topics(names, operation_timeout=timeout).values():
        try:
            fut.result()
        except KafkaException as exc:
            if exc.args[0].name() != "UNKNOWN_TOPIC_OR_PART":
                raise


def bootstrap(settings: Settings, ns: str, partitions: int = 4) -> BootstrapReport:
    report = create_topics(settings, Topics(ns, partitions))
    report.bucket_created = ObjectStore(settings).ensure_bucket()
    return report


__all__ = ["BootstrapReport", "bootstrap", "create_topics", "delete_topics", "partition_count",
           "topic_config", "wait_until_every_broker_knows"]
