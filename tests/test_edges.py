"""Edge cases of issue 41: the last representable epoch, and prefetch past max_credits."""

from __future__ import annotations

import logging

import pytest

from stoker.client import RemoteLoader

pytestmark = pytest.mark.timeout(180)

LAST_EPOCH = 2**63 - 1  # Coordinates.epoch is an int64


@pytest.fixture(scope="module")
def servers(start_server_module):
    # 2 ms a sample: credits pile up at the server (the case that failed by timing).
    toy = {"toy": {"format": "python", "factory": "toy_datasets:toy",
                   "options": {"n": 400, "delay": 0.002}}}
    return [start_server_module(toy, workers=2, server={"max_credits": 64})
            for _ in range(2)]


def test_the_last_representable_epoch_iterates(servers) -> None:
    with RemoteLoader(servers[0].address, "toy", batch_size=8, output="numpy",
                      timeout=30) as loader:
        loader.set_epoch(LAST_EPOCH)
        got = sorted(i for b in loader for i in b["sample_index"].tolist())
        assert got == list(range(400))
        # The epoch after it cannot be named: refused by name, before any request.
        with pytest.raises(ValueError, match="2\\*\\*63 - 1"):
            loader.set_epoch(LAST_EPOCH + 1)


def test_prefetch_past_max_credits_never_fails_and_says_so_once(
        servers, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="stoker.client")
    with RemoteLoader([s.address for s in servers], "toy", batch_size=1, prefetch=200,
                      output="numpy", shared_memory=False, timeout=30) as loader:
        for epoch in range(2):  # the boundary too: the next epoch is asked for early
            loader.set_epoch(epoch)
            assert sorted(i for b in loader for i in b["sample_index"].tolist()) == list(
                range(400))
            assert loader.stats()["prefetch"] <= 64
    said = [r for r in caplog.records if "max_credits=64" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]
