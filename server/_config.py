"""The server's YAML config, validated with pydantic.

A bad config is reported as `config error in FILE: FIELD.PATH: what was expected` for each
problem, and the server exits non-zero before opening any port. Each format's `datasets:` model
lives with its reader (server/formats/, listed in formats.FORMATS); what they share, in
formats/config_base.py.
"""

from __future__ import annotations

import difflib
import os
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Union

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ByteSize,
    Field,
    Tag,
    ValidationError,
    model_validator,
)

from .formats import config_models
from .formats.config_base import ConfigPath, DatasetBase, RelativeToConfig, S3Settings, Strict

# Frames must stay well under the client's receive limit (see stoker.client).
MAX_FRAME_BYTES = 32 << 20


class ConfigError(Exception):
    """A config that cannot be served; the message names the file and the field path."""


class CacheSettings(Strict):
    """The disk cache for remote objects: shared by a server's workers, kept across restarts.

    Attributes:
        dir: The cache's folder (default `$XDG_CACHE_HOME/stoker` or `~/.cache/stoker`); relative
            paths are relative to the config file.
        max_bytes: The disk cache's size, >= 1 MiB; least recently used entries go first past it.
        prefetch_bytes: Per worker: objects fetched ahead of the batches that need them, at most
            this many bytes in flight; 0 turns prefetch off.
        decoded_bytes: The prefix cache's memory tier, in `/dev/shm`: what each pipeline computes
            before its first random step (decoded and resized pixels, a python dataset's `prepare`),
            kept across epochs and jobs, shared by the server's workers; least recently used entries
            go first (to the disk tier, if any). 0: nothing kept in memory.
        spill_bytes: The prefix cache's disk tier: entries evicted from memory are kept here, up to
            this; 0: they are dropped.
        spill_dir: The disk tier's folder, on local disk; each server keeps its own sub-folder
            `stoker-prefix-<pid>`.
        shared_batches: >= 0; shared memory the kept batches may take in all (each counted at its
            segment's size, a multiple of 64 KiB), in effect at most 1/8 of `/dev/shm` and 1,024
            batches, and 1/16 of it for the batches of coordinates only one stream has asked for;
            the oldest go first past it (among the 16 oldest, one the same worker built, whose
            segment it then reuses); `0` keeps none (builds in flight are still shared).
        shared_seconds: > 0, <= 3600; how long a built batch is kept after its build.
    """

    dir: ConfigPath = Field(default_factory=lambda: Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "stoker")
    max_bytes: ByteSize = Field(ByteSize(20 << 30), ge=1 << 20, description="e.g. 50GiB")
    # Objects each worker fetches ahead of the batches that need them (the epoch's order is
    # known), at most this many bytes in flight.
    prefetch_bytes: ByteSize = Field(ByteSize(256 << 20), ge=0)
    # -- issue 17, the prefix cache (server/sources/prefix_cache.py): what each pipeline computes
    # before its first random step (decoded, resized pixels; a python dataset's `prepare`),
    # kept across epochs and jobs, shared by the workers. 0: none kept in memory.
    decoded_bytes: ByteSize = Field(ByteSize(0), ge=0, description="in /dev/shm, e.g. 8GiB")
    # Entries evicted from memory go to disk, up to spill_bytes (0: they are dropped).
    spill_bytes: ByteSize = Field(ByteSize(0), ge=0, description="e.g. 100GiB")
    spill_dir: ConfigPath | None = Field(None, description="local disk; default: dir/prefix")
    # -- issue 17, batches shared across jobs (server/front/shared_batches.py): requests in flight
    # for the same coordinates and batch index always wait for one build; a batch built is
    # also kept this many bytes of shared memory (at most 1/8 of /dev/shm) for this many
    # seconds, for the jobs of a sweep that ask for it a little later. 0 bytes: no keeping.
    shared_batches: ByteSize = Field(ByteSize(256 << 20), ge=0, description="e.g. 1GiB; 0: off")
    shared_seconds: float = Field(30.0, gt=0, le=3600)
    # -- end of "batches shared across jobs"


# One model a format, told apart by `format:`; in FORMATS order, which the error for an unknown
# format lists. The union is built from FORMATS at run time, which a type checker cannot
# follow: it sees what every member has, DatasetBase.
if TYPE_CHECKING:
    DatasetConfig = DatasetBase
else:
    DatasetConfig = Annotated[Union[tuple(config_models())],  # noqa: UP007
                              Field(discriminator="format")]


def _readable_file(v: Path) -> Path:
    if not v.is_file():
        raise ValueError(f"not a file: {v}")
    return v


ReadableFile = Annotated[Path, AfterValidator(_readable_file), RelativeToConfig]


class TlsSettings(Strict):
    """TLS on the gRPC and HTTP ports (PEM files, read at start; relative paths are relative
    to the config file). With `client_ca_file`, clients must present a certificate it signed
    (mutual TLS), on both ports.

    Attributes:
        cert_file: The server's certificate chain, PEM; relative to the config file.
        key_file: Its private key, PEM; a pair that does not load stops the start naming both files.
        client_ca_file: CA certificates, PEM: set, clients must present a certificate one of them
            signed (mutual TLS), on the gRPC and the HTTP port.
    """

    cert_file: ReadableFile = Field(description="the server's certificate chain (PEM)")
    key_file: ReadableFile = Field(description="its private key (PEM)")
    client_ca_file: ReadableFile | None = Field(
        None, description="CA certificates (PEM) for client certificates; set: mutual TLS")


class GrantSettings(Strict):
    """Who may use which datasets (issue 41): one credential, a bearer token read from
    `token_file` or, under mutual TLS, a client certificate identity (`client_cert`: its
    subject as `CN=...` or the whole RFC 4514 subject, or a subject alternative name such as
    `DNS:trainer-b` or `URI:spiffe://...`), and the datasets it may read ("*": all).
    `operator`: it may also read /v1/stats, /v1/datasets and /metrics. `name` goes to logs
    and metrics, never the token.

    Attributes:
        name: 1-64 of `A-Za-z0-9_.-`; names the grant in logs and metrics
            (`stoker_grant_streams_total{grant=...}`), never its token.
        token_file: A file holding this grant's bearer token (one line, >= 16 characters, no
            spaces), relative to the config file.
        client_cert: Instead of a token, under mutual TLS (`tls.client_ca_file`): the client
            certificate identity, `CN=trainer-b` (its common name), the whole subject
            `CN=trainer-b,O=team-b`, or a subject alternative name `DNS:trainer-b.svc`,
            `URI:spiffe://...`, `email:...`, `IP:...`.
        datasets: The datasets it may read; `"*"`: all.
        operator: It may also read `/metrics`, `/v1/stats`, `/v1/datasets` and the live page `/`
            (they name every dataset).
    """

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    token_file: ReadableFile | None = None
    client_cert: str | None = Field(None, min_length=3)
    datasets: list[str] = Field(min_length=1)
    operator: bool = False

    @model_validator(mode="after")
    def _one_credential(self) -> GrantSettings:
        if (self.token_file is None) == (self.client_cert is None):
            raise ValueError("give token_file or client_cert (one credential per grant)")
        return self


class ServerSettings(Strict):
    """The server's own settings: ports, workers and the limits that protect it (`server:`).

    Attributes:
        host: Address both ports bind to; `0.0.0.0` for all IPv4 interfaces.
        port: 0-65535; the gRPC port. 0: any free port (the ready line says which).
        http_port: 0-65535; the HTTP control plane: `/healthz`, `/readyz`, `/metrics`,
            `/v1/datasets`, `/v1/stats` (operations.md). 0: any free port.
        data_port: 0-65535; the TCP port of the data connections: clients on other machines receive
            batches there, beside gRPC (`RemoteLoader(data_socket=True)`, the default), under the
            same TLS and token. 0: any free port; the stream tells the client.
        workers: >= 1; worker processes. null: one per CPU this process may run on
            (`os.sched_getaffinity`).
        max_credits: 1-4096; credits one stream may have outstanding.
        frame_bytes: 4096-33554432 (32 MiB); the most payload bytes one `BatchFrame` carries.
        grace_seconds: >= 0; on SIGTERM/SIGINT the server drains: credits received from then on are
            refused in-band (UNAVAILABLE: clients ask other servers), batches asked for before are
            finished.
        shared_memory: Clients on this host under the same user, without a plain data connection
            (`data_socket=False`, or a TLS data port), read batches from the workers' shared memory
            instead of through gRPC (protocol); `false`: never.
        tls: TLS on the gRPC, data and HTTP ports (TlsSettings); null: plain TCP (a trusted network
            only).
        auth_token_file: A file holding the bearer token (one line, >= 16 characters, no spaces;
            read at start, never logged) that every gRPC call but health Check and every HTTP
            request but `/healthz` and `/readyz` must carry.
        auth_token_env: Instead: the name of an environment variable holding the token; it must be
            set when the config is loaded.
        grants: Access per dataset: each entry a credential (a bearer token from `token_file`, or
            under mutual TLS a `client_cert` identity) and the `datasets` it may read; keys below
            and security.md.
        redact_paths: Error messages sent to clients (a corrupt sample's DATA_LOSS, an INTERNAL) cut
            every server path and URL to its last part, `.../shard-00004.bin`; the server's log
            keeps them whole.
        max_streams_per_client: 1-65536; `StreamBatches` and `Health/Watch` calls one client address
            (port aside) may have open, together.
        max_batch_bytes: >= 1 KiB; a batch whose payload would be larger fails in-band
            (RESOURCE_EXHAUSTED naming the limit), before memory is taken for it; the stream goes
            on.
        max_request_bytes: 4 KiB-64 MiB; the largest request message the gRPC port accepts
            (`grpc.max_receive_message_length`); larger: RESOURCE_EXHAUSTED.
        batch_timeout_seconds: > 0, <= 86400; a batch a worker has not built within this many
            seconds fails in-band (INTERNAL, naming the key, the worker's pid and the sample it was
            at; the client asks again, of another server if it has one) and the worker is killed and
            replaced (operations.md).
        max_streams: >= 1; batch streams open at once, all clients together.
        max_health_watches: >= 1; gRPC `Health/Watch` calls open at once, all clients together; one
            address's watches count in its `max_streams_per_client` too.
        max_held_bytes: >= 1 MiB; shared memory held by streams (batches built and not yet sent, or
            lent to same-host clients and not released), all clients together.
        max_held_bytes_per_client: >= 1 MiB; the same, per client address: a frozen client cannot
            pin more.
        max_order_cache_bytes: >= 0; legacy epoch orders (8 bytes a sample, one per dataset, seed
            and epoch in use: runs resumed from before index orders, and clients that name no order)
            kept in memory: a least-recently-used cache in bytes.
        max_http_connections: >= 1; HTTP connections open at once (uvicorn's `limit_concurrency`
            backs it).
        max_http_connections_per_client: >= 1; the same, per client address.
        http_header_timeout_seconds: > 0; time a connection has to send a request's head once
            connected or after its last response; then 408 naming the limit, and the connection is
            closed.
        max_grpc_connections: >= 1; gRPC connections open at once
            (`grpc.max_allowed_incoming_connections`); more are closed at accept (the client sees
            UNAVAILABLE and tries again or elsewhere).
        max_grpc_connections_per_client: >= 1; gRPC connections one client address (port aside) may
            have streams or health watches open on at once.
        silent_client_seconds: >= 3, <= 3600; a client that went silent (its host lost its network:
            no FIN, no RST) is let go within this time: its streams end, their credits, kept batches
            and lent shared memory are freed.
        grpc_handshake_timeout_seconds: > 0; time a gRPC connection has to finish its handshake
            (HTTP/2 preface, TLS; `grpc.server_handshake_timeout_ms`); then it is closed.
        grpc_idle_seconds: > 0; a gRPC connection without calls this long gets GOAWAY
            (`grpc.max_connection_idle_ms`); channels reconnect by themselves.
    """

    host: str = "127.0.0.1"
    port: int = Field(50051, ge=0, le=65535)
    http_port: int = Field(8080, ge=0, le=65535)
    # TCP port for data sockets (clients that ask send payloads there, beside gRPC); 0: any
    # free port (the stream tells the client which).
    data_port: int = Field(0, ge=0, le=65535)
    workers: int | None = Field(None, ge=1, description="worker processes; default one per core")
    # Credits one stream may hold at once: with the batch size, this bounds server memory.
    max_credits: int = Field(64, ge=1, le=4096)
    # 4 MiB less room for the frame's header: a frame then fits the 4 MiB receive limit that
    # gRPC clients have by default, so any gRPC client can read the stream unconfigured.
    frame_bytes: int = Field((4 << 20) - (64 << 10), ge=4096, le=MAX_FRAME_BYTES)
    grace_seconds: float = Field(10.0, ge=0)
    # Clients on this host (same user) read batches straight from shared memory: no copy
    # through gRPC. false: every batch goes over the socket.
    shared_memory: bool = True
    tls: TlsSettings | None = None
    # The bearer token every call must carry; from a file or an environment variable, never
    # from this file (configs get committed, printed and mounted where secrets should not be).
    auth_token_file: ReadableFile | None = None
    auth_token_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    # -- issue 41, grants: access per dataset (server/front/grants.py). Empty: every
    # credential above (the shared token, a certificate the client CA signed) opens every
    # dataset, as before. Given: a call must match a grant (or the shared token, which then
    # stays an operator credential for every dataset) and sees only its grant's datasets.
    grants: list[GrantSettings] = Field(default_factory=list)
    # Error messages sent to clients name no server path (a file's folders, a bucket's
    # prefix): each is cut to its last part, `.../name`. The server's log keeps them whole.
    redact_paths: bool = False
    # -- end of "grants"
    # Limits a client cannot talk its way past; each refusal names the limit and its value.
    max_streams_per_client: int = Field(64, ge=1, le=65536)
    max_batch_bytes: ByteSize = Field(ByteSize(2 << 30), ge=1 << 10)
    max_request_bytes: ByteSize = Field(ByteSize(1 << 20), ge=4 << 10, le=64 << 20)
    # -- issue 19, shm-watchdog: hung workers --
    # A batch a worker has not built within this many seconds fails (INTERNAL, in-band: the
    # client asks again) and the worker is killed and replaced. Below the client's own
    # timeout (300 s by default), so that the client hears of it before giving up.
    batch_timeout_seconds: float = Field(120.0, gt=0, le=86400)
    # -- issue 19, package "limits": bounded connections, streams and memory
    # (server/front/limits.py; each is a row of docs/security.md's Limits table, with the error
    # it gives).
    # Batch streams open at once, all clients together: each holds credits, a share of the
    # workers and, when asked, a data socket (one descriptor).
    max_streams: int = Field(1024, ge=1, le=1 << 20)
    # Health/Watch calls open at once, all clients together (one address's watches count in
    # its max_streams_per_client too): each is a call held open for its whole life.
    max_health_watches: int = Field(256, ge=1, le=1 << 20)
    # Shared memory held by streams (batches built and not yet sent or released), all clients
    # together; in effect at most 3/4 of /dev/shm, which the workers' own segments need too.
    max_held_bytes: ByteSize = Field(ByteSize(8 << 30), ge=1 << 20)
    # The same, per client address: a frozen client cannot pin more than this.
    max_held_bytes_per_client: ByteSize = Field(ByteSize(2 << 30), ge=1 << 20)
    # Epoch orders (8 bytes a sample) kept in memory, all datasets: an LRU in bytes; an order
    # larger than this is computed for each use and never kept.
    max_order_cache_bytes: ByteSize = Field(ByteSize(1 << 30), ge=0)
    # HTTP connections open at once (uvicorn's limit_concurrency backs it), and per address.
    max_http_connections: int = Field(256, ge=1, le=1 << 20)
    max_http_connections_per_client: int = Field(32, ge=1, le=1 << 20)
    # Seconds a connection has to complete a request's head (a half-sent head held a
    # descriptor for ever: uvicorn has no such timeout).
    http_header_timeout_seconds: float = Field(10.0, gt=0, le=3600)
    # gRPC connections open at once (grpc.max_allowed_incoming_connections): more are closed
    # at accept.
    max_grpc_connections: int = Field(512, ge=1, le=1 << 20)
    # gRPC connections one client address may have calls open on at once (gRPC has no
    # per-address cap: server/front/limits.py counts them by the calls' peers); a call on
    # one more connection: RESOURCE_EXHAUSTED naming this key.
    max_grpc_connections_per_client: int = Field(32, ge=1, le=1 << 20)
    # Seconds within which a client that went silent (its host gone, its network cut: no
    # FIN, no RST) is let go: its streams end, their credits, kept batches and shared
    # memory are freed. Keepalive pings, and TCP_USER_TIMEOUT on what was sent
    # (server/front/limits.py, grpc_options).
    silent_client_seconds: float = Field(40.0, ge=3, le=3600)
    # Seconds a gRPC connection has to finish its handshake (the HTTP/2 preface, TLS): silent
    # TCP connections are closed after this (gRPC's own default is 120 s).
    grpc_handshake_timeout_seconds: float = Field(10.0, gt=0, le=3600)
    # Seconds a gRPC connection may stay without calls before the server sends GOAWAY
    # (channels reconnect by themselves when next used).
    grpc_idle_seconds: float = Field(600.0, gt=0)
    # -- end of "limits"

    @model_validator(mode="after")
    def _one_token_source(self) -> ServerSettings:
        if self.auth_token_file is not None and self.auth_token_env is not None:
            raise ValueError("give auth_token_file or auth_token_env, not both")
        if self.auth_token_env is not None and not os.environ.get(self.auth_token_env):
            raise ValueError(f"auth_token_env: environment variable {self.auth_token_env} "
                             "is not set (or empty)")
        names = [g.name for g in self.grants]
        if len(set(names)) != len(names):
            raise ValueError(f"grants: names must differ (got {names})")
        if any(g.client_cert for g in self.grants) and (
                self.tls is None or self.tls.client_ca_file is None):
            raise ValueError("grants: a client_cert grant needs mutual TLS "
                             "(tls.client_ca_file)")
        return self

    @property
    def worker_count(self) -> int:
        return self.workers or len(os.sched_getaffinity(0))


class Config(Strict):
    """The whole config file: the server's settings, S3, the caches and the datasets.

    Attributes:
        server: The server's own settings (`server:`).
        s3: How to reach S3 (`s3:`), for every `s3://` source unless a dataset overrides it.
        cache: The disk cache and the caches of decoded samples and built batches (`cache:`).
        datasets: Name -> dataset config, its model chosen by `format:`; at least one.
    """

    server: ServerSettings = Field(default_factory=ServerSettings)
    s3: S3Settings = Field(default_factory=S3Settings)
    cache: CacheSettings = Field(default_factory=CacheSettings)
    datasets: dict[str, DatasetConfig] = Field(min_length=1)

    @model_validator(mode="after")
    def _among(self) -> Config:
        for name, cfg in self.datasets.items():  # a mixture's components, say
            cfg.check_among(name, self.datasets)
        for i, grant in enumerate(self.server.grants):
            unknown = [d for d in grant.datasets if d != "*" and d not in self.datasets]
            if unknown:
                raise ValueError(f"server.grants.{i}.datasets: {unknown} not among the "
                                 f"datasets ({', '.join(sorted(self.datasets))})")
        return self

    def s3_for(self, dataset: str) -> S3Settings:
        """The top-level s3: block with the dataset's own s3: fields laid over it."""
        own = getattr(self.datasets[dataset], "s3", None)
        if own is None:
            return self.s3
        return self.s3.model_copy(update=own.model_dump(exclude_unset=True))


def load_config(path: str | os.PathLike[str], **overrides: Any) -> Config:
    """Read and validate a config file; `overrides` (not None) replace `server:` settings."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(f"config error in {path}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config error in {path}: not UTF-8 text: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config error in {path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config error in {path}: expected a mapping with `datasets:` at the top")
    server = raw.get("server")
    if server is None:
        server = {}
    if isinstance(server, dict):  # anything else: validation names `server` below
        raw["server"] = {**server, **{k: v for k, v in overrides.items() if v is not None}}
    try:
        return Config.model_validate(raw, context={"base": path.resolve().parent})
    except ValidationError as e:
        lines = [f"config error in {path}:"]
        for err in e.errors():
            # A tagged union repeats its tag (transforms.0.resize.resize.size): say it once.
            parts = [str(p) for i, p in enumerate(err["loc"]) if i == 0 or p != err["loc"][i - 1]]
            loc = ".".join(parts) or "(top level)"
            got = repr(err.get("input"))
            got = got if len(got) <= 80 else got[:77] + "..."
            msg = err["msg"]
            if err["type"] == "extra_forbidden":
                msg += _did_you_mean(err["loc"])
            lines.append(f"  {loc}: {msg} (got {got})")
        raise ConfigError("\n".join(lines)) from None


# -- unknown keys: the valid keys where the typo is, and the closest of them -------------------
def _unwrap(t: Any) -> Any:
    """`t` without Annotated and without `| None`."""
    while True:
        if typing.get_origin(t) is Annotated:
            t = typing.get_args(t)[0]
        elif typing.get_origin(t) in (Union, types.UnionType) and type(None) in typing.get_args(t):
            rest = [a for a in typing.get_args(t) if a is not type(None)]
            if len(rest) != 1:
                return t
            t = rest[0]
        else:
            return t


def _member(union: Any, tag: Any) -> Any:
    """The member of a tagged union that an error's location names by `tag`: a transform's
    `Tag`, or a dataset's `format` literal."""
    for m in typing.get_args(union):
        if typing.get_origin(m) is Annotated and any(
                isinstance(x, Tag) and x.tag == tag for x in typing.get_args(m)[1:]):
            return m
        model = _unwrap(m)
        fmt = getattr(model, "model_fields", {}).get("format")
        if fmt is not None and tag in typing.get_args(fmt.annotation):
            return model
    return None


def _keys_at(loc: tuple[Any, ...]) -> list[str]:
    """The keys the model at `loc` (an error's location, less the unknown key) accepts; []
    where the location cannot be followed."""
    t: Any = Config
    for part in loc:
        t = _unwrap(t)
        if isinstance(t, type) and issubclass(t, BaseModel):
            field = t.model_fields.get(str(part))
            t = field.annotation if field is not None else None
        elif typing.get_origin(t) in (Union, types.UnionType):
            t = _member(t, part)
        elif typing.get_origin(t) in (dict, list, tuple):
            t = typing.get_args(t)[-1]
        else:
            return []
        if t is None:
            return []
    t = _unwrap(t)
    return sorted(t.model_fields) if isinstance(t, type) and issubclass(t, BaseModel) else []


def _did_you_mean(loc: tuple[Any, ...]) -> str:
    """"; did you mean 'options'?" for `option`, else the keys valid there."""
    keys = _keys_at(loc[:-1])
    if not keys:
        return ""
    close = difflib.get_close_matches(str(loc[-1]), keys, n=1, cutoff=0.6)
    if close:
        return f"; did you mean {close[0]!r}?"
    return f"; expected one of: {', '.join(keys)}"
