"""Elastic resume under token budgets (`batch_tokens`, with and without `pack`) through real
servers: a job saved at N ranks goes on at M with the rest of the epoch, each position read
at most once, only the new plan's tail (fewer than M samples) left out, every rank within
5% of the step's largest token count."""

from __future__ import annotations

from typing import Any

import determinism_datasets
import numpy as np
import pytest

from stoker.client import RemoteLoader
from stoker.server import ServerProcess

from conftest import StartServer

pytestmark = pytest.mark.timeout(120)

BUDGET = 160
BALANCE = 0.05


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory,
           start_server_module: StartServer) -> ServerProcess:
    return start_server_module(determinism_datasets.make(tmp_path_factory.mktemp("elastic")))


def make(address: str, rank: int, world: int, dataset: str = "docs", **kw: Any
         ) -> RemoteLoader:
    return RemoteLoader(address, dataset, batch_tokens=BUDGET, seed=3, rank=rank,
                        world_size=world, output="numpy", timeout=60, **kw)


def run(address: str, world: int, steps: int | None, state: dict | None, dataset: str = "docs"
        ) -> tuple[list[list[dict[str, np.ndarray]]], dict]:
    """Each rank's batches of `steps` steps (None: the rest of the epoch) from `state`, and
    rank 0's state after."""
    ranks, states = [], []
    for rank in range(world):
        with make(address, rank, world, dataset) as loader:
            if state is not None:
                loader.load_state_dict(state)
            got = []
            for batch in loader:
                got.append(batch)
                if len(got) == steps:
                    break
            ranks.append(got)
            states.append(loader.state_dict())
    return ranks, states[0]


def tokens(batch: dict[str, np.ndarray]) -> int:
    return int(batch["attention_mask"].sum())


@pytest.mark.parametrize(("n", "steps", "m"), [(2, 3, 3), (4, 2, 3)])
def test_the_rest_of_the_epoch_at_another_world_size(server: ServerProcess, ledger, n: int,
                                                     steps: int, m: int) -> None:
    first, state = run(server.address, n, steps, None)
    assert state["next_batch"] == steps
    rest, after = run(server.address, m, None, state)
    assert after["epoch"] == 1  # the rest of the epoch, then done
    used = [int(i) for job in (first, rest) for rank in job for b in rank
            for i in b["sample_index"]]
    n_docs = determinism_datasets.JSONL_ROWS[-1]
    lost, duplicated = ledger.compare(used, list(range(n_docs)))
    ledger.record("clients", f"resume batch_tokens at {n} ranks -> {m}", tried=1, lost=lost,
                  duplicated=duplicated, detail=f"{len(used)} of {n_docs} samples; the tail "
                                                f"dropped: fewer than {m}")
    assert duplicated == 0 and lost < m  # the new plan's tail: fewer than m positions
    for job in (first, rest):
        for step in zip(*job, strict=True):
            counts = [tokens(b) for b in step]
            assert max(counts) <= BUDGET
            assert max(counts) - min(counts) <= BALANCE * max(counts), counts
    # saved again mid-rest, at yet another size: the same rest, N -> M -> K
    part, again = run(server.address, m, 1, state)
    tail, _ = run(server.address, 2, None, again)
    resumed = [int(i) for job in (part, tail) for rank in job for b in rank
               for i in b["sample_index"]]
    assert len(set(resumed)) == len(resumed)
    assert set(resumed) <= set(range(n_docs)) - {int(i) for rank in first for b in rank
                                                 for i in b["sample_index"]}


@pytest.mark.parametrize(("n", "m"), [(2, 3), (4, 3)])
def test_a_mixture_cut_by_tokens_goes_on_at_another_world_size(server: ServerProcess, ledger,
                                                               n: int, m: int) -> None:
    """batch_tokens on a mixture (of two jsonl corpora): each rank within 5% of the step's
    tokens, both components in the batches, and the elastic resume as for one dataset."""
    (whole,), _ = run(server.address, 1, None, None, "docmix")  # the epoch's every position
    want = [int(i) for b in whole for i in b["sample_index"]]
    first, state = run(server.address, n, 2, None, "docmix")
    rest, after = run(server.address, m, None, state, "docmix")
    assert after["epoch"] == 1
    used = [int(i) for job in (first, rest) for rank in job for b in rank
            for i in b["sample_index"]]
    lost, duplicated = ledger.compare(used, want)
    ledger.record("clients", f"resume batch_tokens on a mixture at {n} ranks -> {m}", tried=1,
                  lost=lost, duplicated=duplicated,
                  detail=f"{len(used)} of {len(want)} positions; the tail: fewer than {m}")
    assert duplicated == 0 and lost < m and set(used) <= set(want)
    sources = {int(s) for job in (first, rest) for rank in job for b in rank
               for s in b["source"]}
    assert sources == {0, 1}
    for job in (first, rest):
        for step in zip(*job, strict=True):
            counts = [tokens(b) for b in step]
            assert max(counts) <= BUDGET
            assert max(counts) - min(counts) <= BALANCE * max(counts), counts


def test_pack_goes_on_at_another_world_size(server: ServerProcess) -> None:
    pytest.importorskip("torch")
    _, state = run(server.address, 2, 2, None)
    with RemoteLoader(server.address, "docs", batch_tokens=BUDGET, seed=3, rank=1,
                      world_size=3, pack=True, timeout=60) as packed, \
            make(server.address, 1, 3) as padded:
        packed.load_state_dict(state)
        padded.load_state_dict(state)
        for p, q in zip(packed, padded, strict=True):
            assert p["sample_index"].tolist() == q["sample_index"].tolist()
            assert int(p["cu_seqlens"][-1]) == tokens(q)
