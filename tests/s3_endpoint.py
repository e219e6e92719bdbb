"""A real S3 endpoint for tests (moto in server mode, a child process) and a fault proxy.

    moto_endpoint  (session fixture)   a MotoServer; .url is http://127.0.0.1:PORT
    fault_proxy    (function fixture)  a FaultProxy in front of it; .url, .schedule, counters
    s3_client(url, ...)                a boto3 client for either, path-style, dummy credentials
    s3_env(url)                        the environment a stoker server child needs to reach it

Faults are chosen by a schedule, a function of the request (its global number, method, key,
range and how many times that same request was seen), never by chance, so every run injects
the same faults:

    proxy.schedule = first(2, THROTTLE)        # the first 2 GETs of each object (or range)
    proxy.schedule = fraction(0.3, [THROTTLE, DROP], seed=1)
    proxy.schedule = always(ERROR)             # permanent failure

A test module imports the fixtures (`from s3_endpoint import fault_proxy_fixture,
moto_endpoint_fixture  # noqa: F401`), or conftest.py does that for every module.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
REGION = "us-east-1"


def s3_env(endpoint: str | None = None) -> dict[str, str]:
    """Environment variables for a process that talks to the test endpoint: dummy
    credentials, no metadata-service probe, no user config files, no HTTP proxy for loopback.
    With `endpoint`, also AWS_ENDPOINT_URL_S3 (an explicit endpoint_url still wins over it)."""
    env = {**CREDENTIALS, "AWS_DEFAULT_REGION": REGION, "AWS_EC2_METADATA_DISABLED": "true",
           "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
           "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
    if endpoint:
        env["AWS_ENDPOINT_URL_S3"] = endpoint
    return env


def s3_client(endpoint: str, *, attempts: int = 1, connect_timeout: float = 5.0,
              read_timeout: float = 10.0, **config: Any) -> Any:
    """A boto3 S3 client for `endpoint`, path-style. `attempts` counts the first one too
    (botocore's total_max_attempts; its `max_attempts` counts retries only): with 1, botocore
    does not retry, so a test sees each injected fault as an exception."""
    import boto3
    from botocore.config import Config

    return boto3.session.Session(**{
        "aws_access_key_id": CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        "region_name": REGION}).client(
        "s3", endpoint_url=endpoint, config=Config(
            s3={"addressing_style": "path"}, connect_timeout=connect_timeout,
            read_timeout=read_timeout, retries={"total_max_attempts": attempts, "mode": "standard"},
            **config))


# -- moto, in its own process ----------------------------------------------------------------

class MotoServer:
    """`python -m moto.server` on a free loopback port (it binds port 0 and prints the port)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self.lines: list[str] = []  # what it printed, for failure messages
        self._port = threading.Event()
        self._reader: threading.Thread | None = None

    def start(self, timeout: float = 30.0) -> MotoServer:
        env = {**os.environ, **s3_env(), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "0"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + timeout
        if not self._port.wait(timeout) or not self.url:
            self.stop()
            raise RuntimeError("moto server did not print its address\n" + "".join(self.lines))
        # It prints the address once it listens; probe the API anyway, with the same deadline.
        pause = threading.Event()
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/moto-api/data.json", timeout=5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError("moto server did not answer\n" + "".join(self.lines))
            pause.wait(0.05)

    def reset(self) -> None:
        """Forget every bucket and object."""
        req = urllib.request.Request(f"{self.url}/moto-api/reset", method="POST")
        with urllib.request.urlopen(req, timeout=10):
            pass

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._reader is not None:
            self._reader.join(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            # werkzeug logs every request here: keep the start and the last lines only.
            if len(self.lines) > 400:
                del self.lines[50:250]
            self.lines.append(line)
            m = re.search(r"Running on (http://127\.0\.0\.1:\d+)", line)
            if m and not self.url:
                self.url = m.group(1)
                self._port.set()
        self._port.set()  # exited: start() reports it


# -- faults ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Fault:
    """throttle: 503 SlowDown. error: 500 InternalError. drop: the connection closes with no
    response. truncate: full headers, then half the body, then the connection closes.
    slow: the response waits `delay` seconds before its first byte."""

    kind: str
    delay: float = 0.0


THROTTLE = Fault("throttle")
ERROR = Fault("error")
DROP = Fault("drop")
TRUNCATE = Fault("truncate")


def slow(seconds: float) -> Fault:
    return Fault("slow", seconds)


@dataclass(frozen=True)
class Request:
    number: int  # 1-based, over every request the proxy saw
    method: str
    bucket: str
    key: str  # the object key, '' for a bucket-level request (list)
    range: str  # the Range header, '' if none
    attempt: int  # 1-based: how often this (method, bucket, key, range) was seen, this included
    query: str


Schedule = Callable[[Request], Fault | None]


def never(req: Request) -> Fault | None:
    return None


def always(fault: Fault) -> Schedule:
    """Every request fails: a permanent outage."""
    return lambda req: fault


def _matches(req: Request, method: str | None, key: str | None) -> bool:
    if method is not None and req.method != method:
        return False
    if key is None:
        return True
    return req.key == key


def first(k: int, fault: Fault, *, method: str | None = "GET", key: str | None = None
          ) -> Schedule:
    """The first `k` attempts of each matching request (same method, key and range) fail;
    method None: any method (list and head too); key None: any key."""
    return lambda req: fault if _matches(req, method, key) and req.attempt <= k else None


def nth(numbers: set[int] | Sequence[int], fault: Fault) -> Schedule:
    """The requests with these global numbers fail (for one client issuing requests in turn)."""
    chosen = frozenset(numbers)
    return lambda req: fault if req.number in chosen else None


def fraction(p: float, faults: Fault | Sequence[Fault], *, seed: int = 0,
             method: str | None = "GET", max_attempt: int = 1) -> Schedule:
    """About a fraction `p` of the matching requests fail, chosen by a hash of (seed, method,
    key, range, attempt), not the bucket's name: the same requests on every run, whatever the
    threads' order. Only
    attempts up to `max_attempt` can fail, so a client with more attempts always gets through."""
    kinds = [faults] if isinstance(faults, Fault) else list(faults)

    def schedule(req: Request) -> Fault | None:
        if not _matches(req, method, None) or req.attempt > max_attempt:
            return None
        h = hashlib.sha256(f"{seed}|{req.method}|{req.key}|{req.range}|"
                           f"{req.attempt}".encode()).digest()
        if int.from_bytes(h[:8], "big") / 2**64 >= p:
            return None
        return kinds[h[8] % len(kinds)]

    return schedule


def any_of(*schedules: Schedule) -> Schedule:
    """The first fault any of `schedules` picks."""
    def schedule(req: Request) -> Fault | None:
        for s in schedules:
            fault = s(req)
            if fault is not None:
                return fault
        return None

    return schedule


# -- the proxy -------------------------------------------------------------------------------

# Hop-by-hop headers are the proxy's own business on each side; everything else passes as is.
# Host passes unchanged: SigV4 signed the Host the client saw (the proxy's address).
# Expect is not signed (botocore leaves it out); the proxy answers 100-continue itself.
_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "te", "trailer",
                  "transfer-encoding", "upgrade", "expect"})

_MESSAGES = {"throttle": (503, "SlowDown", "Please reduce your request rate."),
             "error": (500, "InternalError",
                       "We encountered an internal error. Please try again.")}


class FaultProxy:
    """An HTTP/1.1 keep-alive proxy in a thread of the test process, in front of `upstream`.

    Counters (read them after the requests finished): `requests` (all requests),
    `faults` (a Counter by kind), `connections` (client connections accepted), `seen`
    (every Request with the fault it got, in arrival order). `schedule` may be replaced at any
    time; `reset()` clears the counters and the attempt numbering.
    """

    def __init__(self, upstream: str, schedule: Schedule = never) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.schedule = schedule
        self.requests = 0
        self.connections = 0
        self.faults: Counter[str] = Counter()
        self.seen: list[tuple[Request, Fault | None]] = []
        self.errors: list[str] = []  # exceptions in handler threads (clients that hung up...)
        self._attempts: Counter[tuple[str, str, str, str]] = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sockets: set[socket.socket] = set()
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.proxy = self
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.05}, daemon=True)

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop: waiting slow responses end at once, open connections are cut."""
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            socks = list(self._sockets)
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        self._thread.join(10)

    def reset(self) -> None:
        with self._lock:
            self.requests = self.connections = 0
            self.faults.clear()
            self.seen.clear()
            self._attempts.clear()

    def requests_for(self, key: str, method: str | None = "GET") -> list[Request]:
        with self._lock:
            return [r for r, _ in self.seen if r.key == key
                    and (method is None or r.method == method)]

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- called from handler threads --
    def _admit(self, method: str, path: str, headers: Mapping[str, str]) -> tuple[Request,
                                                                                   Fault | None]:
        url = urlsplit(path)
        bucket, _, key = unquote(url.path).lstrip("/").partition("/")
        rng = headers.get("Range", "") or ""
        with self._lock:
            self.requests += 1
            ident = (method, bucket, key, rng)
            self._attempts[ident] += 1
            req = Request(self.requests, method, bucket, key, rng, self._attempts[ident],
                          url.query)
            fault = self.schedule(req)
            if fault is not None:
                self.faults[fault.kind] += 1
            self.seen.append((req, fault))
        return req, fault

    def _track(self, sock: socket.socket, add: bool) -> None:
        with self._lock:
            if add:
                self._sockets.add(sock)
                self.connections += 1
            else:
                self._sockets.discard(sock)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    proxy: FaultProxy

    def handle_error(self, request: Any, client_address: Any) -> None:
        self.proxy.errors.append(repr(sys.exc_info()[1]))


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as S3 clients expect
    timeout = 60  # an idle client connection ends after this
    server: _Server

    def setup(self) -> None:
        super().setup()
        self.proxy = self.server.proxy
        self.upstream: http.client.HTTPConnection | None = None
        self.proxy._track(self.connection, True)

    def finish(self) -> None:
        self.proxy._track(self.connection, False)
        if self.upstream is not None:
            self.upstream.close()
        with contextlib.suppress(OSError):
            super().finish()

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def relay(self) -> None:
        body = self._read_body()
        _, fault = self.proxy._admit(self.command, self.path, self.headers)
        kind = fault.kind if fault else None
        if fault is not None and fault.kind == "slow" and self.proxy._stop.wait(fault.delay):
            kind = "drop"  # the proxy is closing
        if kind in _MESSAGES:
            self._send_error(*_MESSAGES[kind])
            return
        if kind == "drop":
            self._hang_up()
            return
        resp = self._forward(body)
        length = resp.getheader("Content-Length")
        data = None
        if length is None and self.command != "HEAD" and resp.status not in (204, 304):
            data = resp.read()  # chunked upstream: send it on with a length
            length = str(len(data))
        self.send_response_only(resp.status, resp.reason)
        for name, value in resp.getheaders():
            if name.lower() not in _HOP and not (data is not None
                                                 and name.lower() == "content-length"):
                self.send_header(name, value)
        if data is not None:
            self.send_header("Content-Length", length)
        self.end_headers()
        if self.command == "HEAD":
            resp.read()
            return
        todo = int(length or 0)
        if kind == "truncate":
            todo //= 2
        if data is not None:
            self.wfile.write(data[:todo])
        else:
            while todo > 0:
                chunk = resp.read(min(todo, 1 << 16))
                if not chunk:
                    break
                self.wfile.write(chunk)
                todo -= len(chunk)
        if kind == "truncate" or todo > 0 or resp.will_close:
            self.upstream.close()  # type: ignore[union-attr]  # the rest is not read
            self.upstream = None
            if kind == "truncate" or todo > 0:
                self._hang_up()

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = relay

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            parts = []
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _forward(self, body: bytes) -> http.client.HTTPResponse:
        for fresh in (self.upstream is None, True):
            if self.upstream is None or fresh:
                if self.upstream is not None:
                    self.upstream.close()
                self.upstream = http.client.HTTPConnection(*self.proxy.upstream, timeout=60)
            conn = self.upstream
            try:
                conn.putrequest(self.command, self.path, skip_host=True,
                                skip_accept_encoding=True)
                for name, value in self.headers.items():
                    if name.lower() not in _HOP and name.lower() != "content-length":
                        conn.putheader(name, value)
                if body or self.command in ("PUT", "POST"):
                    conn.putheader("Content-Length", str(len(body)))
                conn.endheaders(body or None)
                return conn.getresponse()
            except (ConnectionError, http.client.HTTPException):
                if fresh:
                    raise
                # a kept-alive upstream connection that the server had closed: one new try
        raise AssertionError("unreachable")

    def _send_error(self, status: int, code: str, message: str) -> None:
        n = self.proxy.requests
        xml = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
               f"<Message>{message}</Message><RequestId>fault-{n}</RequestId>"
               f"<HostId>stoker-fault-proxy</HostId></Error>").encode()
        self.send_response_only(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("x-amz-request-id", f"fault-{n}")
        self.send_header("Content-Length", "0" if self.command == "HEAD" else str(len(xml)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(xml)

    def _hang_up(self) -> None:
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.wfile.flush()
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)


# -- fixtures --------------------------------------------------------------------------------

# Named with `name=`: a module imports `moto_endpoint_fixture` and its tests take
# `moto_endpoint`, with no import shadowed by a parameter (ruff F811).
@pytest.fixture(scope="session", name="moto_endpoint")
def moto_endpoint_fixture() -> Iterator[MotoServer]:
    """One moto server for the session; this process gets the dummy credentials too (boto3
    clients made in tests use the standard chain, as the server's code does)."""
    with pytest.MonkeyPatch.context() as mp:
        for name, value in s3_env().items():
            mp.setenv(name, value)
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL",
                     "AWS_ENDPOINT_URL_S3"):
            mp.delenv(name, raising=False)
        server = MotoServer().start()
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture(name="fault_proxy")
def fault_proxy_fixture(moto_endpoint: MotoServer) -> Iterator[FaultProxy]:
    """A fresh proxy in front of the session's moto server, no faults until told."""
    with FaultProxy(moto_endpoint.url) as proxy:
        yield proxy


_buckets = iter(range(1, 1 << 30))


def new_bucket(client: Any, prefix: str = "stoker") -> str:
    """Create a bucket with a name no other test of this session's moto server uses."""
    name = f"{prefix}-{next(_buckets)}"
    client.create_bucket(Bucket=name)
    return name


def put_objects(client: Any, bucket: str, objects: Mapping[str, bytes]) -> None:
    """Upload `objects` (key -> bytes) with a few threads (boto3 clients are thread-safe)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        for f in [pool.submit(client.put_object, Bucket=bucket, Key=k, Body=v)
                  for k, v in objects.items()]:
            f.result()
