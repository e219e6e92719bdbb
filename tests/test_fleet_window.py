"""A window the fleet sets (issue 31 item 2): servers say what they can do (Describe, each
stream's metadata, /v1/stats), and a loader left to its defaults grows its window while its
loop stalls, never past its memory budget; `prefetch=N` stays N.
"""

from __future__ import annotations

import json
import threading
import urllib.request

import pytest

from stoker.client import RemoteLoader

# serial: timing figures (waits, shares of a rate) that a second test process beside them would
# bend; `make test` runs them alone, after the rest in parallel.
pytestmark = [pytest.mark.timeout(120), pytest.mark.serial]

BATCH, WORKERS, DELAY = 16, 2, 0.003  # a batch: 48 ms of one worker, asleep


@pytest.fixture(scope="module")
def server(start_server_module):
    return start_server_module(
        {"slow": {"format": "python", "factory": "toy_datasets:toy",
                  "options": {"n": BATCH * 200, "delay": DELAY}}}, workers=WORKERS)


def server_stats(server) -> dict:
    with urllib.request.urlopen(server.http_url + "/v1/stats", timeout=10) as r:
        return json.load(r)


def test_the_window_grows_under_a_stall_within_its_memory_budget(server) -> None:
    with RemoteLoader(server.address, "slow", batch_size=BATCH, output="numpy",
                      shared_memory=False) as probe:
        batch_bytes = sum(v.nbytes for v in next(iter(probe)).values())
        assert probe.describe().capacity.workers == WORKERS
    # The budget holds at most `budget` batches beside the loop's two buffers (fewer: a
    # payload aligns each tensor to 64 bytes), more than the default 8.
    budget = 16
    windows, whys = [], set()
    # Another trainer shares the server (prefetch=8 as given): the loader under test gets a
    # share of the servers' rate that its window decides. Alone, its 8 batches already keep
    # both workers busy: it stalls at the servers' rate, where the window rightly stays (a
    # wider one would only queue more at the servers), and it grew only on a machine too busy
    # for the servers to reach their rate.
    done = threading.Event()

    def other_trainer() -> None:
        with RemoteLoader(server.address, "slow", batch_size=BATCH, output="numpy", seed=7,
                          shared_memory=False, prefetch=8) as other:
            epoch = 0
            while not done.is_set():
                other.set_epoch(epoch)
                for _ in other:
                    if done.is_set():
                        break
                epoch += 1

    sharing = threading.Thread(target=other_trainer, daemon=True)
    sharing.start()
    try:
        with RemoteLoader(server.address, "slow", batch_size=BATCH, output="numpy",
                          shared_memory=False, memory_budget=(budget + 2) * batch_bytes + 64,
                          prefetch_bytes=0) as loader:  # small batches: no widening at once
            # A loop that only counts: it waits for every batch (a stall near 100%).
            for k, _ in enumerate(loader):
                stats = loader.stats()
                windows.append(stats["window"])
                whys.add(stats["why"])
                if k == 150:
                    live = server_stats(server)
            held = stats["budget_batches"]
    finally:
        done.set()
        sharing.join(30)
    assert 8 < held <= budget
    assert windows[0] == 8 and max(windows) == held, windows  # grew, up to the budget
    assert stats["prefetch"] == stats["window"]
    assert any("stalled" in why for why in whys) and any("memory_budget" in why
                                                          for why in whys), whys
    assert live["capacity"]["workers"] == WORKERS
    assert live["capacity"]["samples_per_second"] > 0
    reported = live["datasets"]["slow"]["client_windows"]
    assert reported and 1 <= reported[0]["window"] <= held, reported


def test_a_prefetch_given_stays_what_it_is(server) -> None:
    with RemoteLoader(server.address, "slow", batch_size=BATCH, output="numpy",
                      shared_memory=False, prefetch=3) as loader:
        windows = [loader.stats()["window"] for _ in loader]
        assert set(windows) == {3} and loader.stats()["why"] == "prefetch=3"
