"""Namespaces as the broker and the store hold them: list them with their sizes, delete one entirely.

    python -m infra namespaces                   # every namespace: topics, records, objects, bytes, groups
    python -m infra delete-namespace NS          # its topics, objects and consumer groups
    python -m infra delete-namespace NS --force  # even while some consumer of it is running

A namespace owns the topics `<ns>.*` (the streams changelogs too), the objects under `<area>/<ns>/` for
each area of schemas.keys, and the consumer groups named `<ns>.*` or `<ns>-*` (the longest namespace that
prefixes a group owns it, so `run` never takes the groups of `run-eval-v3`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from confluent_kafka import KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from infra.kafka import admin, consumer
from infra.objectstore import ObjectStore
from infra.settings import Settings
from schemas.errors import ConfigError, PipelineError
from schemas.topics import Topics

OBJECT_AREAS = ("shards", "checkpoints", "archive", "claims")  # schemas.keys: <area>/<ns>/...
# A topic deleted since the broker listed it answers with one of these.
GONE = (KafkaError._UNKNOWN_PARTITION, KafkaError._UNKNOWN_TOPIC, KafkaError.UNKNOWN_TOPIC_OR_PART)


@dataclass
class Namespace:
    ns: str
    topics: list[str] = field(default_factory=list)
    records: int = 0
    objects: int = 0
    object_bytes: int = 0
    groups: dict[str, int] = field(default_factory=dict)  # group id -> active members

    @property
    def active(self) -> list[str]:
        return [g for g, members in self.groups.items() if members]

    def row(self) -> dict[str, Any]:
        return {"ns": self.ns, "topics": len(self.topics), "records": self.records, "objects": self.objects,
                "object_mb": round(self.object_bytes / 2**20, 2), "groups": len(self.groups),
                "running_consumers": self.active}


def namespace_of(name: str) -> Optional[str]:
    """The namespace a topic belongs to (`<ns>.<rest>`), None for a topic of no namespace."""
    ns, dot, _ = name.partition(".")
    if not dot:
        return None
    try:
        Topics(ns)
    except ConfigError:
        return None
    return ns


def owner(group: str, namespaces: list[str]) -> Optional[str]:
    """The longest namespace whose `<ns>.` or `<ns>-` prefixes the group id."""
    matches = [ns for ns in namespaces if group.startswith((ns + ".", ns + "-"))]
    return max(matches, key=len) if matches else None


def survey(settings: Settings, store: Optional[ObjectStore] = None) -> dict[str, Namespace]:
    """Every namespace with a topic or an object, and its size."""
    client = admin(settings)
    found: dict[str, Namespace] = {}
    metadata = client.list_topics(timeout=30)
    for name in metadata.topics:
        ns = namespace_of(name)
        if ns is not None:
            found.setdefault(ns, Namespace(ns)).topics.append(name)
    count_records(settings, metadata, found)
    store = store or ObjectStore(settings)
    for area in OBJECT_AREAS:
        for prefix in store.list(f"{area}/", recursive=False):
            ns = prefix[len(area) + 1:].rstrip("/")
            try:
                Topics(ns)
            except ConfigError:
                continue
            count, size = store.usage(prefix)
            entry = found.setdefault(ns, Namespace(ns))
            entry.objects += count
            entry.object_bytes += size
    _find_groups(client, found)
    return dict(sorted(found.items()))


def count_records(settings: Settings, metadata: Any, found: dict[str, Namespace]) -> None:
    """Each namespace's records, from its topics' offsets. A topic deleted since `metadata` was read (another
    session clearing its namespaces meanwhile) is dropped from its namespace, and a namespace left with no topic is
    dropped from `found` (survey adds it back if it still has objects, which it counts after this)."""
    c = consumer(settings, "trajpipe-namespaces")
    try:
        for ns, entry in list(found.items()):
            for name in list(entry.topics):
                try:
                    for partition in metadata.topics[name].partitions:
                        low, high = c.get_watermark_offsets(TopicPartition(name, partition), timeout=10)
                        entry.records += max(0, high - low)
                except KafkaException as exc:
                    if exc.args[0].code() not in GONE:
                        raise
                    entry.topics.remove(name)
            if not entry.topics:
                del found[ns]
    finally:
        c.close()


def _find_groups(client: AdminClient, found: dict[str, Namespace]) -> None:
    listed = client.list_consumer_groups().result(timeout=30)
    ids = [g.group_id for g in listed.valid]
    owned = {g: owner(g, list(found)) for g in ids}
    mine = [g for g, ns in owned.items() if ns is not None]
    if not mine:
        return
    for group, future in client.describe_consumer_groups(mine).items():
        try:
            members = len(future.result(timeout=30).members)
        except Exception:  # a group deleted meanwhile
            continue
        found[owned[group]].groups[group] = members  # type: ignore[index]


def delete_namespace(settings: Settings, ns: str, force: bool = False) -> dict[str, Any]:
    """Delete the namespace's topics, objects and consumer groups; refuses while a consumer of it runs."""
    Topics(ns)
    store = ObjectStore(settings)
    everything = survey(settings, store)
    entry = everything.get(ns)
    if entry is None:
        raise ConfigError(f"namespace {ns} has no topic and no object here")
    if entry.active and not force:
        raise PipelineError(f"namespace {ns} has running consumers ({', '.join(entry.active)}): stop them first, "
                            "or pass --force")
    idle = [g for g, members in entry.groups.items() if not members]
    removed, failed = _delete(admin(settings), store, entry.topics, idle, [f"{area}/{ns}/" for area in OBJECT_AREAS])
    return {"ns": ns, "topics_deleted": len(entry.topics), "objects_deleted": removed,
            "groups_deleted": len(idle), "groups_left_running": entry.active, "failed": failed}


def delete_prefixed(settings: Settings, prefixes: list[str]) -> dict[str, Any]:
    """Delete every topic, idle consumer group and object area of the namespaces that start with one of
    `prefixes` (`<p>`, `<p>.x`, `<p>-from-shards`...) in one pass, with no survey: how a test session clears
    the namespaces it made. Unique prefixes only (a test's random namespace), never a user's run name."""
    if not prefixes:
        return {"topics_deleted": 0, "objects_deleted": 0, "groups_deleted": 0, "failed": []}
    wanted = tuple(prefixes)
    client = admin(settings)
    topics = [t for t in client.list_topics(timeout=30).topics if t.startswith(wanted)]
    listed = client.list_consumer_groups().result(timeout=30)
    groups = [g.group_id for g in listed.valid if g.group_id.startswith(wanted)]
    store = ObjectStore(settings)
    areas = [p for area in OBJECT_AREAS for p in store.list(f"{area}/", recursive=False)
             if p[len(area) + 1:].startswith(wanted)]
    removed, failed = _delete(client, store, topics, groups, areas)
    return {"topics_deleted": len(topics), "objects_deleted": removed, "groups_deleted": len(groups),
            "failed": failed}


def _delete(client: AdminClient, store: ObjectStore, topics: list[str], groups: list[str],
            object_prefixes: list[str]) -> tuple[int, list[str]]:
    """Delete the topics, the consumer groups and every object under the prefixes; (objects removed, failures)."""
    failed: list[str] = []
    if topics:
        for topic, future in client.delete_topics(topics, operation_timeout=30).items():
            try:
                future.result(timeout=60)
            except Exception as exc:
                failed.append(f"topic {topic}: {exc}")
    if groups:
        for group, future in client.delete_consumer_groups(groups).items():
            try:
                future.result(timeout=30)
            except Exception as exc:  # a group with members left (a consumer still running) stays
                failed.append(f"group {group}: {exc}")
    removed = 0
    for prefix in object_prefixes:
        for key in store.list(prefix):
            store.delete(key)
            removed += 1
    return removed, failed
