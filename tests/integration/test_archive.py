"""The archiver against the real broker and store: what it writes, and that restarts never store twice."""
from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest

from consumers.archive import ArchiveBounds, Archiver
from infra.kafka import read_topic
from infra.objectstore import ObjectStore
from infra.settings import Settings
from schemas.archive import archive_prefix, parse_archive_key, read_archive
from schemas.topics import Topics
from tests.conftest import ROOT
from tests.taps import episode, produce

pytestmark = pytest.mark.integration
T0 = 1_700_000_000_000


def archive_once(stack: Settings, topics: Topics, store: ObjectStore, group: str, max_events: int = 5) -> list[str]:
    archiver = Archiver(stack, topics.ns, ArchiveBounds(max_events=max_events), store=store, group=group)
    try:
        return archiver.run_once(timeout_s=60).keys
    finally:
        archiver.close()


def test_a_long_run_reports_its_newest_keys_only(stack: Settings, topics: Topics, store: ObjectStore,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """An archiver runs for weeks: its stats keep the newest keys it wrote, not one per object ever written."""
    import consumers.archive

    monkeypatch.setattr(consumers.archive, "KEEP_KEYS", 2)
    produce(stack, topics.events, [e for i in range(4) for e in episode(f"ep-{i}", T0 + 1000 * i)])
    archiver = Archiver(stack, topics.ns, ArchiveBounds(max_events=2), store=store, group=f"{topics.ns}.archive")
    try:
        stats = archiver.run_once(timeout_s=60)
    finally:
        archiver.close()
    written = sorted(stored(store, topics))
    assert stats.objects == len(written) > 2 and len(stats.keys) == 2 and set(stats.keys) <= set(written)


def stored(store: ObjectStore, topics: Topics) -> dict[str, bytes]:
    return {k: store.get(k) for k in store.list(archive_prefix(topics.ns, topics.events))}


def test_archive_holds_every_record_with_its_position(stack: Settings, topics: Topics, store: ObjectStore) -> None:
    events = [e for i in range(4) for e in episode(f"ep-{i}", T0 + 1000 * i)]
    produce(stack, topics.events, events)
    keys = archive_once(stack, topics, store, f"{topics.ns}.archive")
    archived = [r for k in sorted(keys) for r in read_archive(store.get(k))]
    source = list(read_topic(stack, topics.events))
    assert sorted((r.partition, r.offset, r.timestamp, r.key, r.value) for r in archived) == sorted(
        (m.partition(), m.offset(), m.timestamp()[1], m.key(), m.value()) for m in source)
    for key in keys:
        obj = parse_archive_key(key)
        recs = read_archive(store.get(key))
        assert obj.date == "2023-11-14" and (obj.first, obj.last) == (recs[0].offset, recs[-1].offset)
        assert len(recs) <= 5 and all(r.partition == obj.partition for r in recs)


def test_restarts_never_store_twice_and_rewrite_the_same_bytes(stack: Settings, topics: Topics,
                                                              store: ObjectStore) -> None:
    produce(stack, topics.events, [e for i in range(3) for e in episode(f"ep-{i}", T0)])
    group = f"{topics.ns}.archive"
    archive_once(stack, topics, store, group)
    before = stored(store, topics)
    assert archive_once(stack, topics, store, group) == []  # committed: nothing new
    assert archive_once(stack, topics, store, f"lost-{uuid.uuid4().hex[:6]}") == []  # commits lost: the store says
    lost = sorted(before)[1]  # an object gone (a crash between put and commit, a manual delete)
    store.delete(lost)
    rewritten = archive_once(stack, topics, store, f"lost-{uuid.uuid4().hex[:6]}")
    assert lost in rewritten  # and the objects after it in its partition, with the same cuts
    assert stored(store, topics) == before  # the same keys, byte for byte, and no second copy

    produce(stack, topics.events, episode("ep-late", T0 + 5000))
    new = archive_once(stack, topics, store, group)
    after = stored(store, topics)
    assert set(after) == set(before) | set(new) and new
    ends = {}
    for key in sorted(before):
        obj = parse_archive_key(key)
        ends[obj.partition] = max(ends.get(obj.partition, -1), obj.last)
    assert all(parse_archive_key(k).first == ends.get(parse_archive_key(k).partition, -1) + 1 for k in new)


def test_cli_once_prints_a_summary(stack: Settings, topics: Topics, store: ObjectStore) -> None:
    produce(stack, topics.events, episode("ep-cli", T0))
    out = subprocess.run([sys.executable, "-m", "consumers.archive", "--ns", topics.ns, "--once"], cwd=ROOT,
                         env={**__import__("os").environ, **stack.as_env()}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary == {"topic": topics.events, "events": 4, "objects": 1, "bytes": summary["bytes"]}
    assert len(stored(store, topics)) == 1
