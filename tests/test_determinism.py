"""Determinism as a tool, through real servers: any batch on demand (`batch_at`) equals the
batch iteration gives there, and asking for one does not disturb an iteration."""

from __future__ import annotations

import random
from typing import Any

import determinism_datasets
import numpy as np
import pytest

from stoker.client import RemoteError, RemoteLoader
from stoker.server import ServerProcess

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
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory,
           start_server_module: StartServer) -> ServerProcess:
    root = tmp_path_factory.mktemp("determinism")
    return start_server_module(determinism_datasets.make(root), workers=2)


def make(address: str, dataset: str, rank: int = 1, **kw: Any) -> RemoteLoader:
    return RemoteLoader(address, dataset, **{**SIZES[dataset], **kw}, seed=7, rank=rank,
                        world_size=WORLD, output="numpy", timeout=60)


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

