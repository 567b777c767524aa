"""The object store (MinIO / S3) with retries, sha256 verification and typed errors.

    store = ObjectStore(settings)
    digest = store.put("shards/x.avro", data)      # returns sha256 hex
    data = store.get("shards/x.avro", sha256=digest)  # IntegrityError if it differs
"""
from __future__ import annotations

import base64
import hashlib
import io
import logging
import time
from typing import Any, Callable, Iterator, Optional, TypeVar

import urllib3
from minio import Minio
from minio.error import S3Error

from infra.settings import Settings
from schemas.errors import IntegrityError, ObjectNotFound, ObjectStoreError

log = logging.getLogger(__name__)
T = TypeVar("T")
_MISSING = {"NoSuchKey", "NoSuchObject", "NoSuchBucket"}
_CORRUPTED = {"XAmzContentChecksumMismatch", "BadDigest"}
# Objects up to PART are one PUT whose x-amz-checksum-sha256 header makes the server check the whole object's
# sha256 before it stores it; larger ones go in parts of PART (the client sends no per-part checksums). Either
# way the ETag the store answers is checked against the one the bytes sent make (the MD5 of a single PUT, the
# MD5 of the parts' MD5s and "-N" for N parts), so a verified write needs no second download.
PART = 64 << 20
_TRANSIENT = (urllib3.exceptions.HTTPError, ConnectionError, TimeoutError, OSError)


def checksum_echoed(headers: Any, checksum: str) -> bool:
    """Did the store answer that it checked the body against this base64 sha256 (x-amz-checksum-sha256)?"""
    if headers is None:
        return False
    echoed = next((value for name, value in headers.items() if name.lower() == "x-amz-checksum-sha256"), None)
    return echoed == checksum


def expected_etag(data: bytes) -> str:
    """The S3 ETag of `data` uploaded in parts of PART: its MD5, or the MD5 of the parts' MD5s and "-N"."""
    if len(data) <= PART:
        return hashlib.md5(data, usedforsecurity=False).hexdigest()
    parts = [hashlib.md5(data[i:i + PART], usedforsecurity=False).digest() for i in range(0, len(data), PART)]
    return hashlib.md5(b"".join(parts), usedforsecurity=False).hexdigest() + f"-{len(parts)}"


class ObjectStore:
    """One bucket; transient failures are retried with backoff for up to `retry_for_s` seconds."""

    def __init__(self, settings: Settings, retry_for_s: float = 30.0, bucket: Optional[str] = None) -> None:
        self.bucket = bucket or settings.bucket
        self.retry_for_s = retry_for_s
        http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=3.0, read=60.0), retries=False, maxsize=8
        )
        self._client = Minio(
            settings.s3_endpoint, access_key=settings.s3_access_key, secret_key=settings.s3_secret_key,
            secure=settings.s3_secure, http_client=http,
        )
        self.retries = 0

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        deadline = time.monotonic() + self.retry_for_s
        delay = 0.2
        while True:
            try:
                return fn()
            except S3Error as exc:
                if exc.code in _MISSING:
                    raise ObjectNotFound(f"{what}: {exc.code} in bucket {self.bucket!r}") from exc
                if exc.code in _CORRUPTED:
                    raise IntegrityError(f"{what}: the store received other bytes than were sent ({exc.code}); "
                                         "nothing was stored") from exc
                if exc.code not in ("SlowDown", "ServiceUnavailable", "InternalError", "XMinioServerNotInitialized"):
                    raise ObjectStoreError(f"{what}: {exc.code}: {exc.message}") from exc
                err: Exception = exc
            except _TRANSIENT as exc:
                err = exc
            if time.monotonic() + delay > deadline:
                raise ObjectStoreError(f"{what}: object store unreachable for {self.retry_for_s:.0f}s: {err}") from err
            self.retries += 1
            log.warning("%s failed (%s); retrying in %.1fs", what, type(err).__name__, delay)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)

    def ensure_bucket(self) -> bool:
        """Create the bucket if missing; True when it was created."""
        if self._call("bucket_exists", lambda: self._client.bucket_exists(self.bucket)):
            return False
        try:
            self._call("make_bucket", lambda: self._client.make_bucket(self.bucket))
        except ObjectStoreError as exc:
            if "BucketAlreadyOwnedByYou" not in str(exc):
                raise
            return False
        return True

    def put(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> str:
        """Store `data`; returns its sha256 hex. Up to PART bytes the server checks the sha256 on arrival
        (IntegrityError when the bytes it received differ, and then nothing is stored)."""
        return self._put(key, data, content_type)[0]

    def _put(self, key: str, data: bytes, content_type: str = "application/octet-stream",
             sha256: Optional[str] = None) -> tuple[str, bool]:
        """(sha256 hex, whether the store vouched for the bytes it kept: it echoed the sha256 it checked them
        against, or answered the ETag these bytes make). `sha256`: the digest when the caller has it already
        (a wrong one is refused by the server's check, never stored)."""
        digest = sha256 or hashlib.sha256(data).hexdigest()
        metadata: dict[str, str | list[str] | tuple[str]] = {"sha256": digest}
        checksum = base64.b64encode(bytes.fromhex(digest)).decode() if len(data) <= PART else None
        if checksum is not None:
            metadata["x-amz-checksum-sha256"] = checksum
        result = self._call(f"put {key}", lambda: self._client.put_object(
            self.bucket, key, io.BytesIO(data), len(data), content_type=content_type, metadata=metadata,
            part_size=PART,
        ))
        # A store that checked the sha256 says so in its answer; the MD5 of the ETag then adds nothing, and
        # it cost 73 ms of a 52 MB checkpoint here. A store that ignores the header gets the ETag comparison.
        if checksum is not None and checksum_echoed(getattr(result, "http_headers", None), checksum):
            return digest, True
        return digest, (result.etag or "").strip('"') == expected_etag(data)

    def get(self, key: str, sha256: Optional[str] = None) -> bytes:
        def fetch() -> bytes:
            resp = self._client.get_object(self.bucket, key)
            try:
                return bytes(resp.read())
            finally:
                resp.close()
                resp.release_conn()

        data = self._call(f"get {key}", fetch)
        if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
            raise IntegrityError(f"{self.bucket}/{key}: sha256 differs from the recorded {sha256[:12]}…")
        return data

    def put_verified(self, key: str, data: bytes, sha256: Optional[str] = None) -> str:
        """Write so that the object is known good before anyone is told about it: by the server's sha256 check
        (echoed in its answer) or the ETag it answers, or, where its ETags are no MD5s (encryption,
        compression), read back. `sha256`: the data's digest when the caller computed it already."""
        digest, etag_matches = self._put(key, data, sha256=sha256)
        if not etag_matches:
            self.get(key, sha256=digest)
        return digest

    def exists(self, key: str) -> bool:
        try:
            self._call(f"stat {key}", lambda: self._client.stat_object(self.bucket, key))
            return True
        except ObjectNotFound:
            return False

    def size(self, key: str) -> int:
        stat = self._call(f"stat {key}", lambda: self._client.stat_object(self.bucket, key))
        return int(stat.size or 0)

    def list(self, prefix: str = "", recursive: bool = True) -> list[str]:
        objs = self._call(f"list {prefix}", lambda: list(
            self._client.list_objects(self.bucket, prefix=prefix, recursive=recursive)))
        return sorted(o.object_name for o in objs if o.object_name is not None)

    def usage(self, prefix: str) -> tuple[int, int]:
        """(objects, bytes) under `prefix`."""
        objs = self._call(f"list {prefix}", lambda: list(self._client.list_objects(self.bucket, prefix=prefix,
                                                                                    recursive=True)))
        return len(objs), sum(int(o.size or 0) for o in objs)

    def iter_list(self, prefix: str = "") -> Iterator[str]:
        yield from self.list(prefix)

    def delete(self, key: str) -> None:
        self._call(f"delete {key}", lambda: self._client.remove_object(self.bucket, key))
