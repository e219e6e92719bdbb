"""The workers' queue (server/pool/fair_queue.py): each lane's batches in order, and a burst
of one lane's credits served in turn with the others' next batches, not ahead of them; a
loader's epochs are one lane (server/front/credits.py)."""

from __future__ import annotations

import pytest

from stoker.server.pool.fair_queue import REMEMBER, FairQueue

pytestmark = pytest.mark.timeout(30)


def drain(q: FairQueue) -> list:
    out = []
    while len(q):
        out.append(q.pop())
    return out


def test_a_burst_waits_its_turn_behind_the_other_streams_next_batches() -> None:
    q: FairQueue[str] = FairQueue()
    for k in range(5):  # stream a credits 5 batches at once
        q.add([f"a{k}"], "a")
    q.add(["b0"], "b")  # then b and c one each
    q.add(["c0"], "c")
    assert drain(q) == ["a0", "b0", "c0", "a1", "a2", "a3", "a4"]


def test_each_stream_keeps_its_order_and_streams_alternate() -> None:
    q: FairQueue[str] = FairQueue()
    for k in range(3):
        q.add([f"a{k}"], "a")
    for k in range(3):
        q.add([f"b{k}"], "b")
    assert drain(q) == ["a0", "b0", "a1", "b1", "a2", "b2"]


def test_a_stream_that_was_idle_gets_no_credit_for_its_idle_time() -> None:
    q: FairQueue[str] = FairQueue()
    for k in range(4):
        q.add([f"a{k}"], "a")
    assert [q.pop(), q.pop()] == ["a0", "a1"]
    for k in range(3):  # b arrives late: it shares from now on, it does not jump all of a's
        q.add([f"b{k}"], "b")
    assert drain(q) == ["a2", "b0", "a3", "b1", "b2"]


def test_parts_share_a_tag_in_order_and_put_back_jobs_go_first() -> None:
    q: FairQueue[str] = FairQueue()
    q.add(["a0"], "a")
    q.add(["b0/0", "b0/1", "b0/2"], "b")
    q.add(["a1"], "a")
    assert q.pop() == "a0"
    q.put_back(["x", "y"])  # a dead worker's tasks, in their order
    assert list(q) == ["x", "y", "b0/0", "b0/1", "b0/2", "a1"]
    q.put_back(["z"])
    assert drain(q) == ["z", "x", "y", "b0/0", "b0/1", "b0/2", "a1"]


def test_clear_gives_the_jobs_in_serving_order_and_forgotten_streams_start_from_now() -> None:
    q: FairQueue[int] = FairQueue()
    for s in range(REMEMBER + 10):
        q.add([s], s)
    assert q.clear() == list(range(REMEMBER + 10)) and len(q) == 0
    q.add([1], "late")
    q.add([2], "later")
    assert drain(q) == [1, 2]


def test_a_loaders_next_epoch_queues_behind_its_current_one_and_ranks_stay_fair() -> None:
    """Lanes as the front end names them (server/front/credits.py): one connection's reading
    of one dataset, whatever the epoch. A loader asks for its next epoch on a stream of its
    own while the current one ends; as a lane of its own, that burst was served in turn with
    the current epoch's last batches, which the loop needs first."""
    from dataclasses import replace

    from stoker.server.front.credits import Credits
    from stoker.server.order.sampling import Coordinates

    def lane_of(peer: str, coords: Coordinates) -> object:
        return Credits(None, "ipv4:127.0.0.1", None, peer)._lane_of(coords)  # type: ignore[arg-type]

    rank0 = Coordinates("d", seed=0, epoch=3, shuffle=True, rank=0, world_size=2,
                        batch_size=256, drop_last=False)
    peer = "ipv4:127.0.0.1:50000"
    following = replace(rank0, epoch=4)
    resumed = replace(rank0, start=512)
    rank1, other = replace(rank0, rank=1), replace(rank0, dataset="e")
    assert lane_of(peer, rank0) == lane_of(peer, following) == lane_of(peer, resumed)
    assert len({lane_of(peer, rank0), lane_of(peer, rank1), lane_of(peer, other),
                lane_of("ipv4:127.0.0.1:50001", rank0)}) == 4

    q: FairQueue[str] = FairQueue()
    for k in range(4):  # rank 0's epoch 3, then rank 1's, then rank 0's next epoch's burst
        q.add([f"r0e3b{k}"], lane_of(peer, rank0))
    for k in range(2):
        q.add([f"r1e3b{k}"], lane_of(peer, rank1))
    for k in range(3):
        q.add([f"r0e4b{k}"], lane_of(peer, following))
    assert drain(q) == ["r0e3b0", "r1e3b0", "r0e3b1", "r1e3b1", "r0e3b2", "r0e3b3",
                        "r0e4b0", "r0e4b1", "r0e4b2"]
