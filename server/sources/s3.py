"""`s3://bucket/prefix` through boto3: AWS S3 and S3-compatible stores (MinIO, Ceph...).

- Credentials: boto3's standard chain (environment, profile, instance role); the config holds
  only where to connect (endpoint_url, region) and how (pool, timeouts, retries).
- Retries: botocore retries requests (503 SlowDown, 5xx, resets) with backoff, at most
  `max_attempts` requests in all. A body that breaks off mid-read is not covered by that, so
  a GET whose body breaks is repeated here, up to `max_attempts` GETs. What still fails is
  StorageUnavailable when the store did not answer (the client asks another server) and
  StorageError when it answered no (missing, forbidden: DATA_LOSS).
- Objects come through the disk cache (cache.py): an epoch after the first reads local files.
  Cache entries are keyed by URL and ETag, so a changed object is fetched again.
- Every GET of a listed object carries If-Match with the ETag it was listed with: an object
  overwritten since answers 412, which is DataChanged, never the new bytes under the old name.
- Large objects are fetched as parallel ranged GETs of `range_bytes`.
- prefetch(keys) fills the cache from a thread pool, at most `prefetch_bytes` in flight;
  a read of a key being prefetched waits for that fetch instead of starting another.

Threading contract: every method may be called from any thread.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import boto3
import botocore.exceptions as bx
from botocore.config import Config as BotoConfig

from ._listing import Listing, ObjectInfo
from .cache import DiskCache
from .storage import DataChanged, StorageError, StorageUnavailable, glob_regex

log = logging.getLogger("stoker.server")
T = TypeVar("T")

# Errors reading a response body: botocore retries requests, not these.
_BODY_ERRORS = (bx.ResponseStreamingError, bx.IncompleteReadError, bx.ReadTimeoutError,
                bx.ConnectionClosedError, bx.EndpointConnectionError, ConnectionError)
_MISSING = {"404", "NoSuchKey", "NotFound"}
_CHANGED = {"412", "PreconditionFailed"}
_TRANSIENT = {"SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout",
              "Throttling", "ThrottlingException", "RequestTimeTooSkewed"}
# No answer at all, after botocore's retries: the network or the store is down.
_NETWORK_ERRORS = (bx.HTTPClientError, bx.ConnectionError, bx.IncompleteReadError,
                   ConnectionError)


class _BrokenBody(Exception):
    """A GET whose headers arrived but whose body did not, whole."""


class S3Storage:
    def __init__(self, url: str, settings: Any, cache: DiskCache | None,
                 prefetch_bytes: int = 0) -> None:
        if cache is None:
            raise StorageError(f"{url}: s3 sources need the disk cache (cache: in the config)")
        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        if not bucket:
            raise StorageError(f"{url}: no bucket name")
        self.url = url.rstrip("/")
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.settings = settings
        self.cache = cache
        self.prefetch_bytes = prefetch_bytes
        threads = max(settings.range_concurrency, 8)
        session = boto3.session.Session(profile_name=settings.profile,
                                        region_name=settings.region)
        self.client = session.client("s3", endpoint_url=settings.endpoint_url, config=BotoConfig(
            max_pool_connections=settings.max_pool_connections or 2 * threads + 4,
            connect_timeout=settings.connect_timeout, read_timeout=settings.read_timeout,
            retries={"total_max_attempts": settings.max_attempts, "mode": settings.retry_mode},
            s3={"addressing_style": "path"} if settings.endpoint_url else None,
            tcp_keepalive=True))
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, "stoker-s3")
        self._lock = threading.Lock()
        # From list(): what a read needs to find the cache entry without a HEAD request.
        self._known: dict[str, tuple[str, int]] = {}
        # As first listed (the fingerprint's view; GETs send its ETag as If-Match).
        self.listed = Listing()
        self._inflight: dict[str, concurrent.futures.Future[Path]] = {}
        self._inflight_bytes = 0

    # -- the Storage interface -------------------------------------------------------------
    def list(self, pattern: str | None = None) -> list[ObjectInfo]:
        match = glob_regex(pattern).match if pattern else None
        start = f"{self.prefix}/" if self.prefix else ""
        found = []
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=start)
        try:
            for page in pages:
                for obj in page.get("Contents", ()):
                    key = obj["Key"][len(start):]
                    if key and not key.endswith("/") and (match is None or match(key)):
                        found.append(ObjectInfo(key, obj["Size"], obj["ETag"].strip('"')))
        except bx.ClientError as e:
            raise StorageError(f"{self.url}: cannot list: {_describe(e)}") from None
        except bx.BotoCoreError as e:
            raise StorageError(f"{self.url}: cannot list: {e}") from None
        with self._lock:
            self._known.update((o.key, (o.version, o.size)) for o in found)
            self.listed.update(found)
        return sorted(found, key=lambda o: o.key)

    def info(self, key: str) -> ObjectInfo:
        with self._lock:
            known = self._known.get(key)
        if known:
            return ObjectInfo(key, known[1], known[0])
        head = self._retrying(key, lambda: self.client.head_object(
            Bucket=self.bucket, Key=self._key(key)))
        info = ObjectInfo(key, head["ContentLength"], head["ETag"].strip('"'))
        with self._lock:
            self._known[key] = (info.version, info.size)
            self.listed.add(info)
        return info

    def read(self, key: str) -> bytes:
        info = self.info(key)
        fut = self._inflight_fetch(key)
        if fut is not None:
            fut.result()  # a prefetch is fetching it; its errors are ours too
        return self.cache.read(self.where(key), info.version,
                               lambda fd: self._download(key, info.size, fd))

    def read_range(self, key: str, start: int, length: int) -> bytes:
        end = start + length - 1
        return self._retrying(key, lambda: self._get(key, f"bytes={start}-{end}", length))

    def local_path(self, key: str) -> Path:
        info = self.info(key)
        fut = self._inflight_fetch(key)
        if fut is not None:
            return fut.result()
        return self.cache.get(self.where(key), info.version,
                              lambda fd: self._download(key, info.size, fd))

    def prefetch(self, keys: Iterable[str]) -> None:
        if self.cache.degraded:  # nowhere to keep what it would fetch: reads fetch their own
            return
        for key in keys:
            with self._lock:
                known = self._known.get(key)
                if (known is None or key in self._inflight
                        or self._inflight_bytes + known[1] > self.prefetch_bytes):
                    continue
                version, size = known
                if self.cache.entry(self.where(key), version).exists():
                    continue
                self._inflight_bytes += size
                fut = self._pool.submit(self.cache.get, self.where(key), version,
                                        functools.partial(self._download, key, size))
                self._inflight[key] = fut
            fut.add_done_callback(functools.partial(self._settled, key, size))

    def verify(self, keys: Iterable[str]) -> None:
        pass  # cache entries are keyed by ETag, and GETs send If-Match: nothing can drift

    def where(self, key: str) -> str:
        return f"{self.url}/{key}"

    # -- helpers ---------------------------------------------------------------------------
    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _inflight_fetch(self, key: str) -> concurrent.futures.Future[Path] | None:
        with self._lock:
            return self._inflight.get(key)

    def _settled(self, key: str, size: int, fut: concurrent.futures.Future[Path]) -> None:
        with self._lock:
            self._inflight.pop(key, None)
            self._inflight_bytes -= size
        if fut.exception() is not None:  # the read that needs it will fail and say why
            log.debug("prefetch of %s failed: %s", self.where(key), fut.exception())

    def _get(self, key: str, byte_range: str | None, expect: int) -> bytes:
        kwargs = {"Range": byte_range} if byte_range else {}
        listed = self.listed.get(key)
        if listed is not None:
            kwargs["IfMatch"] = f'"{listed.version}"'
        # The request itself: botocore has retried it already when this raises.
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self._key(key),
                                          **kwargs)["Body"]
        except bx.ClientError as e:
            if listed is not None and _code(e) in _CHANGED:
                raise DataChanged(key, "overwritten",
                                  f"its ETag is no longer {listed.version}") from None
            raise
        try:
            with body:
                data = body.read()
        except _BODY_ERRORS as e:
            raise _BrokenBody(f"{type(e).__name__}: {e}") from None
        if len(data) != expect:
            raise _BrokenBody(f"got {len(data)} bytes of {expect}")
        return data

    def _download(self, key: str, size: int, fd: int) -> None:
        """Write the object into `fd`: one GET, or parallel ranges for a large object."""
        step = int(self.settings.range_bytes)
        if size <= step:
            _pwrite_all(fd, self._retrying(key, lambda: self._get(key, None, size)), 0)
            return

        def part(start: int) -> None:
            n = min(step, size - start)
            data = self._retrying(key, lambda: self._get(
                key, f"bytes={start}-{start + n - 1}", n))
            _pwrite_all(fd, data, start)

        # Not self._pool: a prefetch running there must not wait on its own pool's slots.
        with concurrent.futures.ThreadPoolExecutor(self.settings.range_concurrency) as parts:
            for f in [parts.submit(part, s) for s in range(0, size, step)]:
                f.result()

    def _retrying(self, key: str, call: Callable[[], T]) -> T:
        """call(), repeating a GET whose body broke off. What is left after botocore's own
        retries: a missing or forbidden object is StorageError (any server would fail it
        too: DATA_LOSS); an outage (no connection, 5xx, throttling, bodies that keep
        breaking) is StorageUnavailable (another server, or a later try, may succeed)."""
        attempts = self.settings.max_attempts
        for attempt in range(1, attempts + 1):
            try:
                return call()
            except bx.ClientError as e:
                if _code(e) in _MISSING:
                    raise StorageError(f"{self.where(key)}: no such object") from None
                if _transient(e):
                    raise StorageUnavailable(f"{self.where(key)}: {_describe(e)} (after "
                                             f"{attempts} attempts)") from None
                raise StorageError(f"{self.where(key)}: {_describe(e)}") from None
            except _BrokenBody as e:
                if attempt == attempts:
                    raise StorageUnavailable(f"{self.where(key)}: response body broke off: "
                                             f"{e} (after {attempts} attempts)") from None
                # Full jitter, as botocore's own backoff: 0..min(20 s, 0.1 s * 2^attempt).
                time.sleep(random.uniform(0, min(20.0, 0.1 * 2 ** attempt)))
            except _NETWORK_ERRORS as e:  # retried by botocore already
                raise StorageUnavailable(f"{self.where(key)}: {type(e).__name__}: {e} "
                                         f"(after {attempts} attempts)") from None
            except bx.BotoCoreError as e:  # credentials, configuration: not an outage
                raise StorageError(f"{self.where(key)}: {type(e).__name__}: {e}") from None
        raise AssertionError("unreachable")


def _transient(e: bx.ClientError) -> bool:
    """An answer that says "not now" rather than "no": 5xx, throttling, request timeouts."""
    status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
    return status >= 500 or status == 429 or _code(e) in _TRANSIENT


def _code(e: bx.ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


def _describe(e: bx.ClientError) -> str:
    err = e.response.get("Error", {})
    status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return f"{err.get('Code', 'error')} (HTTP {status}): {err.get('Message', '')}".rstrip(": ")


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    """pwrite until every byte is written: on a disk that is filling up a write can be short
    (the next one raises ENOSPC), and a short one unchecked leaves a truncated cache entry."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n
