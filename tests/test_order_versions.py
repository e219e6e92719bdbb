"""Order versions: new runs read the index order, states saved before it resume the legacy
order exactly, and a server that cannot compute a loader's order is refused."""

from __future__ import annotations

from typing import Any

import grpc
import numpy as np
import pytest

from stoker.client import DataMismatch, RemoteLoader
from stoker.server.order.sampling import ORDER_INDEX, Ordering
from stoker.v1 import stoker_pb2 as pb
from stoker.v1 import stoker_pb2_grpc as pb_grpc

N, SEED, BS, WORLD = 120, 7, 5, 2
DATASETS = {"n120": {"format": "python", "factory": "toy_datasets:toy", "options": {"n": N}}}

# What RemoteLoader.state_dict() returned before order versions, rank 1 of 2, 3 batches into
# epoch 1 (its fingerprint left out: the test's server lists another moment's data).
SAVED_BEFORE = {"coordinates": {"dataset": "n120", "seed": SEED, "shuffle": True, "rank": 1,
                                "world_size": WORLD, "batch_size": BS, "drop_last": True},
                "epoch": 1, "next_batch": 3}


@pytest.fixture(scope="module")
def address(start_server_module) -> str:
    return start_server_module(DATASETS).address


def loader(address: str, **kw: Any) -> RemoteLoader:
    kw = {"seed": SEED, "rank": 1, "world_size": WORLD, "output": "numpy", "timeout": 60, **kw}
    return RemoteLoader(address, "n120", batch_size=BS, **kw)


def indices(batches: Any) -> list[int]:
    return [i for b in batches for i in b["sample_index"].tolist()]


def test_a_state_saved_before_index_orders_resumes_the_legacy_order_exactly(address) -> None:
    legacy = np.random.default_rng([SEED, 1]).permutation(N)  # what stoker did then
    rank1 = legacy[1::WORLD].tolist()
    with loader(address) as ld:  # a new loader: its own order would be the index one
        ld.load_state_dict(SAVED_BEFORE)
        rest = indices(ld)
        state = ld.state_dict()
    assert rest == rank1[3 * BS:]
    assert "order" not in state["coordinates"]  # still a legacy state, as it was saved
    with loader(address) as ld:  # and the next epoch goes on in the legacy order
        ld.load_state_dict(state)
        assert indices(ld) == np.random.default_rng([SEED, 2]).permutation(N)[1::WORLD].tolist()


def test_new_runs_read_the_index_order_and_save_it(address) -> None:
    want = Ordering(N).indices(np.arange(1, N, WORLD), SEED, 0, True, ORDER_INDEX).tolist()
    with loader(address) as ld:
        it = iter(ld)
        first = indices([next(it) for _ in range(2)])
        state = ld.state_dict()
        it.close()
    assert first == want[: 2 * BS]
    assert first != np.random.default_rng([SEED, 0]).permutation(N)[1::WORLD][: 2 * BS].tolist()
    assert state["coordinates"]["order"] == ORDER_INDEX
    with loader(address, world_size=3, rank=0) as ld:  # elastic: the rest of the same order
        ld.load_state_dict(state)
        assert ld.state_dict()["coordinates"]["order"] == ORDER_INDEX
    with loader(address, order="legacy") as ld:  # a state of another order: not resumed
        assert ld.state_dict().get("coordinates", {}).get("order") is None
        ld.load_state_dict(state)  # the run's order is the state's
        assert ld.state_dict()["coordinates"]["order"] == ORDER_INDEX


def test_an_order_the_server_does_not_know_is_refused_naming_it(address) -> None:
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.DataServiceStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            stub.DescribeDataset(pb.DescribeDatasetRequest(coordinates=pb.Coordinates(
                dataset="n120", seed=1, shuffle=True, world_size=1, batch_size=4, order=9)),
                timeout=30)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "order" in (raised.value.details() or "")
        described = stub.DescribeDataset(pb.DescribeDatasetRequest(coordinates=pb.Coordinates(
            dataset="n120", world_size=1, batch_size=4)), timeout=30)
    assert sorted(described.fingerprint.orders) == [1, 2]


def test_a_server_older_than_index_orders_is_refused(address) -> None:
    """A server that lists no orders (one from before them) would serve the legacy order for
    an index-order loader's coordinates: the loader refuses it."""
    from stoker.client.contact.agreement import order_refusal

    old = pb.DescribeDatasetResponse(fingerprint=pb.Fingerprint(digest="sha256:ab"))
    refused = order_refusal("n120", ORDER_INDEX, "old:1", old)
    assert isinstance(refused, DataMismatch) and "old:1" in str(refused)
    assert order_refusal("n120", 1, "old:1", old) is None  # a legacy run may use it
    new = pb.DescribeDatasetResponse(fingerprint=pb.Fingerprint(digest="sha256:ab",
                                                                orders=[1, 2]))
    assert order_refusal("n120", ORDER_INDEX, "new:1", new) is None


def test_bad_order_names_are_refused() -> None:
    with pytest.raises(ValueError, match="order must be one of"):
        RemoteLoader("127.0.0.1:1", "n120", batch_size=4, order="feistel")
    with pytest.raises(ValueError, match="'order'"):
        with loader("127.0.0.1:1") as ld:
            ld.load_state_dict({**SAVED_BEFORE, "coordinates": {
                **SAVED_BEFORE["coordinates"], "order": 9}})


def test_stats_show_memory_and_index_orders_hold_none(start_server) -> None:
    """Epochs and seeds of a billion-sample dataset under index orders: the legacy order cache
    stays empty and /v1/stats says so, with the processes' resident memory."""
    import json
    import urllib.request

    server = start_server({"big": {"format": "python", "factory": "toy_datasets:Counting",
                                   "options": {"n": 10**9}}})
    for seed in range(3):
        with RemoteLoader(server.address, "big", batch_size=8, seed=seed, world_size=8,
                          rank=7, output="numpy", timeout=60) as ld:
            for epoch in range(2):
                ld.set_epoch(epoch)
                it = iter(ld)
                assert len(next(it)["sample_index"]) == 8
                it.close()
    with urllib.request.urlopen(server.http_url + "/v1/stats", timeout=30) as r:
        memory = json.loads(r.read())["memory"]
    assert memory["legacy_order_cache_bytes"] == 0
    assert memory["legacy_order_cache_max_bytes"] == 1 << 30
    assert memory["front_end_rss_anon_bytes"] > 0 and memory["workers_rss_anon_bytes"] > 0


@pytest.mark.parametrize("batch_size", [1, 7, 32, 600])
def test_index_orders_made_a_chunk_at_a_time_are_each_batch_made_alone(batch_size) -> None:
    # sampling.batch_samples makes CHUNK_SAMPLES positions at once and keeps them: the same
    # indices as the batch's own positions, a fresh writable array each time, the last
    # (short) batch included.
    from stoker.server.order import sampling
    ordering = Ordering(10_007, None)
    for rank, world, start in ((0, 1, 0), (2, 3, 5)):
        c = sampling.Coordinates("d", 4, 1, True, rank, world, batch_size, False, start=start,
                                 order=ORDER_INDEX)
        per_rank = sampling.samples_per_rank(ordering.num_samples, c)
        batches = sampling.batches_per_epoch(ordering.num_samples, c)
        for b in [0, 1, batches // 2, batches - 2, batches - 1]:
            got = sampling.batch_samples(ordering, c, b)
            first, stop = b * batch_size, min((b + 1) * batch_size, per_rank)
            positions = start + rank + world * np.arange(first, stop, dtype=np.int64)
            want = ordering.indices(positions, 4, 1, True, ORDER_INDEX)
            assert np.array_equal(got, want), (rank, b)
            got[:] = -1  # the caller's own copy
            assert np.array_equal(sampling.batch_samples(ordering, c, b), want)
