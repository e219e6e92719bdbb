"""No growth: a server's memory after 20,000 batches is what it was after 5,000.

Measured as anonymous resident memory (RssAnon: the Python heaps, numpy arrays) of the front
end and every worker; shared-memory segments are excluded (they are the batch payloads, bounded
by credits and the workers' segment pools, and counted once per process that maps them).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from stoker.client import RemoteLoader

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")]

# The front end's heap settles over the first 15,000 or so batches of 1 sample (kept batches
# for other jobs, mappings, the allocator's arenas), then stays flat to 32,000 and beyond
# (measured: 53.9, 55.3, 56.1, 56.7, 56.7, 56.7, 56.7 MiB at 1, 5, 10, 15, 20, 25, 32
# thousand): from 5,000, a leak of 200 bytes a batch would still fail the 5% bound.
FIRST, LAST = 5_000, 20_000


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
                                   "options": {"n": LAST}}}, workers=2)
    rss = {}
    with RemoteLoader(server.address, "toy", batch_size=1, shuffle=True, output="numpy",
                      prefetch=16, timeout=120) as loader:
        for k, _ in enumerate(loader, 1):
            if k in (FIRST, LAST):
                rss[k] = anon_rss(server.proc.pid)
    growth = rss[LAST] / rss[FIRST] - 1
    print(f"server RssAnon after {FIRST}: {rss[FIRST] / 2**20:.1f} MiB, after {LAST}: "
          f"{rss[LAST] / 2**20:.1f} MiB ({growth:+.2%})")
    assert growth <= 0.05
