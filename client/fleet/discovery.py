"""Where the servers are: fixed "host:port" addresses, or one "dns:///name:port" target whose
A/AAAA records are the servers (a Kubernetes headless service, `docker compose --scale`),
re-resolved every `dns_refresh` seconds (RESOLVE_EVERY by default). A `Resolver` replaces the
system's DNS for such a target: a service registry, or a file of addresses that a local
autoscaler writes (`stoker autoscale`).

Threading: `start_lookup` runs the resolver on a thread of its own (stoker-resolve); the rest
runs where it is called (the scheduler's lock, for ServerSet.refresh).
"""

from __future__ import annotations

import concurrent.futures
import socket
import threading
from collections.abc import Callable, Sequence

RESOLVE_EVERY = 15.0  # seconds between resolutions of a dns: target, by default
# Seconds a refresh waits for its look-up before the loop goes on without it. Look-ups run
# on a thread of their own: a DNS server that answers in seconds, or not at all (the system
# resolver's timeouts are 5 s a try), would otherwise hold the training loop (and, under the
# scheduler's lock, every stream's delivery) that long every dns_refresh seconds. A look-up
# still running is used by the first refresh after it ends; none other starts meanwhile.
RESOLVE_WAIT = 0.05


def parse_addresses(address: str | Sequence[str]) -> tuple[list[str], str | None]:
    """(fixed addresses, dns target or None)."""
    addresses = [address] if isinstance(address, str) else list(address)
    if not addresses:
        raise ValueError("address: give at least one 'host:port' or 'dns:///name:port'")
    dns = [a for a in addresses if a.startswith("dns:")]
    if dns and len(addresses) > 1:
        raise ValueError(f"address: a dns: target stands alone, got {addresses}")
    for a in addresses:
        host, sep, port = a.removeprefix("dns:///").removeprefix("dns:").rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"address: expected 'host:port' or 'dns:///name:port', got {a!r}")
    return (addresses, None) if not dns else ([], dns[0])


# resolver(target) -> the "host:port" addresses a "dns:///name:port" target names now. It
# runs on a thread of its own (see RESOLVE_WAIT), one call at a time. OSError means "cannot
# tell now" (the servers known stay); other exceptions reach the loop.
Resolver = Callable[[str], Sequence[str]]


def resolve(target: str) -> list[str]:
    """The "ip:port" addresses a dns:///name:port target names now (sorted, deduplicated),
    from the system's resolver: the default `Resolver`."""
    host, _, port = target.removeprefix("dns:///").removeprefix("dns:").rpartition(":")
    infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    found = set()
    for family, _, _, _, sockaddr in infos:
        ip = sockaddr[0]
        found.add(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}")
    return sorted(found)


def start_lookup(resolver: Resolver, target: str) -> concurrent.futures.Future[list[str]]:
    """checked(resolver, target) on a daemon thread (a look-up that never returns must not
    keep the process from exiting)."""
    fut: concurrent.futures.Future[list[str]] = concurrent.futures.Future()

    def run() -> None:
        try:
            fut.set_result(checked(resolver, target))
        except BaseException as e:  # handed to the loop by result()
            fut.set_exception(e)

    threading.Thread(target=run, name="stoker-resolve", daemon=True).start()
    return fut


def checked(resolver: Resolver, target: str) -> list[str]:
    """What the resolver says `target` names, checked: a resolver's mistake is a
    ValueError naming what it returned, not a channel to nowhere."""
    found = resolver(target)
    if isinstance(found, str) or not all(isinstance(a, str) for a in found):
        raise ValueError(f"resolver returned {found!r} for {target!r}: expected a list "
                         f"of 'host:port' strings")
    addresses = sorted(set(found))
    try:
        fixed, dns = parse_addresses(addresses) if addresses else ([], None)
    except ValueError as e:
        dns, fixed = str(e), []
    if dns is not None:
        raise ValueError(f"resolver returned {addresses} for {target!r}: expected "
                         f"'host:port' addresses")
    return fixed
