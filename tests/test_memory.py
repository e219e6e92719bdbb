"""No growth: a server's memory after 100,000 batches is what it was after 40,000.

Measured as anonymous resident memory (RssAnon: the Python heaps, numpy arrays) of the front
end and every worker; shared-memory segments are excluded (they are the batch payloads, bounded
by credits and the workers' segment pools, and counted once per process that maps them).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from stoker.client import RemoteLoader

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")]

# What the server holds that grows with batches until a bound: the index orders' chunks
# (server/order/sampling.py: 64 of 512 positions, full after 32,768 batches of 1 sample), the
# live rates' slots (server/front/metrics.py: WINDOW / SLOT per dataset), kept batches for
# other jobs, mappings, the allocator's arenas. So: SETTLE epochs first, then MEASURED epochs
# over which nothing may grow by more than BOUND; a leak of 10 bytes a batch (600 KB over
# 60,000 batches) fails it.
EPOCH = 20_000  # batches of 1 sample
SETTLE, MEASURED = 2, 3
BOUND = 512 * 1024


def anon_rss(pid: int) -> int:
    """RssAnon in bytes of `pid` and its children (the server's workers)."""
    total = 0
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    for p in (pid, *map(int, children)):
        for line in Path(f"/proc/{p}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                total += int(line.split()[1]) * 1024
    return total


def test_server_memory_stays_flat_over_20000_batches(start_server) -> None:
    # Small samples, many batches: what grows per batch (or per sample) would show.
    server = start_server({"toy": {"format": "python", "factory": "toy_datasets:toy",
                                   "options": {"n": EPOCH}}}, workers=2)
    rss = []  # after each epoch
    with RemoteLoader(server.address, "toy", batch_size=1, shuffle=True, output="numpy",
                      prefetch=16, timeout=120) as loader:
        for e in range(SETTLE + MEASURED):
            loader.set_epoch(e)
            for _ in loader:
                pass
            rss.append(anon_rss(server.proc.pid))
    growth = rss[-1] - rss[SETTLE - 1]
    print("server RssAnon after each epoch of", EPOCH, "batches:",
          ", ".join(f"{r / 2**20:.2f}" for r in rss), f"MiB; {growth / 1024:+.0f} KiB over "
          f"the last {MEASURED} ({growth / (MEASURED * EPOCH):+.1f} bytes a batch)")
    assert growth <= BOUND
