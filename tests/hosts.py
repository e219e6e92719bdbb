"""Other "hosts" for tests: network namespaces joined to this one by veth pairs.

A `Host` is a namespace with one link to the test's own namespace (the trainer's host):
`10.<net>.<i>.1` on this side, `10.<net>.<i>.2` (`host.ip`) inside. A server started with
`host.wrap` and `host.ip` listens only there, and every byte between it and the trainer
crosses that link, so a fault applied to the link is a fault between machines:

- `host.slow("200kbit")`: a token-bucket qdisc (tc `tbf`; netem is not available here) on
  both ends of the link, so both directions crawl;
- `host.silence()`: every packet dropped inside the namespace (iptables): no FIN, no RST, the
  way a host that lost its network looks; `host.heal()` undoes it (and `slow`).

Needs root, `ip`, `tc` and `iptables` (.ci/run installs what is missing); `hosts_or_skip()`
skips a test cleanly where they are not there. Names carry this process's pid, so parallel
test processes do not collide, and `close()` removes everything (the namespace takes its end
of the link with it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence

import pytest

TOOLS = ("ip", "tc", "iptables")


def _run(*args: str) -> None:
    done = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: exit {done.returncode}: {done.stderr.strip()}")


def can_make_hosts() -> str:
    """'' where namespaces can be made here; else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    return f"missing {', '.join(missing)}" if missing else ""


def hosts_or_skip() -> None:
    why = can_make_hosts()
    if why:
        pytest.skip(f"no hosts to test between: {why}")


class Host:
    """One namespace and its link; see the module docstring."""

    def __init__(self, index: int) -> None:
        if not 1 <= index <= 250:
            raise ValueError(f"index must be in 1..250, got {index}")
        pid = os.getpid()
        self.index = index
        self.name = f"stk{pid}h{index}"
        # Interface names are at most 15 characters.
        self.outside = f"s{pid % 100000}o{index}"
        self.inside = f"s{pid % 100000}i{index}"
        # One /16 a test process, so two processes' links differ: pytest-xdist's workers are
        # numbered (gw0, gw1, ...); a process of its own takes one by its pid.
        worker = os.environ.get("PYTEST_XDIST_WORKER", "")
        net = 100 + int(worker[2:]) % 50 if worker.startswith("gw") else 150 + pid % 100
        self.subnet = f"10.{net}.{index}"
        self.ip = f"{self.subnet}.2"  # the host's address, as the trainer dials it
        self.gateway = f"{self.subnet}.1"  # the trainer's end of the link
        self._up = False

    @property
    def wrap(self) -> Sequence[str]:
        """A command prefix that runs a command on this host (ServerProcess(wrap=...))."""
        return ("ip", "netns", "exec", self.name)

    def start(self) -> Host:
        _run("ip", "netns", "add", self.name)
        self._up = True
        _run("ip", "link", "add", self.outside, "type", "veth", "peer", "name", self.inside)
        _run("ip", "link", "set", self.inside, "netns", self.name)
        _run("ip", "addr", "add", f"{self.gateway}/24", "dev", self.outside)
        _run("ip", "link", "set", self.outside, "up")
        self._in("ip", "addr", "add", f"{self.ip}/24", "dev", self.inside)
        self._in("ip", "link", "set", self.inside, "up")
        self._in("ip", "link", "set", "lo", "up")
        return self

    def slow(self, rate: str, burst: str = "16kb", latency: str = "1s") -> None:
        """Shape both directions of the link to `rate` (tc's units, e.g. '200kbit')."""
        tbf = ("root", "tbf", "rate", rate, "burst", burst, "latency", latency)
        _run("tc", "qdisc", "replace", "dev", self.outside, *tbf)
        self._in("tc", "qdisc", "replace", "dev", self.inside, *tbf)

    def silence(self) -> None:
        """Drop every packet in and out of the host, silently (no RST, no ICMP)."""
        for chain in ("INPUT", "OUTPUT"):
            self._in("iptables", "-A", chain, "!", "-i" if chain == "INPUT" else "-o", "lo",
                     "-j", "DROP")

    def heal(self) -> None:
        """Undo `silence` and `slow`: the link is whole again."""
        self._in("iptables", "-F")
        for dev, inside in ((self.outside, False), (self.inside, True)):
            args = ("tc", "qdisc", "del", "dev", dev, "root")
            done = subprocess.run(("ip", "netns", "exec", self.name, *args) if inside else args,
                                  capture_output=True, text=True, timeout=30)
            # "No such file or directory" / "Cannot delete qdisc with handle of zero": none set
            if done.returncode != 0 and "qdisc" not in done.stderr.lower() and \
                    "no such file" not in done.stderr.lower():
                raise RuntimeError(f"{' '.join(args)}: {done.stderr.strip()}")

    def close(self) -> None:
        if self._up:
            subprocess.run(("ip", "netns", "del", self.name), capture_output=True, timeout=30)
            subprocess.run(("ip", "link", "del", self.outside), capture_output=True, timeout=30)
            self._up = False

    def _in(self, *args: str) -> None:
        _run(*self.wrap, *args)

    def __enter__(self) -> Host:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
