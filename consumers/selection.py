"""Which recorded events a replay copies: a window of the log, filters, and whole episodes only; pure.

    window = Window(start={0: 100}, end={0: 500}, since=parse_time("2025-01-01T00:00:00Z"))
    selector = EpisodeSelector(window, EventFilter(domains=frozenset({"math"})))
    for rec in records:                        # ArchivedEvent-like: partition, offset, timestamp, key, value
        if selector.admit(rec, decode_or_none(rec.value)):
            copy(rec)
        if selector.finished(rec.partition, rec.offset, rec.timestamp):
            stop(rec.partition)

Rules. The window (offsets [start, end) per partition, Kafka record time [since, until)) chooses episodes by
their EpisodeStarted record: an episode is copied whole, its later events included even when they lie past the
window's end, and an episode that started before the window is left out entirely. Domain, task and
policy-version filters are decided on that same first event (the policy version of an episode is the one it
started with), so a filter never splits an episode. With no window and no filter a replay is a verbatim copy,
undecodable records included, so the new namespace's offsets equal the old ones.
"""
from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Optional, Protocol

from schemas.errors import ConfigError
from schemas.records import EpisodeEnded, EpisodeStarted, RolloutEvent


class SourceRecord(Protocol):
    @property
    def partition(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def timestamp(self) -> int: ...
    @property
    def key(self) -> Optional[bytes]: ...
    @property
    def value(self) -> bytes: ...


def parse_offsets(text: Optional[str]) -> dict[int, int]:
    """"0:120,1:80" -> {0: 120, 1: 80}."""
    if not text:
        return {}
    out: dict[int, int] = {}
    for item in text.split(","):
        part, sep, offset = item.strip().partition(":")
        try:
            if not sep:
                raise ValueError(item)
            out[int(part)] = int(offset)
        except ValueError:
            raise ConfigError(f"offsets {text!r}: write partition:offset pairs, e.g. 0:120,1:80") from None
        if out[int(part)] < 0 or int(part) < 0:
            raise ConfigError(f"offsets {text!r}: partitions and offsets are >= 0")
    return out


def parse_time(text: Optional[str]) -> Optional[int]:
    """Milliseconds since the epoch from an integer or an ISO 8601 time (UTC unless it names a zone)."""
    if text is None or text == "":
        return None
    if text.lstrip("-").isdigit():
        return int(text)
    try:
        when = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ConfigError(f"time {text!r}: give milliseconds or ISO 8601, e.g. 2025-01-31T12:00:00Z") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.timezone.utc)
    return int(when.timestamp() * 1000)


@dataclass(frozen=True)
class Window:
    """A slice of the log: offsets [start, end) per partition and record timestamps [since, until)."""

    start: dict[int, int] = field(default_factory=dict)
    end: dict[int, int] = field(default_factory=dict)
    since: Optional[int] = None
    until: Optional[int] = None

    def __post_init__(self) -> None:
        for p, lo in self.start.items():
            if p in self.end and self.end[p] < lo:
                raise ConfigError(f"partition {p}: --to-offsets {self.end[p]} is before --from-offsets {lo}")
        if self.since is not None and self.until is not None and self.until < self.since:
            raise ConfigError(f"--until {self.until} is before --since {self.since}")

    @property
    def unbounded(self) -> bool:
        return not self.start and not self.end and self.since is None and self.until is None

    def past(self, partition: int, offset: int, timestamp: int) -> bool:
        """At or after the window's end; Kafka's time index assumes timestamps do not go back in a partition."""
        end = self.end.get(partition)
        return (end is not None and offset >= end) or (self.until is not None and timestamp >= self.until)

    def contains(self, partition: int, offset: int, timestamp: int) -> bool:
        if self.past(partition, offset, timestamp) or offset < self.start.get(partition, 0):
            return False
        return self.since is None or timestamp >= self.since


@dataclass(frozen=True)
class EventFilter:
    """Per-episode filters, judged on the episode's first event; empty sets mean "any"."""

    domains: frozenset[str] = frozenset()
    task_ids: frozenset[str] = frozenset()
    policy_min: Optional[int] = None
    policy_max: Optional[int] = None

    @property
    def empty(self) -> bool:
        return not self.domains and not self.task_ids and self.policy_min is None and self.policy_max is None

    def accepts(self, event: RolloutEvent) -> bool:
        if self.domains and event.domain not in self.domains:
            return False
        if self.task_ids and event.task_id not in self.task_ids:
            return False
        if self.policy_min is not None and event.policy_version < self.policy_min:
            return False
        return self.policy_max is None or event.policy_version <= self.policy_max


@dataclass
class SelectionStats:
    copied: int = 0
    episodes: int = 0
    outside_window: int = 0
    filtered: int = 0  # events of episodes a filter left out
    partial: int = 0  # events of episodes that started before the window
    undecodable: int = 0


def episode_of(rec: SourceRecord, event: Optional[RolloutEvent]) -> Optional[str]:
    if event is not None:
        return event.episode_id
    return rec.key.decode("utf-8", "replace") if rec.key else None


class EpisodeSelector:
    """Admits records episode by episode, in each partition's offset order (see the module docstring)."""

    def __init__(self, window: Window, event_filter: EventFilter) -> None:
        self.window = window
        self.filter = event_filter
        self.verbatim = window.unbounded and event_filter.empty
        self.open: dict[int, set[str]] = {}  # selected episodes not ended yet, per partition
        self.rejected: dict[int, set[str]] = {}  # episodes a filter left out, so their later events are too
        self.stats = SelectionStats()

    @property
    def needs_decoding(self) -> bool:
        return not self.verbatim

    def admit(self, rec: SourceRecord, event: Optional[RolloutEvent]) -> bool:
        if self.verbatim:
            self.stats.copied += 1
            return True
        episode = episode_of(rec, event)
        open_here = self.open.setdefault(rec.partition, set())
        if episode is not None and episode in open_here:
            if event is not None and isinstance(event.body, EpisodeEnded):
                open_here.discard(episode)
            self.stats.copied += 1
            return True
        return self._first_event(rec, event, episode)

    def _first_event(self, rec: SourceRecord, event: Optional[RolloutEvent], episode: Optional[str]) -> bool:
        rejected = self.rejected.setdefault(rec.partition, set())
        if not self.window.contains(rec.partition, rec.offset, rec.timestamp):
            self.stats.outside_window += 1
        elif event is None or episode is None:
            self.stats.undecodable += 1
        elif episode in rejected:
            if isinstance(event.body, EpisodeEnded):
                rejected.discard(episode)
            self.stats.filtered += 1
        elif not isinstance(event.body, EpisodeStarted):
            self.stats.partial += 1
        elif not self.filter.accepts(event):
            rejected.add(episode)
            self.stats.filtered += 1
        else:
            self.open[rec.partition].add(episode)
            self.stats.episodes += 1
            self.stats.copied += 1
            return True
        return False

    def finished(self, partition: int, offset: int, timestamp: int) -> bool:
        """Past the window with no selected episode still open: the rest of the partition is not needed."""
        return self.window.past(partition, offset, timestamp) and not self.open.get(partition)
