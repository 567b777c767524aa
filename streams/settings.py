"""Settings of the streams worker, from the environment and the command line; bad values refused with the fix.

    settings = StreamSettings.from_args(["--ns", "run1", "--reward", "default:1"])
    settings.topics.events       # "run1.rollout.events"
"""
from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from typing import Mapping, Optional

from infra.kafka import RECORD_LIMIT
from infra.settings import add_ns_argument
from schemas.errors import ConfigError
from schemas.topics import Topics

ENV_PREFIX = "TRAJPIPE_STREAMS_"
LOG_LEVELS = ("crit", "error", "warn", "info", "debug")


@dataclass(frozen=True)
class StreamSettings:
    ns: str
    partitions: Optional[int] = None  # None: take the partition count of <ns>.rollout.events at start
    reward_fn: str = "default"
    reward_version: str = "1"
    episode_timeout_s: float = 600.0
    group_timeout_s: float = 300.0
    drop_zero_variance: bool = True
    metrics_window_s: float = 10.0
    dedupe_horizon_s: float = 3600.0  # how long closed episodes and groups are remembered for late duplicates
    sweep_interval_s: float = 1.0
    # Producer timestamps further ahead of this worker's clock are capped; None: min(2 s, timeouts / 4).
    max_clock_skew_s: Optional[float] = None
    advantage_eps: float = 1e-6
    # Largest record the worker writes (outputs, changelog values, dead letters); what would be larger is
    # dead-lettered with reason oversize. Below the producer's message.max.bytes (infra.kafka.RECORD_LIMIT).
    max_record_bytes: int = 4 * 1024 * 1024 - 64 * 1024
    stall_restart_s: float = 90.0  # records wait and nothing was read or committed this long: restart
    unassigned_restart_s: float = 30.0  # no partition this long while some has no worker either: restart
    batch_max: int = 4000
    batch_wait_s: float = 0.02
    buffer_maxsize: int = 65536
    log_level: str = "info"

    def __post_init__(self) -> None:
        Topics(self.ns)  # validates the namespace
        for ok, message in self._checks():
            if not ok:
                raise ConfigError(message)

    def _checks(self) -> list[tuple[bool, str]]:
        positive = ("episode_timeout_s", "group_timeout_s", "metrics_window_s", "sweep_interval_s", "advantage_eps")
        checks = [(_positive(getattr(self, name)), f"--{_flag(name)} must be a positive number, got "
                   f"{getattr(self, name)!r}") for name in positive]
        return checks + [
            (self.partitions is None or self.partitions >= 1,
             f"--partitions must be >= 1, got {self.partitions} (or omit it to use the topic's count)"),
            (bool(self.reward_fn) and bool(self.reward_version),
             f"--reward {self.reward_fn}:{self.reward_version}: write NAME:VERSION, e.g. default:1"),
            (self.dedupe_horizon_s >= self.episode_timeout_s,
             f"--dedupe-horizon-s ({self.dedupe_horizon_s}) must be >= --episode-timeout-s "
             f"({self.episode_timeout_s}): late duplicates arrive up to a timeout after an episode closes"),
            (self.sweep_interval_s <= min(self.episode_timeout_s, self.group_timeout_s),
             f"--sweep-interval-s ({self.sweep_interval_s}) must not exceed the episode and group timeouts"),
            (_positive(self.clock_skew_s), f"--max-clock-skew-s must be a positive number, got {self.clock_skew_s!r}"),
            (self.clock_skew_s < min(self.episode_timeout_s, self.group_timeout_s),
             f"--max-clock-skew-s ({self.clock_skew_s}) must be below the episode and group timeouts: one "
             "timestamp from the future ages every open episode of its partition by up to this much"),
            (64 * 1024 <= self.max_record_bytes <= RECORD_LIMIT - 1024,
             f"--max-record-bytes must be in 65536..{RECORD_LIMIT - 1024} (the producer's record limit less "
             f"the key and headers), got {self.max_record_bytes}"),
            (self.stall_restart_s >= 5, f"--stall-restart-s must be >= 5 seconds, got {self.stall_restart_s}"),
            (self.unassigned_restart_s >= 2,
             f"--unassigned-restart-s must be >= 2 seconds, got {self.unassigned_restart_s}"),
            (1 <= self.batch_max <= 100_000, f"--batch-max must be in 1..100000, got {self.batch_max}"),
            (0 <= self.batch_wait_s <= 5, f"--batch-wait-s must be in 0..5 seconds, got {self.batch_wait_s}"),
            (self.buffer_maxsize >= self.batch_max,
             f"--buffer-maxsize ({self.buffer_maxsize}) must be >= --batch-max ({self.batch_max})"),
            (self.log_level in LOG_LEVELS, f"--log-level must be one of {', '.join(LOG_LEVELS)}"),
        ]

    @property
    def clock_skew_s(self) -> float:
        if self.max_clock_skew_s is not None:
            return self.max_clock_skew_s
        return min(2.0, self.episode_timeout_s / 4, self.group_timeout_s / 4)

    @property
    def topics(self) -> Topics:
        return Topics(self.ns, self.partitions or 1)

    @property
    def reward(self) -> str:
        return f"{self.reward_fn}:{self.reward_version}"

    @classmethod
    def from_args(cls, argv: Optional[list[str]] = None, env: Optional[Mapping[str, str]] = None) -> "StreamSettings":
        args = parser(os.environ if env is None else env).parse_args(argv)
        if not args.ns:
            raise ConfigError("--ns is required (or set TRAJPIPE_NS)")
        name, version = parse_reward(args.reward)
        return cls(
            ns=args.ns, partitions=args.partitions, reward_fn=name, reward_version=version,
            episode_timeout_s=args.episode_timeout_s, group_timeout_s=args.group_timeout_s,
            drop_zero_variance=not args.keep_zero_variance, metrics_window_s=args.metrics_window_s,
            dedupe_horizon_s=args.dedupe_horizon_s if args.dedupe_horizon_s is not None
            else max(3600.0, args.episode_timeout_s),
            sweep_interval_s=args.sweep_interval_s if args.sweep_interval_s is not None
            else min(1.0, args.episode_timeout_s, args.group_timeout_s),
            max_clock_skew_s=args.max_clock_skew_s,
            max_record_bytes=args.max_record_bytes, stall_restart_s=args.stall_restart_s,
            unassigned_restart_s=args.unassigned_restart_s, advantage_eps=args.advantage_eps, batch_max=args.batch_max,
            batch_wait_s=args.batch_wait_s,
            buffer_maxsize=args.buffer_maxsize, log_level=args.log_level,
        )


def _positive(value: float) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def _flag(name: str) -> str:
    return name.replace("_", "-")


def parse_reward(text: str) -> tuple[str, str]:
    """'default:1' -> ('default', '1'); a bare name takes version 1."""
    name, _, version = text.partition(":")
    if not name.strip() or (_ and not version.strip()):
        raise ConfigError(f"--reward {text!r}: write NAME:VERSION, e.g. default:1")
    return name.strip(), (version.strip() or "1")


def _env_default(env: Mapping[str, str], name: str, default: Optional[str]) -> Optional[str]:
    return env.get(ENV_PREFIX + name.upper(), default)


def _number(kind: type, text: str) -> float | int:
    try:
        return kind(text)  # type: ignore[no-any-return]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None


def parser(env: Mapping[str, str] = os.environ) -> argparse.ArgumentParser:
    """The CLI; every flag also reads TRAJPIPE_STREAMS_<FLAG> (e.g. TRAJPIPE_STREAMS_EPISODE_TIMEOUT_S)."""
    p = argparse.ArgumentParser(prog="python -m streams",
                                description="The streams worker: clean, assemble, score and group rollout events.")

    def opt(flag: str, kind: type = str, default: Optional[str] = None, **kw: object) -> None:
        name = flag.lstrip("-").replace("-", "_")
        value = _env_default(env, name, default)
        convert = (lambda t: _number(kind, t)) if kind in (int, float) else kind
        p.add_argument(flag, type=convert, default=None if value is None else convert(value), **kw)  # type: ignore[arg-type]

    add_ns_argument(p, env=env)
    opt("--partitions", int, help="partitions of the keyed topics (default: read from the broker)")
    opt("--reward", str, "default:1", help="reward function NAME:VERSION (see streams.rewards)")
    opt("--episode-timeout-s", float, "600", help="close an episode idle this long as abandoned")
    opt("--group-timeout-s", float, "300", help="emit a group missing members after this long")
    p.add_argument("--keep-zero-variance", action="store_true",
                   default=_env_default(env, "keep_zero_variance", "0") in ("1", "true", "yes"),
                   help="emit groups whose rewards are all equal (advantage 0) instead of dropping them")
    opt("--metrics-window-s", float, "10", help="tumbling window of the metrics")
    opt("--dedupe-horizon-s", float, help="remember closed episodes and groups this long (default max(1h, timeout))")
    opt("--sweep-interval-s", float, help="how often idle episodes and groups are looked for (default 1s)")
    opt("--max-clock-skew-s", float, help="cap producer timestamps this far ahead of the worker's clock "
                                          "(default min(2s, a quarter of the timeouts))")
    opt("--max-record-bytes", int, str(4 * 1024 * 1024 - 64 * 1024),
        help="dead-letter (reason oversize) what would be a larger record")
    opt("--stall-restart-s", float, "90", help="restart when records wait and nothing was read or committed "
                                              "for this long (a client stuck after a broker restart)")
    opt("--unassigned-restart-s", float, "30",
        help="restart when this worker holds no partition this long while a partition has no worker either (a "
             "client that rejoined before the broker listed its topics); with every partition held by other "
             "workers it idles instead")
    opt("--advantage-eps", float, "1e-6", help="eps in (r - mean) / (std + eps)")
    opt("--batch-max", int, "4000", help="events taken from the stream at once")
    opt("--batch-wait-s", float, "0.02", help="wait this long for a batch to fill")
    opt("--buffer-maxsize", int, "65536", help="events buffered per stream before fetching pauses")
    opt("--log-level", str, "info", help="crit | error | warn | info | debug")
    return p
