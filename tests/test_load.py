"""32 concurrent streams on one server: every client progresses, gets exactly its sequence,
and the server's memory stays within what its credits allow.

The bound: the server holds at most max_credits batches per stream (built, queued, or in
gRPC's send buffers as frame copies), so its anonymous memory (RssAnon, the server and its
workers; batch payloads themselves live in shared memory, which is not anonymous) grows by
at most streams x max_credits x batch bytes over its idle baseline, plus a fixed allowance
for per-stream bookkeeping (gRPC call state, asyncio tasks).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from stoker.client import RemoteLoader

from conftest import StartServer, rss_anon

pytestmark = pytest.mark.timeout(120)

STREAMS, BATCHES, BS, PREFETCH, MAX_CREDITS = 32, 15, 8, 4, 8
N, SHAPE = 120, (128, 128)  # float32 64 KiB samples (Noise: n < 128)
BATCH_BYTES = BS * (int(np.prod(SHAPE)) * 4 + 3 + 2 + 8)  # big, odd, half, sample_index
PER_STREAM_OVERHEAD = 512 << 10  # bytes: gRPC call and asyncio bookkeeping, generous
SLACK = 48 << 20  # allocator arenas, import-time growth on first use


def expected(seed: int) -> list[int]:
    return np.random.default_rng([seed, 0]).permutation(N)[: BATCHES * BS].tolist()


def test_32_streams_on_one_server(start_server: StartServer, ledger) -> None:
    server = start_server({"noise": {"format": "python", "factory": "toy_datasets:Noise",
                                     "options": {"n": N, "shape": list(SHAPE)}}},
                          workers=2, server={"max_credits": MAX_CREDITS})
    assert server.proc is not None
    pid = server.proc.pid
    # Warm: one stream first, so the baseline has the imports and the pools a stream needs.
    with RemoteLoader(server.address, "noise", batch_size=BS, output="numpy") as ld:
        next(iter(ld))
    baseline = rss_anon(pid)
    peak = [baseline]
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.05):
            peak[0] = max(peak[0], rss_anon(pid))

    got: dict[int, list[int]] = {}
    waits: list[float] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        mine, lat = [], []
        try:
            with RemoteLoader(server.address, "noise", batch_size=BS, seed=k, order="legacy",
                              output="numpy",
                              prefetch=PREFETCH, timeout=60, shared_memory=k % 2 == 0) as ld:
                it = iter(ld)
                for _ in range(BATCHES):
                    t0 = time.perf_counter()
                    batch = next(it)
                    lat.append(time.perf_counter() - t0)
                    mine += batch["sample_index"].tolist()
                it.close()
        except BaseException as e:
            errors.append(e)
        with lock:
            got[k] = mine
            waits.extend(lat)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    started = time.monotonic()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(STREAMS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)
    took = time.monotonic() - started
    done.set()
    watcher.join(5)
    assert not errors, errors[:3]
    assert all(not t.is_alive() for t in threads)
    lost = dup = 0
    for k in range(STREAMS):
        a, b = ledger.compare(got[k], expected(k))
        lost, dup = lost + a, dup + b
    bound = STREAMS * (MAX_CREDITS * BATCH_BYTES + PER_STREAM_OVERHEAD) + SLACK
    grew = peak[0] - baseline
    p50, p99 = np.percentile(waits, [50, 99]) * 1000
    ledger.record("load", f"{STREAMS} concurrent streams on one server (2 workers), "
                  f"{BATCHES} batches each", tried=STREAMS, lost=lost, duplicated=dup,
                  detail=f"all progressed in {took:.1f} s; wait per batch p50 {p50:.1f} ms, "
                         f"p99 {p99:.1f} ms; server RssAnon {baseline >> 20} MiB, peak "
                         f"+{grew >> 20} MiB (bound +{bound >> 20} MiB)")
    assert lost == dup == 0
    assert all(len(got[k]) == BATCHES * BS for k in range(STREAMS))  # everyone progressed
    assert grew <= bound, (baseline, peak[0], bound)
