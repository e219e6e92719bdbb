"""Small batches are requested further ahead (prefetch_bytes), a prefetch given is kept.

A server's cost per batch is mostly fixed, so a loader left to its defaults keeps more small
batches in flight, asked for in groups (client/_loader.py, _fit_window; the scheduler's
widen). What a user sees: stats()["prefetch"], and the same exact epoch either way.
"""

from __future__ import annotations

import pytest

from stoker.client import RemoteLoader

pytestmark = pytest.mark.timeout(120)

N = 600  # toy samples: a few hundred bytes each, batches far below 32 MiB / 8
BATCH = 4


def sample_indices(loader: RemoteLoader) -> list[int]:
    """One pass over an open loader (its window carries over to the next pass)."""
    return [i for b in loader for i in b["sample_index"].tolist()]


@pytest.fixture(scope="module")
def server(start_server_module):
    return start_server_module({"toy": {"format": "python", "factory": "toy_datasets:toy",
                                        "options": {"n": N}}},
                               workers=2, server={"max_credits": 40})


def test_defaults_widen_the_window_for_small_batches_and_the_epoch_stays_exact(server):
    with RemoteLoader(server.address, "toy", batch_size=BATCH, output="numpy",
                      shared_memory=False) as loader:
        assert loader.stats()["prefetch"] == 8  # before any batch: prefetch's default
        first = sample_indices(loader)
        # Half the server's max_credits (hedges and failover credit on top of the window).
        assert loader.stats()["prefetch"] == 20
        second = sample_indices(loader)
    with RemoteLoader(server.address, "toy", batch_size=BATCH, output="numpy",
                      shared_memory=False, prefetch=3) as exact:
        assert sample_indices(exact) == first and sample_indices(exact) == second
        assert exact.stats()["prefetch"] == 3  # a prefetch given is the window


def test_prefetch_bytes_bounds_the_window_and_0_turns_it_off(server):
    with RemoteLoader(server.address, "toy", batch_size=BATCH, output="numpy",
                      prefetch=2, prefetch_bytes=0) as off:
        sample_indices(off)
        assert off.stats()["prefetch"] == 2
    with RemoteLoader(server.address, "toy", batch_size=BATCH, output="numpy",
                      prefetch=2, prefetch_bytes=1) as tiny:
        sample_indices(tiny)  # 1 byte holds no batch: prefetch stays the floor
        assert tiny.stats()["prefetch"] == 2


def test_a_negative_prefetch_bytes_is_refused_by_name():
    with pytest.raises(ValueError, match="prefetch_bytes must be >= 0, got -1"):
        RemoteLoader("127.0.0.1:1", "toy", batch_size=BATCH, prefetch_bytes=-1)
