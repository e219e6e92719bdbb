"""Elastic resume: a state saved at world_size N loads at world_size M (and another batch_size),
and the job goes on with exactly the rest of the epoch's order: none lost, none repeated.

Each job's ranks are RemoteLoaders in this process, one per rank, iterated in turn (ranks do
not talk to each other, so order does not matter). The saving job reads one server and the
resumed job another: positions are a pure function of the coordinates, on any server.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
import pytest

from stoker.client import RemoteLoader
from stoker.v1 import stoker_pb2 as pb
from stoker.v1 import stoker_pb2_grpc as pb_grpc

P = 120  # samples: a multiple of every world size here, so no rank remainder is cut
EPOCH = 1
DATASETS = {"n120": {"format": "python", "factory": "toy_datasets:toy", "options": {"n": P}}}


@pytest.fixture(scope="module")
def servers(start_server_module) -> tuple[str, str]:
    return start_server_module(DATASETS).address, start_server_module(DATASETS).address


def loader(address: str, rank: int, world_size: int, batch_size: int, **kw: Any
           ) -> RemoteLoader:
    kw = {"seed": 7, "shuffle": True, "drop_last": True, **kw}
    return RemoteLoader(address, "n120", batch_size=batch_size, rank=rank,
                        world_size=world_size, output="numpy", timeout=60, **kw)


def job(address: str, world_size: int, batch_size: int, steps: int | None = None,
        state: dict | None = None, **kw: Any) -> tuple[list[int], list[dict], list[int]]:
    """Run every rank of a job for `steps` batches (all: the epoch's rest), each rank first
    loading `state` (any rank's: the job's position). The samples used, each rank's
    state_dict afterwards, and each rank's len() at the start."""
    used, states, lengths = [], [], []
    for rank in range(world_size):
        with loader(address, rank, world_size, batch_size, **kw) as ld:
            if state is not None:
                ld.load_state_dict(state)
            ld.set_epoch(EPOCH)  # the usual loop's call: a loaded epoch keeps its place
            lengths.append(len(ld))
            for n, batch in enumerate(ld, 1):
                used += batch["sample_index"].tolist()
                if n == steps:
                    break
            states.append(ld.state_dict())
    return used, states, lengths


def whole_epoch(address: str, world_size: int, batch_size: int, **kw: Any) -> list[int]:
    return job(address, world_size, batch_size, **kw)[0]


def check_exactly_once(ledger, case: str, got: Sequence[int], reference: Sequence[int]
                       ) -> None:
    lost, duplicated = ledger.compare(got, reference)
    ledger.record("clients", case, tried=1, lost=lost, duplicated=duplicated,
                  detail=f"{len(got)} samples of the epoch's {len(reference)}")
    assert (lost, duplicated) == (0, 0)
    assert sorted(got) == sorted(reference)


@pytest.mark.parametrize(("n", "b", "steps", "m", "b2"), [
    (4, 5, 3, 3, 5),  # 4 -> 3 ranks
    (2, 6, 5, 5, 6),  # 2 -> 5 ranks
    (2, 6, 5, 5, 4),  # 2 -> 5 ranks and another batch_size
    (3, 4, 2, 3, 8),  # the same ranks, another batch_size
])
def test_the_rest_of_the_epoch_at_another_world_size(servers, ledger, n, b, steps, m, b2
                                                     ) -> None:
    a, other = servers
    reference = whole_epoch(a, n, b)
    assert len(reference) == P  # the failure-free run uses every sample once
    first, states, _ = job(a, n, b, steps)
    assert {s["next_batch"] for s in states} == {steps}
    consumed = steps * b * n
    rest, after, lengths = job(other, m, b2, state=states[-1])  # the last rank's: any will do
    assert lengths == [(P - consumed) // m // b2] * m  # len() is the rest of the epoch
    check_exactly_once(ledger, f"resume a state saved at world_size {n}, batch_size {b} at "
                               f"world_size {m}, batch_size {b2}", first + rest, reference)
    assert {(s["epoch"], s["next_batch"]) for s in after} == {(EPOCH + 1, 0)}
    assert all("start" not in s["coordinates"] for s in after)  # the next epoch is normal


def test_the_epoch_after_a_resume_is_a_normal_epoch(servers) -> None:
    a, other = servers
    _, states, _ = job(a, 4, 5, 2)
    with loader(other, 1, 3, 5) as resumed, loader(other, 1, 3, 5) as fresh:
        resumed.load_state_dict(states[0])
        list(resumed)  # the rest of EPOCH
        fresh.set_epoch(EPOCH + 1)
        assert len(resumed) == len(fresh) == P // 3 // 5
        assert resumed.state_dict() == fresh.state_dict()
        got = [b["sample_index"].tolist() for b in resumed]
        assert got == [b["sample_index"].tolist() for b in fresh]


def test_n_to_m_to_k_in_one_epoch(servers, ledger) -> None:
    a, other = servers
    reference = whole_epoch(a, 4, 3)
    first, states, _ = job(a, 4, 3, steps=2)  # 24 positions
    second, states, _ = job(other, 3, 4, steps=3, state=states[0])  # 36 more
    assert {s["coordinates"]["start"] for s in states} == {24}
    assert {s["next_batch"] for s in states} == {3}
    third, _, lengths = job(a, 5, 2, state=states[2])
    assert lengths == [(P - 60) // 5 // 2] * 5
    check_exactly_once(ledger, "resume at world_size 4 -> 3 -> 5 (batch_size 3 -> 4 -> 2) "
                               "within one epoch", first + second + third, reference)


def test_a_state_without_start_loads(servers) -> None:
    """A state saved before elastic resume existed: its coordinates have no `start`."""
    a, other = servers
    old = {"coordinates": {"dataset": "n120", "seed": 7, "shuffle": True, "rank": 0,
                           "world_size": 4, "batch_size": 5, "drop_last": True},
           "epoch": EPOCH, "next_batch": 3}
    # The format a state had then is the legacy order's (states of index orders say "order")
    first, states, _ = job(a, 4, 5, steps=3, order="legacy")
    assert states[0] == {**old, "fingerprint": states[0]["fingerprint"]}  # today's format
    rest = job(other, 3, 5, state=old)[0]
    assert sorted(first + rest) == sorted(whole_epoch(a, 4, 5, order="legacy"))
    with loader(a, 2, 4, 5) as ld:  # same world_size: as before, the position as saved
        ld.load_state_dict(old)
        assert ld.state_dict()["next_batch"] == 3
        assert "start" not in ld.state_dict()["coordinates"]


def test_the_tail_cut_to_the_new_world_size_is_the_epochs_last_positions(servers) -> None:
    """Unshuffled, positions are sample indices: 40 consumed at 4 ranks, the other 80 cut to
    a multiple of 7 ranks: (120 - 40) % 7 = 3, the epoch's last 3 positions, go unused."""
    a, other = servers
    first, states, _ = job(a, 4, 5, steps=2, shuffle=False, drop_last=False)
    rest, _, lengths = job(other, 7, 5, state=states[0], shuffle=False, drop_last=False)
    assert lengths == [3] * 7  # 11 samples each: two full batches and a short one
    assert sorted(first) == list(range(40))
    assert sorted(first + rest) == list(range(P - 3))


def test_a_rest_without_a_batch_moves_on_to_the_next_epoch(servers) -> None:
    """108 of 120 consumed; 12 left for 5 ranks of batch_size 4 with drop_last: no batch."""
    a, other = servers
    _, states, _ = job(a, 2, 6, steps=9)
    with loader(other, 0, 5, 4) as ld, loader(other, 0, 5, 4) as fresh:
        ld.load_state_dict(states[0])
        ld.set_epoch(EPOCH)
        assert len(ld) == 0 and list(ld) == []
        assert ld.state_dict()["epoch"] == EPOCH + 1
        ld.set_epoch(EPOCH + 1)  # the loop's next turn keeps the (new) epoch's place
        fresh.set_epoch(EPOCH + 1)
        assert [b["sample_index"].tolist() for b in ld] == \
            [b["sample_index"].tolist() for b in fresh]


@pytest.mark.parametrize(("key", "value", "said"), [
    ("seed", 8, "seed: saved 8, this loader 7"),
    ("shuffle", False, "shuffle: saved False, this loader True"),
    ("drop_last", False, "drop_last: saved False, this loader True"),
    ("dataset", "other", "dataset: saved 'other', this loader 'n120'"),
])
def test_another_order_is_refused_naming_the_key(servers, ledger, key, value, said) -> None:
    a, _ = servers
    _, states, _ = job(a, 2, 6, steps=1)
    state = {**states[0], "coordinates": {**states[0]["coordinates"], key: value}}
    with loader(a, 0, 3, 6) as ld:
        with pytest.raises(ValueError, match=said):
            ld.load_state_dict(state)
        assert ld.state_dict()["next_batch"] == 0  # nothing of the refused state was taken
    ledger.record("clients", f"elastic resume from a state with another {key}",
                  detail="ValueError naming the key")


@pytest.mark.parametrize(("where", "key", "value"), [
    ("coordinates", "start", -1), ("coordinates", "world_size", 0), ("state", "next_batch", "3"),
    ("state", "epoch", None),
])
def test_a_malformed_position_is_refused_naming_the_key(servers, ledger, where, key, value
                                                        ) -> None:
    a, _ = servers
    _, states, _ = job(a, 2, 6, steps=1)
    state = dict(states[0])
    if where == "state":
        state[key] = value
    else:
        state["coordinates"] = {**state["coordinates"], key: value}
    with loader(a, 0, 3, 6) as ld, pytest.raises(ValueError, match=f"'{key}' must be an int"):
        ld.load_state_dict(state)
    ledger.record("clients", "load_state_dict of a malformed position", detail=key)


# -- the server's side: Coordinates.start ---------------------------------------------------

def coords(**kw: Any) -> pb.Coordinates:
    return pb.Coordinates(**{"dataset": "n120", "seed": 7, "epoch": EPOCH, "shuffle": False,
                             "rank": 0, "world_size": 1, "batch_size": 4, **kw})


def test_start_shifts_the_partition_and_sizes_the_rest(servers) -> None:
    a, _ = servers
    with grpc.insecure_channel(a) as channel:
        stub = pb_grpc.DataServiceStub(channel)
        described = stub.DescribeDataset(pb.DescribeDatasetRequest(coordinates=coords(
            start=50, rank=2, world_size=7, drop_last=False)), timeout=30)
        assert (described.samples_per_rank, described.batches_per_epoch) == (10, 3)
        assert stub.DescribeDataset(pb.DescribeDatasetRequest(coordinates=coords(start=P)),
                                    timeout=30).batches_per_epoch == 0
        for start in (-1, P + 1):
            with pytest.raises(grpc.RpcError) as refused:
                stub.DescribeDataset(pb.DescribeDatasetRequest(coordinates=coords(
                    start=start)), timeout=30)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert refused.value.details().startswith("start:")
    with loader(a, 2, 7, 4, shuffle=False, drop_last=False) as ld:
        ld.load_state_dict({"coordinates": {"dataset": "n120", "seed": 7, "shuffle": False,
                                            "rank": 0, "world_size": 5, "batch_size": 5,
                                            "drop_last": False},
                            "epoch": EPOCH, "next_batch": 2})
        assert ld.stats()["start"] == 50
        got = [b["sample_index"].tolist() for b in ld]
    # Rank 2's j-th sample is at position start + rank + j * world_size.
    assert got == [[52, 59, 66, 73], [80, 87, 94, 101], [108, 115]]
