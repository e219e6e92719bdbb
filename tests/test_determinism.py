"""Determinism as a tool, through real servers: any batch on demand (`batch_at`) equals the
batch iteration gives there, and asking for one does not disturb an iteration; `seek(step)`
then iterating equals an unstopped run from that step, in one request however far, and after
an elastic change (`world_sizes`) the run that resumed at the new size; for fixed batches,
batch_tokens, a mixture and a mixture cut by tokens."""

from __future__ import annotations

import itertools
import random
import time
from typing import Any

import determinism_datasets
import numpy as np
import pytest

from stoker.client import RemoteError, RemoteLoader
from stoker.server import ServerProcess
from stoker.v1 import stoker_pb2_grpc as pb_grpc

from conftest import StartServer

pytestmark = pytest.mark.timeout(120)

WORLD = 2
EPOCHS = 3
# dataset -> its size argument
SIZES: dict[str, dict[str, Any]] = {
    "pics": {"batch_size": 2},
    "toks": {"batch_size": 2},
    "docs": {"batch_tokens": 64},
    "mix": {"batch_size": 5},
    "docmix": {"batch_tokens": 64},  # a mixture of two jsonl corpora, cut by tokens
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory,
           start_server_module: StartServer) -> ServerProcess:
    root = tmp_path_factory.mktemp("determinism")
    return start_server_module(determinism_datasets.make(root), workers=2)


def make(address: str, dataset: str, rank: int = 1, world_size: int = WORLD, **kw: Any
         ) -> RemoteLoader:
    return RemoteLoader(address, dataset, **{**SIZES[dataset], **kw}, seed=7, rank=rank,
                        world_size=world_size, output="numpy", timeout=60)


def same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("dataset", sorted(SIZES))
def test_batch_at_equals_the_iterated_batch(server: ServerProcess, dataset: str) -> None:
    with make(server.address, dataset) as loader:
        iterated = [list(loader) for _ in range(EPOCHS)]
        positions = [(e, i) for e in range(EPOCHS) for i in range(len(iterated[e]))]
        for epoch, index in random.Random(dataset).sample(positions, 20):
            assert same(loader.batch_at(epoch, index), iterated[epoch][index]), (epoch, index)


def test_batch_at_mid_iteration_leaves_the_loop_as_it_was(server: ServerProcess) -> None:
    with make(server.address, "toks") as plain:
        expected = list(plain)
    with make(server.address, "toks", prefetch=2) as loader:
        got = []
        for k, batch in enumerate(loader):
            got.append(batch)
            if k == 1:
                aside = loader.batch_at(2, 3)
                assert loader.state_dict()["next_batch"] == 2
        with make(server.address, "toks") as other:
            other.set_epoch(2)
            assert same(aside, list(other)[3])
    assert len(got) == len(expected) and all(map(same, got, expected))


def test_batch_at_torch_output_and_errors(server: ServerProcess) -> None:
    pytest.importorskip("torch")
    with RemoteLoader(server.address, "toks", batch_size=4, seed=7, timeout=60) as loader:
        first = next(iter(loader))
        again = loader.batch_at(0, 0)
        assert {type(v) for v in again.values()} == {type(v) for v in first.values()}
        assert all(bool((again[k] == first[k]).all()) for k in first)
        with pytest.raises(RemoteError) as e:
            loader.batch_at(0, len(loader))
        assert e.value.code.name == "INVALID_ARGUMENT"
        with pytest.raises(ValueError, match="index"):
            loader.batch_at(0, -1)


def test_batch_at_in_an_epoch_resumed_at_another_world_size(server: ServerProcess) -> None:
    with make(server.address, "pics", rank=0) as saver:
        it = iter(saver)
        next(it)
        state = saver.state_dict()
    with RemoteLoader(server.address, "pics", batch_size=2, seed=7, rank=0, world_size=3,
                      output="numpy", timeout=60) as loader:
        loader.load_state_dict(state)
        rest = []
        for batch in loader:  # still in epoch 0: batch_at counts from its `start`
            rest.append(batch)
            if len(rest) == 2:
                break
        assert same(loader.batch_at(0, 1), rest[1])



# -- seek -----------------------------------------------------------------------------------
def run(loader: RemoteLoader, epochs: int = EPOCHS) -> list[dict[str, np.ndarray]]:
    """Every batch from the loader's position to the end of epoch `epochs - 1`."""
    batches: list[dict[str, np.ndarray]] = []
    while loader.state_dict()["epoch"] < epochs:
        batches += list(loader)
    return batches


@pytest.mark.parametrize("dataset", ["toks", "docs", "mix", "docmix"])
def test_seek_then_iterating_equals_an_unstopped_run(server: ServerProcess,
                                                     dataset: str) -> None:
    with make(server.address, dataset) as loader:
        unstopped = run(loader)
    per_epoch = None if "batch_tokens" in SIZES[dataset] else len(unstopped) // EPOCHS
    for step in sorted({0, 1, 5, len(unstopped) // 2, len(unstopped) - 1,
                        *(random.Random(dataset).sample(range(len(unstopped)), 4))}):
        with make(server.address, dataset) as loader:
            loader.seek(step)
            if per_epoch:
                state = loader.state_dict()
                assert (state["epoch"], state["next_batch"]) == divmod(step, per_epoch)
            rest = run(loader)
        assert len(rest) == len(unstopped) - step, step
        assert all(map(same, rest, unstopped[step:])), step


def take(loader: RemoteLoader, steps: int) -> dict[str, Any]:
    """The loader's state after `steps` more batches (across epochs)."""
    taken = 0
    while taken < steps:
        for _ in loader:
            taken += 1
            if taken == steps:
                break
    return loader.state_dict()


def resumed(address: str, dataset: str, history: list[tuple[int, int]], rank: int
            ) -> list[dict[str, np.ndarray]]:
    """Rank `rank`'s batches, to the end of epoch EPOCHS - 1, of a job that ran at each size
    of `history` ((from_step, world_size)) from that step, resuming from rank 0's state."""
    state = None
    for (since, world), (until, _) in itertools.pairwise(history):
        with make(address, dataset, rank=0, world_size=world) as loader:
            if state is not None:
                loader.load_state_dict(state)
            state = take(loader, until - since)
    with make(address, dataset, rank=rank, world_size=history[-1][1]) as loader:
        loader.load_state_dict(state)
        return run(loader)


@pytest.mark.parametrize("dataset", ["toks", "docs", "mix", "docmix"])
def test_seek_after_an_elastic_change_equals_the_resumed_run(server: ServerProcess,
                                                             dataset: str, ledger) -> None:
    """A job ran 2 ranks, then 3 from step `change` (an elastic load_state_dict): a 3-rank
    loader's seek(k, world_sizes=...) then iterating gives the batches that job gave from
    step k on, for k at the change and after it, and with the change at k itself."""
    with make(server.address, dataset) as loader:
        change = len(loader) + 2  # in epoch 1, mid-epoch
    history = [(0, 2), (change, 3)]
    rest = resumed(server.address, dataset, history, rank=2)
    steps = sorted({change, change + 1, change + len(rest) // 2, change + len(rest) - 1})
    for k in steps:
        with make(server.address, dataset, rank=2, world_size=3) as loader:
            loader.seek(k, world_sizes=history)
            got = run(loader)
        lost, duplicated = ledger.compare(
            [int(i) for b in got for i in b["sample_index"]],
            [int(i) for b in rest[k - change:] for i in b["sample_index"]])
        ledger.record("clients", f"seek after an elastic change (2 -> 3 ranks), {dataset}",
                      lost=lost, duplicated=duplicated,
                      detail=f"step {k}: the resumed run's samples from there, rank 2")
        assert len(got) == len(rest) - (k - change), k
        assert all(map(same, got, rest[k - change:])), k
    with make(server.address, dataset, rank=2, world_size=3) as loader:
        loader.seek(change, world_sizes=2)  # every step before at 2 ranks: the same
        assert all(map(same, run(loader), rest))


def test_seek_across_two_changes_of_size(server: ServerProcess) -> None:
    history = [(0, 2), (3, 4), (9, 3)]
    rest = resumed(server.address, "docs", history, rank=0)
    with make(server.address, "docs", rank=0, world_size=3) as loader:
        loader.seek(10, world_sizes=history)
        assert all(map(same, run(loader), rest[1:]))


def test_seek_in_a_loader_that_iterated_goes_there(server: ServerProcess) -> None:
    with make(server.address, "mix") as loader:
        unstopped = run(loader)
    with make(server.address, "mix") as loader:
        it = iter(loader)
        next(it), next(it)
        loader.seek(3)
        assert same(next(iter(loader)), unstopped[3])
        loader.seek(len(unstopped) - 1)
        assert same(next(iter(loader)), unstopped[-1])


class Counted(pb_grpc.DataServiceStub):
    """A stub that counts the DescribeDataset calls made through it (blocking or `.future`:
    first contact asks every server at once, with futures)."""

    calls = 0

    def __init__(self, channel: Any) -> None:
        super().__init__(channel)
        self.DescribeDataset = _CountedCall(self.DescribeDataset)


class _CountedCall:
    def __init__(self, call: Any) -> None:
        self._call = call

    def __call__(self, *a: Any, **kw: Any) -> Any:
        Counted.calls += 1
        return self._call(*a, **kw)

    def future(self, *a: Any, **kw: Any) -> Any:
        Counted.calls += 1
        return self._call.future(*a, **kw)


@pytest.mark.parametrize(("dataset", "far"), [("toks", 100_000), ("docs", 20_000)])
def test_seek_far_is_one_request_and_as_fast_as_near(server: ServerProcess, dataset: str,
                                                     far: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Cut by count, arithmetic; under batch_tokens the first seek far makes the plans of the
    epochs before it (once per server: about 4 ms an epoch of these 200 documents), and every
    later one bisects their steps."""
    monkeypatch.setattr(pb_grpc, "DataServiceStub", Counted)
    took: dict[int, list[float]] = {10: [], far: []}
    with make(server.address, dataset, connect_timeout=100) as loader:
        loader.describe()  # first contact aside
        loader.seek(far)  # under batch_tokens: the plans of the epochs before it, once
        for _ in range(5):
            for step in took:
                before, t0 = Counted.calls, time.perf_counter()
                loader.seek(step)
                took[step].append(time.perf_counter() - t0)
                assert Counted.calls == before + 1  # one request, not a replay
        if dataset == "toks":
            assert loader.state_dict()["epoch"] == far // len(loader)
    near, farther = (sorted(t)[2] for t in took.values())
    assert farther < 2 * near + 0.05, took  # medians; a generous floor for a busy machine


def test_seek_errors(server: ServerProcess) -> None:
    with make(server.address, "toks") as loader:
        for bad in (-1, 1.5, True):
            with pytest.raises(ValueError, match="step"):
                loader.seek(bad)  # type: ignore[arg-type]
        for bad_sizes in ("4", [(1, 4)], [(0, 4), (0, 3)], [(0, 0)], [(0, 4), (9, 3)],
                          [(0, 2.0)]):
            with pytest.raises(ValueError, match="world_sizes"):
                loader.seek(5, world_sizes=bad_sizes)  # type: ignore[arg-type]


def test_each_epoch_of_a_token_budget_has_its_own_plans_steps(server: ServerProcess) -> None:
    """Plans differ by epoch: iterating gives each epoch all of its steps (once, the loader
    kept epoch 0's count for every epoch, and lost or overran a step). The legacy order's
    whole-epoch plans: under index orders every epoch has the same steps by construction."""
    sizes = []
    for epoch in range(EPOCHS + 1):
        with make(server.address, "docs", order="legacy") as fresh:
            fresh.set_epoch(epoch)
            sizes.append(len(fresh))
    assert len(set(sizes)) > 1  # else this test shows nothing: change the data
    with make(server.address, "docs", order="legacy") as loader:
        assert [len(list(loader)) for _ in sizes] == sizes
