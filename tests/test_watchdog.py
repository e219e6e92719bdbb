"""A worker that hangs (a read that never returns) is detected, killed and replaced.

Before issue 19 nothing watched a batch: the client failed after its own 300 s timeout with
"stalled, last error: none" while /readyz said ready. Now a batch over the server's
batch_timeout_seconds fails in-band (INTERNAL, naming the key, the worker and the sample it
was at), the client asks again, and the epoch is exact.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from stoker.client import RemoteLoader
from stoker.server import ServerProcess

pytestmark = pytest.mark.timeout(60)

N, BATCH, HANG_AT = 40, 4, 13


def get(server: ServerProcess, path: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(server.http_url + path, timeout=10) as r:
            body, status = r.read().decode(), r.status
    except urllib.error.HTTPError as e:
        with e:
            body, status = e.read().decode(), e.code
    return status, json.loads(body) if body.startswith("{") else body


def test_a_hung_worker_is_replaced_and_the_epoch_is_exact(start_server, tmp_path: Path,
                                                          ledger) -> None:
    flag = tmp_path / "hung-once"
    server = start_server(
        {"hangs": {"format": "python", "factory": "toy_datasets:Hangs",
                   # The replacement takes 1.5 s to open: /readyz is seen without it.
                   "options": {"n": N, "hang_at": HANG_AT, "flag": str(flag),
                               "reopen_delay": 1.5}}},
        workers=2, server={"batch_timeout_seconds": 2})
    seen: list[int] = []  # /readyz's worker count, polled through the epoch and after
    back = threading.Event()  # seen without a worker, then with both again
    done = threading.Event()

    def poll() -> None:
        while not done.wait(0.05):
            seen.append(get(server, "/readyz")[1]["workers"])
            if 1 in seen and seen[-1] == 2:
                back.set()

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        with RemoteLoader(server.address, "hangs", batch_size=BATCH, shuffle=False,
                          output="numpy", timeout=30) as loader:
            got = [b["sample_index"].tolist() for b in loader]
        back.wait(15)  # the replacement opens the dataset after the epoch ended
    finally:
        done.set()
        poller.join(timeout=15)
    expected = [list(range(k, k + BATCH)) for k in range(0, N, BATCH)]
    lost, dup = ledger.compare([i for b in got for i in b], [i for b in expected for i in b])
    ledger.record("servers", "a worker hangs at a sample (batch_timeout_seconds: 2)",
                  lost=lost, duplicated=dup,
                  detail="the batch fails in-band INTERNAL naming the key and the sample; "
                         "the worker is replaced; the client asks again")
    assert got == expected
    assert flag.exists()  # it did hang
    err = server.stderr
    assert "batch_timeout_seconds=2" in err and f"at sample {HANG_AT}" in err, err
    assert seen[0] == 2 and back.is_set(), seen  # /readyz counted the hung worker out
    _, stats = get(server, "/v1/stats")
    assert stats["worker_timeouts"] == 1, stats
    _, metrics = get(server, "/metrics")
    assert "stoker_worker_timeouts_total 1.0" in metrics
