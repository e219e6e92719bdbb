"""The harness of tests between machines (tests/hosts.py) does what it says: a server on
another host is reached over its link only, a slowed link is slow, and a silenced host drops
packets without a word (a connect times out; it is not refused), until healed."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from stoker.client import RemoteLoader

from conftest import StartServer
from hosts import Host, hosts_or_skip

pytestmark = pytest.mark.timeout(90)
N = 24
SENDER = """
import socket, sys
s = socket.create_server((sys.argv[1], 0))
print(s.getsockname()[1], flush=True)
c, _ = s.accept()
c.sendall(b"x" * 65536)
c.close()
"""
TOY = {"toy": {"format": "python", "factory": "toy_datasets:toy", "options": {"n": N}}}


@pytest.fixture
def host() -> Iterator[Host]:
    hosts_or_skip()
    with Host(1) as h:
        yield h


def _connects(ip: str, port: int, timeout: float) -> str:
    try:
        with socket.create_connection((ip, port), timeout=timeout):
            return "connected"
    except TimeoutError:
        return "timed out"
    except ConnectionRefusedError:
        return "refused"


def test_server_on_another_host_over_a_link_that_slows_and_goes_silent(
        host: Host, start_server: StartServer) -> None:
    server = start_server(TOY, wrap=host.wrap, host=host.ip)
    assert server.address.startswith(host.ip + ":")
    with pytest.raises(OSError):  # not on this host's loopback: only over the link
        socket.create_connection(("127.0.0.1", server.ready["grpc_port"]), timeout=2).close()
    loader = RemoteLoader(server.address, "toy", batch_size=4, shuffle=False, output="numpy",
                          prefetch_next_epoch=False)
    seen = [int(i) for b in loader for i in b["sample_index"]]
    assert seen == list(range(N))
    loader.close()

    # Slowed: 64 KiB from the host over a 200 kbit/s link take at least ~2.6 s, less the
    # bucket's burst. A sender on the host: one connection, 64 KiB, then it closes.
    host.slow("200kbit")
    sender = subprocess.Popen([*host.wrap, sys.executable, "-c", SENDER, host.ip],
                              stdout=subprocess.PIPE, text=True)
    assert sender.stdout is not None
    port = int(sender.stdout.readline())  # listening
    began = time.monotonic()
    with socket.create_connection((host.ip, port), timeout=10) as s:
        s.settimeout(30)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    took = time.monotonic() - began
    assert sender.wait(30) == 0 and len(got) == 65536
    sender.stdout.close()
    assert took > 2.0, took

    port = server.ready["http_port"]
    host.silence()
    assert _connects(host.ip, port, timeout=1.0) == "timed out"
    host.heal()
    assert _connects(host.ip, port, timeout=5.0) == "connected"
