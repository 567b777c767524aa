"""A bounded local disk cache of shards keyed by sha256, verified on every read, evicted least recently used.

    cache = ShardCache(Path("/var/cache/shards"), max_bytes=2 << 30)
    data = cache.fetch(manifest.sha256, lambda: store.get(manifest.key, sha256=manifest.sha256))
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from schemas.errors import ConfigError, IntegrityError

log = logging.getLogger(__name__)
SUFFIX = ".shard"
TMP_PREFIX = ".tmp-"


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    evictions: int = 0


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _writer_alive(tmp_name: str) -> bool:
    """Whether the process that is writing this temp file still runs: several learners on one host share the
    default directory (shards are content-addressed), and one starting must not delete another's write."""
    pid = tmp_name.removeprefix(TMP_PREFIX).split("-", 1)[0]
    if not pid.isdigit() or int(pid) == os.getpid():
        return False  # an older name without a pid, or this process's own from before (it starts afresh)
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


class ShardCache:
    """Files named by their sha256 under `root`; the index survives restarts (rebuilt from mtimes). Processes may
    share `root`: each one bounds what it indexes, and a file another one evicted is a miss."""

    def __init__(self, root: Path | str, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ConfigError(f"shard cache max_bytes must be >= 1, got {max_bytes}")
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.stats = CacheStats()
        self._lock = threading.Lock()
        self._sizes: OrderedDict[str, int] = OrderedDict()  # sha256 -> size, least recently used first
        self._total = 0
        self.root.mkdir(parents=True, exist_ok=True)
        self._load_index()

    def _path(self, sha256: str) -> Path:
        return self.root / f"{sha256}{SUFFIX}"

    def _load_index(self) -> None:
        for tmp in self.root.glob(f"{TMP_PREFIX}*"):
            if not _writer_alive(tmp.name):
                tmp.unlink(missing_ok=True)  # a write that a crash interrupted (another live process's goes on)
        files = sorted(self.root.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime)
        for path in files:
            self._add(path.name.removesuffix(SUFFIX), path.stat().st_size)
        self._evict()

    @property
    def size_bytes(self) -> int:
        return self._total

    def __contains__(self, sha256: str) -> bool:
        return sha256 in self._sizes

    def get(self, sha256: str) -> Optional[bytes]:
        """The cached bytes, verified; None when absent or corrupt (a corrupt file is deleted)."""
        with self._lock:
            try:
                data = self._path(sha256).read_bytes()
            except FileNotFoundError:
                self._drop(sha256)
                return None
            if _sha256(data) != sha256:
                self.stats.corrupt += 1
                log.warning("cached shard %s… is corrupt; deleting it", sha256[:12])
                self._drop(sha256)
                return None
            self._sizes.move_to_end(sha256)
            try:
                os.utime(self._path(sha256))  # so the order survives a restart
            except FileNotFoundError:
                pass  # another process sharing the directory evicted it since the read: the bytes are verified
            return data

    def put(self, sha256: str, data: bytes) -> None:
        """Store `data` atomically (tmp file then rename); IntegrityError if it is not `sha256`."""
        if _sha256(data) != sha256:
            raise IntegrityError(f"refusing to cache bytes whose sha256 is not {sha256[:12]}…")
        if len(data) > self.max_bytes:
            return  # would evict everything and still not fit
        with self._lock:
            tmp = self.root / f"{TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"  # the pid: see _writer_alive
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self._path(sha256))
            self._add(sha256, len(data))
            self._evict()

    def fetch(self, sha256: str, load: Callable[[], bytes]) -> bytes:
        """From the cache, else from `load()` (which must return the bytes of `sha256`), then cached."""
        data = self.get(sha256)
        if data is not None:
            self.stats.hits += 1
            return data
        self.stats.misses += 1
        data = load()
        self.put(sha256, data)
        return data

    def _add(self, sha256: str, size: int) -> None:
        self._total += size - self._sizes.get(sha256, 0)
        self._sizes[sha256] = size
        self._sizes.move_to_end(sha256)

    def _drop(self, sha256: str) -> None:
        self._path(sha256).unlink(missing_ok=True)
        self._total -= self._sizes.pop(sha256, 0)

    def _evict(self) -> None:
        while self._sizes and self._total > self.max_bytes:
            oldest = next(iter(self._sizes))
            self._drop(oldest)
            self.stats.evictions += 1
