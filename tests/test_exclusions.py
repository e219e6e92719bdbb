"""Leaving samples out (`RemoteLoader.exclude`) through real servers: the excluded samples are
dropped from the batches that held them, every other sample stays where it was, and the
exclusion survives resumes (state_dict), an elastic change of world size, and seek."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import determinism_datasets
import numpy as np
import pytest

from stoker.client import RemoteError, RemoteLoader
from stoker.server import ServerProcess

from conftest import StartServer

pytestmark = pytest.mark.timeout(120)

N, BATCH = 48, 3


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory,
           start_server_module: StartServer) -> ServerProcess:
    return start_server_module(determinism_datasets.make(tmp_path_factory.mktemp("ex")))


def make(address: str, rank: int = 0, world: int = 2, dataset: str = "plain",
         **kw: Any) -> RemoteLoader:
    size = {"batch_tokens": 64} if dataset == "docs" else {"batch_size": BATCH}
    return RemoteLoader(address, dataset, **size, seed=7, rank=rank, world_size=world,
                        output="numpy", timeout=60, **kw)


def indices(batches: list[dict[str, np.ndarray]]) -> list[int]:
    return [int(i) for b in batches for i in b["sample_index"]]


@pytest.mark.parametrize("dataset", ["plain", "docs"])
def test_excluded_samples_are_dropped_and_the_rest_stays_in_place(server: ServerProcess,
                                                                  dataset: str) -> None:
    with make(server.address, dataset=dataset) as loader:
        plain = [list(loader) for _ in range(2)]
    # Every sample of one batch (an empty batch), and one of another.
    out = {*plain[0][1]["sample_index"].tolist(), int(plain[1][2]["sample_index"][0])}
    with make(server.address, dataset=dataset) as loader:
        loader.exclude(sorted(out))
        assert loader.excluded == tuple(sorted(out))
        cut = [list(loader) for _ in range(2)]
        assert loader.batch_at(0, 1)["sample_index"].tolist() == []
    for before, after in zip(plain, cut, strict=True):
        assert len(before) == len(after)  # positions are not renumbered
        for b, a in zip(before, after, strict=True):
            keep = ~np.isin(b["sample_index"], list(out))
            for k in b:  # padded fields: to the rest's longest, which may be shorter
                width = a[k].shape[1] if a[k].ndim == 2 else None
                assert np.array_equal(b[k][keep][:, :width] if width is not None
                                      else b[k][keep], a[k]), k


def job_steps(address: str, world: int, steps: int | None, state: dict | None,
              exclude: list[int] = ()) -> tuple[list[int], dict]:
    """Every rank of a `world`-rank job from `state`, for `steps` steps (None: to the end of
    epoch 1); the samples it used, and rank 0's state after."""
    used: list[int] = []
    states = []
    for rank in range(world):
        with make(address, rank, world) as loader:
            if state is not None:
                loader.load_state_dict(state)
            loader.exclude(exclude)
            got = list(_take(loader, steps))
            used += indices(got)
            states.append(loader.state_dict())
    return used, states[0]


def _take(loader: RemoteLoader, steps: int | None) -> Iterator[dict[str, np.ndarray]]:
    if steps is None:
        while loader.state_dict()["epoch"] < 2:
            yield from loader
        return
    for k, batch in enumerate(loader):
        yield batch
        if k + 1 == steps:
            break


def test_an_exclusion_survives_two_resumes_and_an_elastic_change(server: ServerProcess,
                                                                 ledger) -> None:
    schedule = [(2, 2), (2, 3), (3, None)]  # (world_size, steps): 2 ranks, again, then 3
    used0, state = job_steps(server.address, *schedule[0], None)
    # Left out from the first resume on: samples the job has not used yet in epoch 0.
    rest = [i for i in range(N) if i not in set(used0)]
    out = sorted(rest[::5])
    used1, state = job_steps(server.address, *schedule[1], state, exclude=out)
    assert state["coordinates"]["excluded"] == out
    used2, _ = job_steps(server.address, *schedule[2], state)  # carried by the state alone
    # The same schedule without the exclusion: what the job would have used.
    ref0, ref_state = job_steps(server.address, *schedule[0], None)
    ref1, ref_state = job_steps(server.address, *schedule[1], ref_state)
    ref2, _ = job_steps(server.address, *schedule[2], ref_state)
    got = used0 + used1 + used2
    want = ref0 + [i for i in ref1 + ref2 if i not in set(out)]
    lost, duplicated = ledger.compare(got, want)
    ledger.record("clients", "exclude samples, resume twice (2 ranks, then 3)", tried=1,
                  lost=lost, duplicated=duplicated,
                  detail=f"{len(out)} samples excluded, {len(got)} used over 2 epochs")
    assert (lost, duplicated) == (0, 0)
    assert not set(out) & set(used1 + used2)
    assert len(set(ref0 + ref1 + ref2)) == N  # every sample was due, so each excluded was


def test_seek_honours_the_exclusion(server: ServerProcess) -> None:
    with make(server.address) as loader:
        loader.exclude([5, 17])
        unstopped = [b for _ in range(2) for b in loader]
    with make(server.address) as loader:
        loader.exclude([17, 5])
        loader.seek(11)
        rest = [b for _ in range(2) for b in loader]
    assert [b["sample_index"].tolist() for b in rest[:len(unstopped) - 11]] == \
        [b["sample_index"].tolist() for b in unstopped[11:]]
    assert not {5, 17} & set(indices(rest))


def test_seek_after_an_elastic_change_honours_the_exclusion(server: ServerProcess) -> None:
    """A 2-rank job took 5 steps, then 3 ranks went on without `out`: a 3-rank loader that
    excludes them and seeks to step 7 with that history gives what that job gave there."""
    _, state = job_steps(server.address, 2, 5, None)
    out = [3, 11, 30]
    with make(server.address, 1, 3) as resumed:
        resumed.load_state_dict(state)
        resumed.exclude(out)
        want = list(_take(resumed, None))[2:]
    with make(server.address, 1, 3) as loader:
        loader.exclude(out)
        loader.seek(7, world_sizes=[(0, 2), (5, 3)])
        got = list(_take(loader, None))
    assert got and indices(got) == indices(want) and not set(out) & set(indices(got))


def test_exclude_errors(server: ServerProcess) -> None:
    with make(server.address) as loader:
        for bad in ([-1], [1.5], ["3"], [True]):
            with pytest.raises(ValueError, match="indices must be ints"):
                loader.exclude(bad)
        with pytest.raises(ValueError, match="at most 100000"):
            loader.exclude(range(100_001))
        for _ in loader:
            with pytest.raises(RuntimeError, match="inside a loop"):
                loader.exclude([1])
            break
        loader.exclude([N])  # past the dataset: the servers say so
        with pytest.raises(RemoteError, match="excluded"):
            next(iter(loader))
