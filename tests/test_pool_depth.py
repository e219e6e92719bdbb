"""How many tasks a worker holds at once (server/pool/depth.py): many only of batches small and
quick to build, where the messages are the cost; two of slow or large ones, so that a batch
credited later is not queued behind a worker's backlog out of the pool's hands."""

from __future__ import annotations

import pytest

from stoker.server.pool.depth import depth_for

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(("payload", "seconds", "depth"), [
    (64 << 10, 0.0005, 8),     # small and quick: several queued, one pipe read for them
    (1 << 20, 0.002, 8),
    (1 << 20, 0.064, 2),       # slow to build (lockstep's 32 x 2 ms): two, no more
    (64 << 20, 0.0005, 2),     # large: its bytes are the cost
])
def test_a_worker_holds_many_tasks_only_of_small_quick_batches(payload: int, seconds: float,
                                                              depth: int) -> None:
    assert depth_for(payload, seconds) == depth
