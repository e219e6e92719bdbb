"""A fleet of stoker data servers on Ray: servers as actors, added, drained, autoscaled.

    import ray
    from stoker.client import RemoteLoader
    from stoker.integrations.ray import Fleet, resolve

    with Fleet("/data/stoker.yaml", servers=2, workers=4) as fleet:
        loader = RemoteLoader(fleet.target, "train", batch_size=64, resolver=resolve,
                              dns_refresh=1)

Each server is an actor asking for `workers + 1` CPUs (its worker processes and its front
end), so Ray's scheduler places it where CPUs are free; `actor_options` adds what marks CPU
nodes (a custom resource, a label selector). The actor runs a real `stoker serve` on its
node's IP address. Trainers find the servers through `fleet.target`, a "dns:///NAME:0" target
that `resolve` answers from a named actor holding the fleet's addresses: no DNS needed, from
any process of the cluster (Ray Train workers too). Removing a server drains it: off that
list first, then SIGTERM (it refuses new credits, finishes what it holds, exits). autoscale()
runs the loop of `stoker autoscale` (its decide()) on these actors.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from stoker.server.tools.autoscale import Decision, Policy, ScaleLoop

from ._ray_actors import AddressBook, ServerActor

__all__ = ["Fleet", "FleetScaler", "Policy", "Server", "resolve"]

NAMESPACE = "stoker"  # the address books' Ray namespace: found from any job by a fleet's name
RESOLVE_TIMEOUT = 10.0  # seconds a resolve() waits for the address book
log = logging.getLogger("stoker.integrations")
_books: dict[str, Any] = {}  # fleet name -> its address book's handle, once found


def resolve(target: str) -> list[str]:
    """The addresses of the fleet a "dns:///NAME:PORT" target names (PORT is ignored): a
    RemoteLoader's `resolver`. ValueError when no fleet has that name (at the first look-up,
    i.e. when the loader is made); OSError ("cannot tell now": the loader keeps the servers
    it knows) when the address book stops answering later."""
    name = target.removeprefix("dns:///").removeprefix("dns:").rpartition(":")[0]
    if not ray.is_initialized():
        raise ValueError(f"resolve({target!r}): this process is not connected to Ray; "
                         f"call ray.init(address=...) first")
    book = _books.get(name)
    if book is None:
        try:
            book = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            raise ValueError(f"no stoker fleet named {name!r} in this Ray cluster (Ray "
                             f"namespace {NAMESPACE!r}); start one with Fleet(..., "
                             f"name={name!r})") from None
        _books[name] = book
    try:
        return list(ray.get(book.get.remote(), timeout=RESOLVE_TIMEOUT))
    except (GetTimeoutError, RayActorError) as e:
        _books.pop(name, None)
        raise OSError(f"the address book of stoker fleet {name!r} did not answer: {e}") from e


@dataclass(frozen=True)
class Server:
    """One server of the fleet: its actor, and what the server said when ready."""

    actor: Any  # ray.actor.ActorHandle
    address: str  # "ip:port", gRPC
    http_url: str  # /readyz /metrics
    pid: int
    node_id: str


class Fleet:
    """Stoker servers of one config as Ray actors. Needs ray.init() first.

    Threading: the methods may be called from any thread (one lock orders them; the
    autoscale() thread takes it too). A server is added once it is ready, removed once
    drained; `addresses` lists the servers trainers should use now."""

    def __init__(self, config: str | os.PathLike[str] | Mapping[str, Any], servers: int = 1,
                 *, workers: int = 1, name: str = "stoker",
                 actor_options: Mapping[str, Any] | None = None,
                 env: Mapping[str, str] | None = None, log_level: str = "WARNING",
                 start_timeout: float = 120.0) -> None:
        """`config`: a config file's path on every node, or the config as a mapping (each
        actor writes it to its own disk; give absolute paths in it). `workers`: worker
        processes per server. `actor_options`: more of Ray's actor options, e.g.
        `{"resources": {"cpu_node": 0.01}}` or `{"label_selector": {...}}`; num_cpus
        defaults to workers + 1. `env`: variables added to the servers' environment (the
        actor's), e.g. PYTHONPATH for a `format: python` factory."""
        if isinstance(config, (str, os.PathLike)):
            config = os.fspath(config)
        elif not isinstance(config, Mapping):
            raise ValueError(f"config must be a path or a mapping, got {type(config).__name__}")
        if not (isinstance(servers, int) and servers >= 0):
            raise ValueError(f"servers must be an int >= 0, got {servers!r}")
        if not (isinstance(workers, int) and workers >= 1):
            raise ValueError(f"workers must be an int >= 1 (it sets the CPUs each server "
                             f"asks Ray for), got {workers!r}")
        if not name or ":" in name or "/" in name:
            raise ValueError(f"name must be a non-empty name without ':' or '/', got {name!r}")
        if not start_timeout > 0:
            raise ValueError(f"start_timeout must be > 0 seconds, got {start_timeout!r}")
        self.config, self.workers, self.name = config, workers, name
        self.initial = servers
        self.options = {"num_cpus": workers + 1, **(actor_options or {})}
        for key in ("name", "namespace", "max_concurrency", "max_restarts"):
            if key in self.options:
                raise ValueError(f"actor_options: {key!r} is the fleet's to set")
        self.env, self.log_level, self.start_timeout = dict(env or {}), log_level, start_timeout
        self.servers: list[Server] = []  # oldest first
        self.drained: list[int] = []  # exit codes of the servers removed
        self._lock = threading.RLock()
        self._book: Any = None
        self._scaler: FleetScaler | None = None
        self._scaler_thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> Fleet:
        """Create the address book and start the first servers; ValueError if a fleet of
        this name runs already."""
        if not ray.is_initialized():
            raise ValueError("Fleet.start(): call ray.init() first")
        try:
            ray.get_actor(self.name, namespace=NAMESPACE)
        except ValueError:
            pass
        else:
            raise ValueError(f"a stoker fleet named {self.name!r} runs already in this Ray "
                             f"cluster; give this one another name")
        self._book = ray.remote(AddressBook).options(
            name=self.name, namespace=NAMESPACE, num_cpus=0).remote()
        try:
            self.add(self.initial)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> list[int]:
        """Stop autoscaling, drain every server, remove the address book; the exit codes
        of every server removed over the fleet's life."""
        self.stop_autoscale()
        with self._lock:
            try:
                self.remove(len(self.servers))
            finally:
                if self._book is not None:
                    ray.kill(self._book)
                    self._book = None
                    _books.pop(self.name, None)
            return list(self.drained)

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what trainers use -----------------------------------------------------------------
    @property
    def target(self) -> str:
        """The address a RemoteLoader takes, with resolver=resolve."""
        return f"dns:///{self.name}:0"

    @property
    def addresses(self) -> list[str]:
        with self._lock:
            return [s.address for s in self.servers]

    @property
    def http_urls(self) -> list[str]:
        with self._lock:
            return [s.http_url for s in self.servers]

    @property
    def actors(self) -> list[Any]:
        with self._lock:
            return [s.actor for s in self.servers]

    def _publish(self) -> None:
        ray.get(self._book.set.remote([s.address for s in self.servers]))

    # -- changing it -----------------------------------------------------------------------
    def add(self, n: int = 1) -> list[str]:
        """Start `n` servers, in parallel; their addresses once every one serves.
        RuntimeError (and none of the n kept) if one fails or Ray cannot place it in time."""
        if self._book is None:
            raise ValueError("Fleet.add(): start() the fleet first")
        if not (isinstance(n, int) and n >= 0):
            raise ValueError(f"cannot add {n!r} servers")
        if n == 0:
            return []
        remote = ray.remote(ServerActor).options(**self.options)
        actors = [remote.remote(self.config, self.workers, self.env, self.log_level)
                  for _ in range(n)]
        pending = {a.info.remote(): a for a in actors}
        infos: dict[Any, dict[str, Any]] = {}
        try:
            ready, late = ray.wait(list(pending), num_returns=len(pending),
                                   timeout=self.start_timeout)
            if late:
                raise RuntimeError(
                    f"{len(late)} of {n} stoker server actors did not start within "
                    f"{self.start_timeout:g} s; each asks Ray for {self.options} (available "
                    f"now: {ray.available_resources()})")
            for ref in ready:
                infos[pending[ref]] = ray.get(ref)
        except RayActorError as e:
            for a in actors:
                ray.kill(a)
            raise RuntimeError(f"a stoker server actor did not start: {e}") from None
        except BaseException:
            for a in actors:
                ray.kill(a)
            raise
        with self._lock:
            added = [Server(a, **infos[a]) for a in actors]
            self.servers.extend(added)
            self._publish()
        return [s.address for s in added]

    def remove(self, n: int = 1) -> list[int]:
        """Drain the `n` newest servers, in parallel: off the address book first (trainers
        stop crediting them at their next resolution, and a draining server refuses new
        credits meanwhile), then SIGTERM; their exit codes (-9: its actor was gone)."""
        with self._lock:
            if not 0 <= n <= len(self.servers):
                raise ValueError(f"cannot remove {n} of {len(self.servers)} servers")
            gone = self.servers[len(self.servers) - n:]
            del self.servers[len(self.servers) - n:]
            if self._book is not None:
                self._publish()
        codes = []
        for server, ref in [(s, s.actor.stop.remote()) for s in gone]:
            try:
                codes.append(ray.get(ref))
            except RayActorError:
                codes.append(-signal.SIGKILL)
            except RayTaskError as e:  # it did not stop in time: killed with its actor
                log.error("stoker server %s did not drain: %s", server.address, e)
                codes.append(-signal.SIGKILL)
            finally:
                ray.kill(server.actor)
        self.drained.extend(codes)
        return codes

    def scale(self, n: int) -> list[str] | list[int]:
        """Add or drain servers until `n` run: add()'s or remove()'s result."""
        with self._lock:
            have = len(self.servers)
            if n < 0:
                raise ValueError(f"cannot scale to {n} servers")
            return self.add(n - have) if n >= have else self.remove(have - n)

    def prune(self, timeout: float = 10.0) -> list[str]:
        """Drop the servers whose actor or server process died (ray.kill, a node lost):
        off the address book, their actors ended; their addresses."""
        with self._lock:
            refs = {s.actor.poll.remote(): s for s in self.servers}
            dead = []
            ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
            for ref in ready:
                try:
                    alive = ray.get(ref) is None
                except RayActorError:
                    alive = False
                if not alive:
                    dead.append(refs[ref])
            if dead:
                self.servers = [s for s in self.servers if s not in dead]
                self._publish()
                for s in dead:
                    ray.kill(s.actor)
            return [s.address for s in dead]

    # -- following the trainers' stall ---------------------------------------------------
    def autoscale(self, policy: Policy, *, interval: float = 1.0,
                  trace: Callable[[dict[str, Any]], None] | None = None) -> FleetScaler:
        """Scale on the stall trainers report, as `stoker autoscale` does (its Policy and
        decide()), on a daemon thread until stop_autoscale() or close()."""
        if self._scaler is not None:
            raise ValueError("this fleet autoscales already; stop_autoscale() first")
        scaler = FleetScaler(self, policy, interval=interval, trace=trace)
        thread = threading.Thread(target=scaler.loop, name=f"stoker-fleet-{self.name}",
                                  daemon=True)
        self._scaler, self._scaler_thread = scaler, thread
        thread.start()
        return scaler

    def stop_autoscale(self, timeout: float = 120.0) -> None:
        scaler, thread = self._scaler, self._scaler_thread
        if scaler is None or thread is None:
            return
        scaler.stop()
        thread.join(timeout)
        self._scaler = self._scaler_thread = None


class FleetScaler(ScaleLoop):
    """`stoker autoscale`'s loop on a Fleet: prune dead servers, then observe, decide, act."""

    def __init__(self, fleet: Fleet, policy: Policy, *, interval: float = 1.0,
                 trace: Callable[[dict[str, Any]], None] | None = None) -> None:
        super().__init__(policy, interval=interval, trace=trace)
        self.fleet = fleet

    def http_urls(self) -> list[str]:
        return self.fleet.http_urls

    def add(self) -> None:
        self.fleet.add(1)

    def remove(self) -> int:
        return self.fleet.remove(1)[0]

    def tick(self, t: float) -> Decision | None:
        """One tick; a server Ray could not place or start is logged, and tried again at
        a later tick (the count did not change, so the decision stands)."""
        self.fleet.prune()
        try:
            return super().tick(t)
        except RuntimeError:
            log.exception("stoker fleet %r: autoscaling could not act", self.fleet.name)
            return None
