"""`stoker autoscale`: a local control loop that starts and drains `stoker serve` processes on
the data stall their trainers report.

Each tick it reads `stoker_client_data_stall_max` from every server's /metrics, decides
(`decide`, a pure function of what it observed) and acts: start one more server, drain the
newest one (SIGTERM: the server refuses new credits, finishes what it holds, exits), or hold.
The servers' addresses go to a file, one "host:port" a line, replaced atomically on every
change; trainers find them with a `dns:///` target whose resolver reads that file:

    RemoteLoader("dns:///stoker:0", "ds", batch_size=64, dns_refresh=1,
                 resolver=lambda target: open("servers.txt").read().split())

A stall series is absent until a trainer reports: absent is "no information", never 0, so no
trainer running never scales the servers down (nor up). The stall used is the worst any server
sees: in a synchronous data-parallel job the slowest trainer paces every step.
"""

from __future__ import annotations

import argparse
import enum
import http.client
import json
import logging
import math
import os
import signal
import ssl
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from .connect import add_security, https_context, security

log = logging.getLogger("stoker.server")


class Action(enum.Enum):
    """What a tick decides; the value is what the trace prints."""

    ADD = "add"
    REMOVE = "remove"
    HOLD = "hold"


STALL_GAUGE = "stoker_client_data_stall_max"
SCRAPE_TIMEOUT = 2.0  # seconds for one /metrics read; a server that takes longer is skipped


@dataclass(frozen=True)
class Policy:
    """What the loop aims for and how carefully. Times in seconds."""

    target: float = 0.05  # the stall to stay under (a share of the trainers' loop time)
    min_servers: int = 1
    max_servers: int = 4
    # After a change, observations are ignored for this long: a new server starts, the
    # trainers find it (their dns_refresh) and their reported stall (it covers their last
    # 10 to 15 s) must describe the new count before it is judged.
    cooldown: float = 20.0
    window: float = 10.0  # a decision takes the median stall of the settled last `window` s
    samples: int = 2  # settled observations with a stall the median needs (else: hold)
    # Scale down only with the stall under target x down_below; and never to a count that
    # stalled above target within the last `memory` s (hysteresis: without it, a count that
    # is one too few would be tried again and again).
    down_below: float = 0.5
    memory: float = 600.0

    def __post_init__(self) -> None:
        if not 0 < self.target < 1:
            raise ValueError(f"target stall must be in (0, 1), got {self.target}")
        if not 1 <= self.min_servers <= self.max_servers:
            raise ValueError(f"need 1 <= min_servers <= max_servers, got {self.min_servers} "
                             f"and {self.max_servers}")
        for name in ("cooldown", "window", "memory"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0 seconds, got {getattr(self, name)}")
        if self.samples < 1 or not 0 <= self.down_below <= 1:
            raise ValueError(f"need samples >= 1 and 0 <= down_below <= 1, got "
                             f"{self.samples} and {self.down_below}")


@dataclass(frozen=True)
class Observation:
    """One tick: when (seconds, any monotonic clock), how many servers ran, the stall they
    reported (None: no server had a stall series, i.e. no trainer reported)."""

    t: float
    servers: int
    stall: float | None


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    stall: float | None = None  # the median the decision rests on, when there was one


def _segments(history: Sequence[Observation]) -> Iterator[tuple[int, float, list[Observation]]]:
    """(servers, since, observations) for each run of ticks at one server count."""
    start = 0
    for k in range(1, len(history) + 1):
        if k == len(history) or history[k].servers != history[start].servers:
            yield history[start].servers, history[start].t, list(history[start:k])
            start = k


def _settled_median(observations: Sequence[Observation], since: float, until: float,
                    policy: Policy) -> float | None:
    """The median stall of the observations in [since + cooldown, until] that carry one,
    over the last `window` s of that span; None with fewer than `samples`."""
    settled = [o for o in observations if o.t >= since + policy.cooldown]
    stalls = [o.stall for o in settled if o.stall is not None and o.t >= until - policy.window]
    return statistics.median(stalls) if len(stalls) >= policy.samples else None


def forget(history: Sequence[Observation], policy: Policy) -> list[Observation]:
    """`history` less what decide() can no longer use: runs at one server count that ended
    over `memory` ago, and in each run the observations before its last `window` s (the run's
    first is kept: its time starts the cooldown). decide() says the same on either; a loop
    that ticks for days keeps a bounded list."""
    now = history[-1].t
    runs = list(_segments(history))
    kept: list[Observation] = []
    for k, (_, _, run) in enumerate(runs):
        end = run[-1].t
        if k < len(runs) - 1 and now - end > policy.memory:
            continue
        kept.append(run[0])
        kept.extend(o for o in run[1:] if o.t >= end - policy.window)
    return kept


def decide(history: Sequence[Observation], policy: Policy) -> Decision:
    """What to do now, from every observation so far (oldest first; the last is now).

    The first observation counts as a change (servers just started). Add one server when the
    settled stall is above target; remove one when it is well under it and one fewer did not
    stall recently; hold otherwise, and always while there is no information."""
    if not history:
        raise ValueError("decide needs at least one observation")
    now = history[-1]
    n = now.servers
    if n < policy.min_servers:
        return Decision(Action.ADD, f"{n} servers, below min_servers={policy.min_servers}")
    if n > policy.max_servers:
        return Decision(Action.REMOVE, f"{n} servers, above max_servers={policy.max_servers}")
    segments = list(_segments(history))
    _, since, current = segments[-1]
    left = since + policy.cooldown - now.t
    if left > 0:
        return Decision(Action.HOLD, f"cooldown: {left:.0f} s left")
    stall = _settled_median(current, since, now.t, policy)
    if stall is None:
        return Decision(Action.HOLD, "no information: no trainer reported a stall lately")
    if stall > policy.target:
        if n >= policy.max_servers:
            return Decision(Action.HOLD, f"stall {stall:.1%} > target {policy.target:.0%}, but "
                            f"at max_servers={policy.max_servers}", stall)
        return Decision(Action.ADD, f"stall {stall:.1%} > target {policy.target:.0%}", stall)
    # Counts that stalled above target within `memory`: the fewest that suffice is above.
    too_few = [m for m, start, obs in segments[:-1] if now.t - obs[-1].t <= policy.memory
               and (s := _settled_median(obs, start, obs[-1].t, policy)) is not None
               and s > policy.target]
    floor = max([policy.min_servers, *(m + 1 for m in too_few)])
    if n <= floor:
        why = (f"{n - 1} servers stalled within {policy.memory:.0f} s" if n - 1 in too_few
               else f"min_servers={policy.min_servers}")
        return Decision(Action.HOLD, f"stall {stall:.1%} <= target {policy.target:.0%}; "
                        f"{why}", stall)
    if stall < policy.target * policy.down_below:
        return Decision(Action.REMOVE, f"stall {stall:.1%} < {policy.down_below:g} x target: "
                        f"try {n - 1}", stall)
    return Decision(Action.HOLD, f"stall {stall:.1%} <= target {policy.target:.0%}", stall)


# -- observing -----------------------------------------------------------------------------
def parse_gauge(text: str, name: str) -> list[float]:
    """Every value of the gauge `name` in Prometheus text (any labels), read by
    prometheus_client's parser; NaN left out, and text it cannot parse has none."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        return [sample.value for family in text_string_to_metric_families(text)
                for sample in family.samples
                if sample.name == name and not math.isnan(sample.value)]
    except ValueError:
        return []


def read_stall(http_url: str, token: str | None = None, timeout: float = SCRAPE_TIMEOUT,
               context: ssl.SSLContext | None = None,
               failed: Callable[[BaseException], None] | None = None) -> float | None:
    """The worst stall one server's clients report, from its /metrics (over https with
    `context`, the fleet's CA and a client certificate: `stoker autoscale --tls-ca ...`);
    None when it has no stall series (no client reported) or cannot be read now, and then
    `failed(error)` hears why."""
    request = urllib.request.Request(http_url.rstrip("/") + "/metrics")
    if token:
        request.add_header("authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as r:
            text = r.read().decode()
    except (OSError, urllib.error.URLError, http.client.HTTPException) as e:
        if failed is not None:
            failed(e)
        return None  # starting, draining, or gone: no information from it
    values = parse_gauge(text, STALL_GAUGE)
    return max(values) if values else None


def write_addresses(path: Path, addresses: Sequence[str]) -> None:
    """Replace the address file atomically: a resolver never reads half of it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(f"{a}\n" for a in addresses))
    os.replace(tmp, path)


# -- acting --------------------------------------------------------------------------------
class ScaleLoop:
    """The loop of ticks, whatever starts the servers: observe their stall, decide(), act.
    A subclass says how to list (http_urls), add and remove (drain) servers: `Autoscaler`
    below with local processes, stoker.integrations.ray with Ray actors. Threading: loop()
    on one thread; stop() from any (a signal handler too)."""

    def __init__(self, policy: Policy, *, interval: float = 1.0,
                 trace: Callable[[dict[str, Any]], None] | None = None,
                 tls: ssl.SSLContext | None = None, token: str | None = None) -> None:
        """`tls`: the context /metrics is read with where the servers serve https (the
        fleet's CA, and a client certificate under mutual TLS); `token`: the bearer token
        they want (default $STOKER_TOKEN)."""
        if not interval > 0:
            raise ValueError(f"interval must be > 0 seconds, got {interval}")
        self.policy, self.interval = policy, interval
        self.trace = trace or (lambda row: None)
        self.history: list[Observation] = []
        self._stopping = threading.Event()
        self._token = token or os.environ.get("STOKER_TOKEN")
        self._tls = tls
        self._said: set[str] = set()  # servers whose /metrics failed, said once each

    def http_urls(self) -> list[str]:
        """The HTTP base URL of every server now (their /metrics carry the stall)."""
        raise NotImplementedError

    def add(self) -> None:
        """Start one more server; return once it serves and trainers can find it."""
        raise NotImplementedError

    def remove(self) -> int:
        """Drain one server: off the trainers' list first, then its graceful stop; its exit
        code."""
        raise NotImplementedError

    def stop(self) -> None:
        self._stopping.set()

    def observe(self, t: float) -> Observation:
        urls = self.http_urls()
        stalls = [s for s in (self._stall(u) for u in urls) if s is not None]
        return Observation(t, len(urls), max(stalls) if stalls else None)

    def _stall(self, url: str) -> float | None:
        def failed(error: BaseException) -> None:
            # A TLS or token mistake would hold the fleet at its size for ever, silently.
            reason = getattr(error, "reason", error)
            if url not in self._said and not isinstance(reason, ConnectionRefusedError):
                self._said.add(url)
                log.warning("autoscale: cannot read %s/metrics (%s); no information from it "
                            "until it can be read (--tls-ca, --tls-cert/--tls-key, "
                            "--token-file)", url, reason)

        return read_stall(url, self._token, context=self._tls, failed=failed)

    def tick(self, t: float) -> Decision:
        """Observe at `t` (seconds since the loop began), decide, trace and act."""
        self.history.append(self.observe(t))
        decision = decide(self.history, self.policy)
        self.history = forget(self.history, self.policy)
        last = self.history[-1]
        self.trace({"t": round(last.t, 3), "servers": last.servers, "stall": last.stall,
                    "decided_on": decision.stall, "action": decision.action.value,
                    "reason": decision.reason})
        if decision.action is Action.ADD:
            self.add()
        elif decision.action is Action.REMOVE:
            code = self.remove()
            if code != 0:
                log.warning("a server drained by the autoscaler exited %d", code)
        return decision

    def loop(self) -> None:
        """Tick every `interval` s until stop(); the servers stay as they are."""
        started = time.monotonic()
        while not self._stopping.is_set():
            now = time.monotonic()
            self.tick(now - started)
            self._stopping.wait(max(0.0, self.interval - (time.monotonic() - now)))


class Autoscaler(ScaleLoop):
    """Local servers of one config (`stoker serve` child processes), scaled on their stall;
    their addresses in a file that trainers' resolver reads."""

    def __init__(self, config: str | os.PathLike[str], addresses: str | os.PathLike[str],
                 policy: Policy, *, interval: float = 1.0, workers: int | None = None,
                 host: str = "127.0.0.1", env: dict[str, str] | None = None,
                 trace: Callable[[dict[str, Any]], None] | None = None,
                 tls: ssl.SSLContext | None = None, token: str | None = None) -> None:
        super().__init__(policy, interval=interval, trace=trace, tls=tls, token=token)
        self.config, self.addresses = config, Path(addresses)
        self.workers, self.host, self.env = workers, host, env
        self.servers: list[Any] = []  # ServerProcess, oldest first
        self.codes: list[int] = []  # exit codes of the servers drained

    def _publish(self) -> None:
        write_addresses(self.addresses, [s.address for s in self.servers])

    def http_urls(self) -> list[str]:
        return [s.http_url for s in self.servers]

    def add(self) -> None:
        from .._process import ServerProcess

        server = ServerProcess(self.config, workers=self.workers, host=self.host,
                               env=self.env).start()
        self.servers.append(server)
        self._publish()

    def remove(self) -> int:
        """Drain the newest server: off the address list first (trainers stop crediting it
        at their next resolution), then SIGTERM; its exit code."""
        server = self.servers.pop()
        self._publish()
        code = server.stop()
        self.codes.append(code)
        return code

    def run(self) -> int:
        """Start min_servers, tick until stop(); then drain every server. 0 if every server
        exited 0."""
        try:
            for _ in range(self.policy.min_servers):
                self.add()
            self.loop()
        finally:
            while self.servers:  # every one, whatever one of them does
                try:
                    self.remove()
                except Exception:
                    log.exception("a server did not stop")
                    self.codes.append(1)
        return 0 if all(c == 0 for c in self.codes) else 1


# -- the command ---------------------------------------------------------------------------
def add_command(sub: Any) -> None:
    p = sub.add_parser("autoscale", help="start and drain local servers on the data stall "
                       "their trainers report (server extra)")
    d = Policy()
    p.add_argument("--config", required=True, help="YAML config every server runs")
    p.add_argument("--addresses", required=True, help="file to keep the servers' host:port "
                   "in, one a line (what trainers' resolver reads)")
    p.add_argument("--target-stall", type=float, default=d.target,
                   help=f"the stall to stay under (default {d.target})")
    p.add_argument("--min-servers", type=int, default=d.min_servers)
    p.add_argument("--max-servers", type=int, default=d.max_servers)
    p.add_argument("--cooldown", type=float, default=d.cooldown, help="seconds after a "
                   f"change before the stall is judged again (default {d.cooldown:g})")
    p.add_argument("--window", type=float, default=d.window, help="seconds of settled "
                   f"observations a decision takes the median of (default {d.window:g})")
    p.add_argument("--memory", type=float, default=d.memory, help="seconds a count that "
                   f"stalled is not scaled down to again (default {d.memory:g})")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between ticks")
    p.add_argument("--workers", type=int, help="worker processes per server")
    p.add_argument("--host", default="127.0.0.1", help="address the servers bind")
    # The servers' /metrics: over https with the fleet's CA (and a client certificate where
    # they require one) when their config has `tls:`; the options `stoker stats` takes.
    add_security(p)
    p.add_argument("--log-level", default="WARNING", type=str.upper,
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="default WARNING")
    p.set_defaults(func=run_command)


def run_command(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Print one JSON line per tick (t, servers, stall, decided_on, action, reason) until
    SIGTERM or SIGINT, then drain every server."""
    try:
        policy = Policy(args.target_stall, args.min_servers, args.max_servers,
                        cooldown=args.cooldown, window=args.window, memory=args.memory)
        if not Path(args.config).is_file():
            raise ValueError(f"--config {args.config}: no such file")
        sec = security(args)
        scaler = Autoscaler(args.config, args.addresses, policy, interval=args.interval,
                            workers=args.workers, host=args.host,
                            trace=lambda row: print(json.dumps(row), file=out, flush=True),
                            tls=https_context(sec, "autoscale"), token=sec.token)
    except ValueError as e:
        print(f"stoker autoscale: {e}", file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: scaler.stop())
    try:
        return scaler.run()
    except RuntimeError as e:  # a server that would not start
        print(f"stoker autoscale: {e}", file=sys.stderr)
        return 1

