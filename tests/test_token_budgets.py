"""Token budgets (`batch_tokens`) through real servers: every rank's batch within 5% of the
others' tokens (or squared lengths) at every step, at most batch_tokens real tokens, padded
to the batch's longest with an attention mask or packed with cu_seqlens; the same batches
from one server or two; every sample once per epoch across the ranks; resume mid-epoch; the
errors a user can meet."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from epochs import epoch

from stoker.client import RemoteError, RemoteLoader
from stoker.server import ServerProcess

from conftest import StartServer

pytestmark = pytest.mark.timeout(120)

N = 400
BUDGET = 1024
WORLD = 3


def _lengths() -> np.ndarray:
    return np.random.default_rng(7).integers(8, 160, N)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two JSON lines files of token lists of 8..159 tokens (value = sample index), and one
    Parquet file of the same rows with a `length` column."""
    folder = tmp_path_factory.mktemp("tokens")
    lengths = _lengths()
    (folder / "jsonl").mkdir()
    for f, rows in enumerate((range(0, 250), range(250, N))):
        with open(folder / "jsonl" / f"part-{f}.jsonl", "w") as out:
            for i in rows:
                out.write(json.dumps({"ids": [i] * int(lengths[i]), "label": i}) + "\n")
    pq.write_table(pa.table({"label": np.arange(N), "length": lengths}),
                   folder / "rows.parquet", row_group_size=100)
    return folder


def datasets(folder: Path) -> dict[str, Any]:
    fields = {"ids": {"dtype": "int64", "shape": [-1]}, "label": {"dtype": "int64"}}
    return {
        "docs": {"format": "jsonl", "source": str(folder / "jsonl"), "fields": fields,
                 "length_column": "ids"},
        "plain": {"format": "jsonl", "source": str(folder / "jsonl"),
                  "fields": {"label": {"dtype": "int64"}}},
        "rows": {"format": "parquet", "source": str(folder / "rows.parquet"),
                 "fields": {"label": {}}, "length_column": "length"},
    }


@pytest.fixture(scope="module")
def server(data: Path, start_server_module: StartServer) -> ServerProcess:
    return start_server_module(datasets(data), workers=2)


def rank_epoch(address: str | list[str], rank: int, world: int = WORLD, dataset: str = "docs",
               **kw: Any) -> list[dict[str, np.ndarray]]:
    """Rank `rank`'s epoch of `dataset` under a token budget; as many batches as len() said."""
    batches = epoch(address, dataset, batch_tokens=kw.pop("batch_tokens", BUDGET), seed=3,
                    rank=rank, world_size=world, **kw)
    assert len(batches) == batches.length
    return batches


@pytest.mark.parametrize("cost", ["tokens", "squares"])
def test_ranks_balanced_within_5_percent_and_every_sample_once(server: ServerProcess,
                                                               cost: str) -> None:
    lengths = _lengths()
    ranks = [rank_epoch(server.address, r, token_cost=cost) for r in range(WORLD)]
    assert len({len(r) for r in ranks}) == 1 and len(ranks[0]) > 10
    seen = []
    for step in zip(*ranks, strict=True):
        costs = []
        for b in step:
            idx = b["sample_index"]
            mask = b["attention_mask"]
            # Padded to the batch's longest; the mask marks each sample's real tokens.
            assert b["ids"].shape == mask.shape == (len(idx), lengths[idx].max())
            assert mask.sum(axis=1).tolist() == lengths[idx].tolist()
            assert (b["ids"][mask == 1] == np.repeat(idx, lengths[idx])).all()
            assert (b["ids"][mask == 0] == 0).all()
            assert b["label"].tolist() == idx.tolist()
            assert lengths[idx].sum() <= BUDGET
            costs.append(int((lengths[idx] ** (1 if cost == "tokens" else 2)).sum()))
            seen += idx.tolist()
        assert max(costs) - min(costs) <= 0.05 * max(costs), costs
    assert len(seen) == len(set(seen))  # no sample twice in an epoch, across ranks
    assert N - len(seen) < WORLD  # the tail drops fewer than world_size samples


def test_same_batches_from_one_or_two_servers_and_a_resume(
        data: Path, server: ServerProcess, start_server: StartServer) -> None:
    other = start_server(datasets(data))
    alone = rank_epoch(server.address, 1)
    both = rank_epoch([server.address, other.address], 1)
    assert len(alone) == len(both)
    for a, b in zip(alone, both, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    # Resume mid-epoch from a state_dict, on the other server.
    with RemoteLoader(server.address, "docs", batch_tokens=BUDGET, seed=3, rank=1,
                      world_size=WORLD, output="numpy", timeout=60) as loader:
        it = iter(loader)
        for _ in range(5):
            next(it)
        state = loader.state_dict()
    with RemoteLoader(other.address, "docs", batch_tokens=BUDGET, seed=3, rank=1,
                      world_size=WORLD, output="numpy", timeout=60) as loader:
        loader.load_state_dict(state)
        rest = list(loader)
    assert [b["sample_index"].tolist() for b in rest] == \
        [b["sample_index"].tolist() for b in alone[5:]]
    # At another world_size the consumed prefix is the plan's, not next_batch x a batch size:
    # a server says where the plan ended step 5 (tests/test_elastic_tokens.py goes further).
    with RemoteLoader(other.address, "docs", batch_tokens=BUDGET, seed=3, rank=0,
                      world_size=WORLD + 1, output="numpy", timeout=60) as loader:
        loader.load_state_dict(state)
        assert loader.state_dict()["coordinates"]["start"] > 0
        taken = {i for b in alone[:5] for i in b["sample_index"].tolist()}
        assert not taken & {i for b in loader for i in b["sample_index"].tolist()}


def test_parquet_length_column_and_pack(server: ServerProcess) -> None:
    lengths = _lengths()
    ranks = [rank_epoch(server.address, r, world=2, dataset="rows", batch_tokens=2048)
             for r in range(2)]
    for step in zip(*ranks, strict=True):
        tokens = [int(lengths[b["sample_index"]].sum()) for b in step]
        assert max(tokens) - min(tokens) <= 0.05 * max(tokens) and max(tokens) <= 2048
    torch = pytest.importorskip("torch")
    with RemoteLoader(server.address, "docs", batch_tokens=BUDGET, pack=True, shuffle=False,
                      timeout=60) as loader:
        batch = next(iter(loader))
    idx = batch["sample_index"].numpy()
    total = int(lengths[idx].sum())
    assert batch["ids"].shape == batch["position_ids"].shape == (1, total)
    assert "attention_mask" not in batch
    assert batch["cu_seqlens"].dtype == torch.int32
    assert batch["cu_seqlens"].tolist() == [0, *np.cumsum(lengths[idx]).tolist()]
    assert batch["ids"][0].tolist() == np.repeat(idx, lengths[idx]).tolist()
    assert int(batch["max_seqlen"]) == int(lengths[idx].max())


def test_errors_name_what_is_wrong(server: ServerProcess, ledger) -> None:
    with pytest.raises(ValueError, match="batch_size=8 and batch_tokens=64: give one"):
        RemoteLoader(server.address, "docs", 8, batch_tokens=64)
    with pytest.raises(ValueError, match="batch_size or batch_tokens is required"):
        RemoteLoader(server.address, "docs")
    with pytest.raises(RemoteError) as info:
        rank_epoch(server.address, 0, dataset="plain")
    assert "batch_tokens: dataset 'plain' does not know its samples' lengths" in \
        info.value.details
    assert "length_column" in info.value.details
    longest = int(_lengths().max())
    with pytest.raises(RemoteError) as info:
        rank_epoch(server.address, 0, batch_tokens=100)
    assert f"has {longest} tokens, more than batch_tokens=100" in info.value.details
    ledger.record("bad requests", "batch_tokens: with batch_size, on a dataset without "
                  "lengths, below the longest sample: an error naming it", tried=4)
