"""A small /dev/shm (Docker's default is 64 MiB) fails batches cleanly, never kills workers.

Each server here runs in its own mount namespace with a /dev/shm of a few MiB (root, and
`unshare`, needed: skipped otherwise). The client, outside it, finds no shared /dev/shm, so
batches reach it in gRPC frames. Before issue 19, segments were sized with ftruncate alone:
the first write past the tmpfs limit was a SIGBUS, and workers died in a loop with
"worker process died (exit code -7)".
"""

from __future__ import annotations

import select
import subprocess
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from epochs import epoch

from stoker.client import RemoteError
from stoker.server import ServerProcess

pytestmark = pytest.mark.timeout(60)

SHM_MIB = 4


def small_shm(mib: int) -> list[str]:
    """A command prefix that runs the server with a /dev/shm of `mib` MiB of its own."""
    return ["unshare", "-m", "--propagation", "private", "sh", "-c",
            f"mount -t tmpfs -o size={mib}m tmpfs /dev/shm && exec \"$@\"", "sh"]


@pytest.fixture(scope="module")
def wrap() -> list[str]:
    probe = subprocess.run([*small_shm(SHM_MIB), "true"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a small /dev/shm here: {probe.stderr.decode().strip()}")
    return small_shm(SHM_MIB)


def blocks(n: int, kib: int = 256) -> dict[str, Any]:
    return {"blocks": {"format": "python", "factory": "toy_datasets:Blocks",
                       "options": {"n": n, "kib": kib}}}


def workers_of(server: ServerProcess) -> list[int]:
    """The pids of the server's worker processes (named `stoker worker N ...` once started;
    spawn_main before).
    Each thread lists the children it started: the pool starts workers on other threads."""
    assert server.proc is not None
    found = []
    for task in Path(f"/proc/{server.proc.pid}/task").iterdir():
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for child in children:
            try:
                cmd = Path(f"/proc/{child}/cmdline").read_bytes()
                if b"spawn_main" in cmd or cmd.startswith(b"stoker worker"):
                    found.append(int(child))
            except OSError:
                pass
    return sorted(found)


def wait_for_stderr(server: ServerProcess, text: str, timeout: float = 10.0) -> str:
    """The server's stderr once it holds `text` (its reader thread may lag the ready line)."""
    deadline = time.monotonic() + timeout
    while text not in server.stderr and time.monotonic() < deadline:
        select.select([], [], [], 0.05)
    return server.stderr


def read_blocks(server: ServerProcess, batch_size: int, **kw: Any) -> list[list[int]]:
    """An epoch of `blocks`, in order: each batch's sample indices, its blocks checked."""
    got = []
    for batch in epoch(server, "blocks", batch_size=batch_size, shuffle=False, **kw):
        indices = batch["sample_index"].tolist()
        assert all((batch["block"][k] == i).all() for k, i in enumerate(indices))
        got.append(indices)
    return got


def serve_blocks(start_server: Any, wrap: list[str], n: int, workers: int
                 ) -> tuple[ServerProcess, list[int]]:
    """A server of `n` 256 KiB samples in a small /dev/shm, and its workers' pids."""
    server = start_server(blocks(n), workers=workers, wrap=wrap)
    pids = workers_of(server)
    assert len(pids) == workers
    return server, pids


def in_order(n: int, batch_size: int) -> list[list[int]]:
    return [list(range(k, k + batch_size)) for k in range(0, n, batch_size)]


def assert_workers_lived(server: ServerProcess, before: list[int]) -> None:
    """The same worker processes as `before`, and none reported dead (SIGBUS is -7)."""
    assert workers_of(server) == before
    assert "exit code -7" not in server.stderr and "died" not in server.stderr, server.stderr


def test_a_server_warns_at_start_when_dev_shm_is_small(start_server, wrap, ledger) -> None:
    # 256 KiB samples: a nominal batch of 256 is 64 MiB, far more than 4 MiB.
    server = start_server(blocks(8), workers=2, wrap=wrap)
    err = wait_for_stderr(server, "--shm-size")
    line = next((x for x in err.splitlines() if "/dev/shm is" in x), "")
    assert f"/dev/shm is {SHM_MIB:.1f} MiB" in line, err
    for part in ("server.workers=2", "server.max_credits=64", "'blocks'", "--shm-size="):
        assert part in line, line
    ledger.record("load", "/dev/shm of 4 MiB, workers 2, max_credits 64: warned at start",
                  detail="a WARNING naming /dev/shm, its size, workers, max_credits, --shm-size")


def test_a_batch_larger_than_dev_shm_is_refused_and_the_worker_lives(start_server, wrap,
                                                                     ledger) -> None:
    server, before = serve_blocks(start_server, wrap, 24, workers=1)
    with pytest.raises(RemoteError) as err:
        read_blocks(server, batch_size=24, timeout=20)  # 6 MiB
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
    message = str(err.value)
    assert f"/dev/shm holds {SHM_MIB:.1f} MiB in all" in message, message
    assert "this batch needs 6.1 MiB" in message and "--shm-size" in message, message
    # The worker is the same process, and serves what fits.
    assert workers_of(server) == before
    assert read_blocks(server, batch_size=4, timeout=20) == in_order(24, 4)
    assert_workers_lived(server, before)
    ledger.record("load", "a batch larger than the whole /dev/shm (6 MiB in 4 MiB)",
                  detail="RESOURCE_EXHAUSTED naming /dev/shm and its size; the worker lives")


def test_batches_that_fit_one_at_a_time_give_an_exact_epoch(start_server, wrap,
                                                            ledger) -> None:
    # 1.5 MiB batches: /dev/shm holds two; two workers, each building up to two at a time,
    # and the front end holding those not sent yet, ask for more than that.
    server, before = serve_blocks(start_server, wrap, 48, workers=2)
    got = read_blocks(server, batch_size=6, timeout=30, prefetch=4)
    lost, dup = ledger.compare([i for b in got for i in b], range(48))
    ledger.record("load", "1.5 MiB batches, 2 workers, a 4 MiB /dev/shm", lost=lost,
                  duplicated=dup, detail="batches that find it full are retried (UNAVAILABLE)"
                                         "; no worker dies")
    assert got == in_order(48, 6)
    assert_workers_lived(server, before)
