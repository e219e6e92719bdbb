"""No drain between epochs: the next epoch's first batches are asked for while the loop ends
the current one, so the wait at an epoch's start is no longer than at any other step; and
batches of an epoch the loop does not move on to are dropped and counted.

The dataset's samples sleep (2 ms, no CPU): on a 2-core machine eight workers still build
eight batches at once, as eight cores would.
"""

from __future__ import annotations

import gc
import threading
import time

import pytest

from stoker.client import RemoteLoader

# serial: timing figures (waits, shares of a rate) that a second test process beside them would
# bend; `make test` runs them alone, after the rest in parallel.
pytestmark = [pytest.mark.timeout(120), pytest.mark.serial]

BATCH, PER_EPOCH, EPOCHS = 64, 10, 4
STEP = 0.1  # seconds of "training step" per batch
DELAY = 0.002  # seconds a sample takes: a batch is 0.13 s of one worker
TOLERANCE = 0.05  # seconds: a wait at an epoch's start may exceed the others' by this


@pytest.fixture(scope="module")
def server(start_server_module):
    return start_server_module(
        {"slow": {"format": "python", "factory": "toy_datasets:toy",
                  "options": {"n": BATCH * PER_EPOCH, "delay": DELAY}}}, workers=8)


def step() -> None:
    """A training step: the loop is busy, not waiting for data."""
    threading.Event().wait(STEP)


def waits(loader: RemoteLoader, set_epoch: bool) -> list[list[float]]:
    """Each epoch's waits for its batches (seconds), the loop stepping STEP s a batch."""
    seen: list[list[float]] = []
    for epoch in range(EPOCHS):
        if set_epoch:
            loader.set_epoch(epoch)
        got: list[float] = []
        batches = iter(loader)
        while True:
            t0 = time.perf_counter()
            try:
                next(batches)
            except StopIteration:
                break
            got.append(time.perf_counter() - t0)
            step()
        assert len(got) == PER_EPOCH
        seen.append(got)
    return seen


@pytest.mark.parametrize("set_epoch", [True, False], ids=["set_epoch", "iterate_again"])
def test_an_epoch_starts_without_a_wait(server, set_epoch) -> None:
    with RemoteLoader(server.address, "slow", batch_size=BATCH, output="numpy",
                      shared_memory=False) as loader:
        seen = waits(loader, set_epoch)
        stats = loader.stats()
    # Past the very first batch (the pipeline filling), no step waits long, and an epoch's
    # first step waits no longer than the other steps do.
    others = max(w for epoch in seen for w in epoch[1:])
    starts = [epoch[0] for epoch in seen[1:]]
    assert max(starts) <= others + TOLERANCE, (starts, others)
    assert stats["dropped"] == 0 and stats["epoch"] == EPOCHS


def test_batches_of_an_epoch_not_asked_for_are_dropped_and_counted(server) -> None:
    with RemoteLoader(server.address, "slow", batch_size=BATCH, output="numpy",
                      shared_memory=False, prefetch=4) as loader:
        first = [b["sample_index"].tolist() for b in loader]  # epoch 0; epoch 1 asked ahead
        deadline = time.monotonic() + 30
        # Epoch 1's first batches arrive while the loop does something else.
        while sum(s["batches"] for s in loader.stats()["servers"].values()) < PER_EPOCH + 4:
            assert time.monotonic() < deadline, loader.stats()
            threading.Event().wait(0.02)
        loader.set_epoch(7)  # not epoch 1: what was fetched for it is dropped
        seventh = [b["sample_index"].tolist() for b in loader]
        assert loader.stats()["dropped"] == 4
    with RemoteLoader(server.address, "slow", batch_size=BATCH, output="numpy",
                      shared_memory=False, prefetch=4) as fresh:
        fresh.set_epoch(7)
        assert [b["sample_index"].tolist() for b in fresh] == seventh
        fresh.set_epoch(0)
        assert [b["sample_index"].tolist() for b in fresh] == first
        assert fresh.stats()["dropped"] == 0


def test_a_loop_let_go_after_its_last_batch_leaves_the_next_loop_alone(server) -> None:
    """A generator that yielded its epoch's last batch and is collected while a later loop
    runs on the same scheduler (the next epoch, fetched ahead) must not close it under that
    loop."""
    with RemoteLoader(server.address, "slow", batch_size=BATCH, output="numpy",
                      shared_memory=False, timeout=20) as loader:
        it = iter(loader)
        first = [next(it)["sample_index"].tolist() for _ in range(len(loader))]
        second = []
        for k, batch in enumerate(loader):  # epoch 1 follows on
            if k == 1:
                del it  # collected now: its clean-up runs while this loop goes on
                gc.collect()
            second.append(batch["sample_index"].tolist())
        assert len(second) == len(first) == PER_EPOCH and second != first
        assert loader.stats()["dropped"] == 0
