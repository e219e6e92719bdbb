"""Where rank and world_size come from when the caller does not say."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from stoker.client import RemoteLoader

ADDRESS = "127.0.0.1:1"  # nothing is asked of the server to build the coordinates


def coords(**kw) -> tuple[int, int]:
    loader = RemoteLoader(ADDRESS, "toy", batch_size=4, **kw)
    try:
        c = loader.coordinates()
        return c.rank, c.world_size
    finally:
        loader.close()


def test_without_anything_rank_0_of_1(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert coords() == (0, 1)


def test_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "5")
    assert coords() == (2, 5)
    assert coords(rank=4) == (4, 5)  # what the caller says wins


def test_torch_distributed_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "5")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        assert coords() == (0, 1)
    finally:
        dist.destroy_process_group()
