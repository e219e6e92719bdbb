"""The batches a RemoteLoader yields, against torch's DataLoader and the shuffle contract."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from stoker.client import RemoteLoader
from stoker.server import ServerProcess

from toy_datasets import Toy

N = 103  # TOY_DATASETS["toy"]: not a multiple of any world size or batch size used here


def remote(server: ServerProcess, **kw) -> RemoteLoader:
    kw.setdefault("batch_size", 8)
    return RemoteLoader(server.address, "toy", timeout=60, **kw)


@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize("drop_last", [True, False])
def test_matches_dataloader_with_distributed_sampler(toy_server: ServerProcess, world_size: int,
                                                     drop_last: bool) -> None:
    ds = Toy(n=N)
    for rank in range(world_size):
        sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=False,
                                     drop_last=True)
        expected = list(DataLoader(ds, batch_size=8, sampler=sampler, drop_last=drop_last))
        with remote(toy_server, shuffle=False, drop_last=drop_last, rank=rank,
                    world_size=world_size) as loader:
            got = list(loader)
            assert len(loader) == len(expected)
        assert len(got) == len(expected)
        order = torch.tensor(list(sampler))
        for k, (want, have) in enumerate(zip(expected, got, strict=True)):
            assert set(have) == set(want) | {"sample_index"}
            for key, value in want.items():
                assert have[key].dtype == value.dtype, key
                assert torch.equal(have[key], value), key
            assert torch.equal(have["sample_index"], order[8 * k : 8 * k + 8])


def _epoch(server: ServerProcess, epoch: int, seed: int = 0, **kw) -> list[np.ndarray]:
    with remote(server, shuffle=True, drop_last=False, seed=seed, output="numpy", **kw) as loader:
        loader.set_epoch(epoch)
        return [b["sample_index"] for b in loader]


def test_sample_index_names_the_samples(toy_server: ServerProcess) -> None:
    with remote(toy_server, shuffle=True, output="numpy") as loader:
        for batch in loader:
            # Toy's x is arange(dim) + i: the payload really is sample sample_index[j].
            assert np.array_equal(batch["x"][:, 0], batch["sample_index"].astype(np.float32))


def test_shuffle_partitions_a_permutation_across_ranks(toy_server: ServerProcess) -> None:
    world = 3
    per_rank = [np.concatenate(_epoch(toy_server, 0, rank=r, world_size=world))
                for r in range(world)]
    everything = np.concatenate(per_rank)
    assert all(len(p) == N // world for p in per_rank)
    assert len(np.unique(everything)) == len(everything)  # each sample at most once per epoch
    assert everything.min() >= 0 and everything.max() < N
    assert not np.array_equal(np.sort(per_rank[0]), per_rank[0])  # it is shuffled


def test_shuffle_is_a_function_of_seed_and_epoch(toy_server: ServerProcess) -> None:
    e0 = np.concatenate(_epoch(toy_server, 0))
    assert np.array_equal(e0, np.concatenate(_epoch(toy_server, 0)))
    e1 = np.concatenate(_epoch(toy_server, 1))
    assert not np.array_equal(e0, e1)
    assert np.array_equal(np.sort(e0), np.sort(e1))
    assert not np.array_equal(e0, np.concatenate(_epoch(toy_server, 0, seed=1)))
