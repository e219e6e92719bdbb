"""torch.distributed.checkpoint: a loader's position saved at 2 ranks (processes, gloo)
and loaded at 2 and at 3 resumes every rank exactly; LoaderState keeps what DCP would drop."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

from stoker.client import RemoteLoader
from stoker.integrations.dcp import LoaderState
from stoker.server import ServerProcess

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import dcp_resume  # examples/dcp_resume.py: its ranks are this test's

# The resume test runs 3 jobs of 2 or 3 ranks: 25-50 s here, 179 s once at a load average
# of 12 on the 2-core machine (20 runs in a loop beside four other developers' work).
pytestmark = pytest.mark.timeout(300)

BATCH, STOP_AT = 4, 6


def loader(server: ServerProcess, rank: int = 0, world_size: int = 1) -> RemoteLoader:
    return RemoteLoader(server.address, "line", batch_size=BATCH, rank=rank,
                        world_size=world_size, timeout=60)


def test_a_remote_loader_is_a_dcp_stateful(line_server: ServerProcess) -> None:
    with loader(line_server) as ld:
        assert isinstance(ld, Stateful)
        assert isinstance(LoaderState(ld), Stateful)
    with pytest.raises(TypeError, match="LoaderState keeps a RemoteLoader's position, got dict"):
        LoaderState({})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a LoaderState"):
        LoaderState(ld).load_state_dict({"next_batch": 3})


def test_save_at_2_ranks_resumes_at_2_and_at_3_exactly(line_server: ServerProcess, ledger,
                                                        tmp_path: Path) -> None:
    common = {"address": line_server.address, "batch_size": BATCH, "ckpt": str(tmp_path / "c")}
    before = dcp_resume.job(2, load=False, stop_at=STOP_AT, out=str(tmp_path / "b"), **common)
    assert [len(r["read"]) for r in before] == [STOP_AT * BATCH] * 2
    order = dcp_resume.epoch_order(line_server.address)
    for world in (2, 3):
        after = dcp_resume.job(world, load=True, stop_at=0, out=str(tmp_path / f"a{world}"),
                               **common)
        assert {r["start"] for r in after} == {2 * STOP_AT * BATCH}  # every rank: 48 consumed
        assert all(r["restored"] == before[0]["weight"] for r in after)  # the model too
        found = dcp_resume.compare(order, [(before, 2), (after, world)])
        ledger.record("clients", f"DCP save at 2 ranks (gloo) after step {STOP_AT}, load at "
                      f"{world}: the rest of the epoch", lost=found["lost"],
                      duplicated=found["duplicated"],
                      detail=f"{found['read']} of {found['samples']} samples read, "
                             f"{found['wrong']} out of their slot")
        assert found == {"samples": 240, "read": 240, "lost": 0, "duplicated": 0, "wrong": 0}


def test_loader_state_keeps_what_a_bare_loader_loses_through_dcp(line_server: ServerProcess,
                                                                 tmp_path: Path) -> None:
    """A job resumed at another size (start 48) and saved again: through LoaderState the next
    job gets the whole position; a bare loader's DCP load fills only the keys a fresh loader's
    state has, so `start` and the fingerprint are lost (why LoaderState exists)."""
    with loader(line_server, 0, 2) as first:
        it = iter(first)
        for _ in range(STOP_AT):
            next(it)
        saved_at_2 = first.state_dict()
    resumed = loader(line_server, 0, 3)
    resumed.load_state_dict(saved_at_2)
    state = resumed.state_dict()
    assert state["coordinates"]["start"] == 48 and "fingerprint" in state
    with warnings.catch_warnings():  # DCP says it saves in one process: that is the point
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"loader": LoaderState(resumed)}, checkpoint_id=tmp_path / "kept")
        dcp.save({"loader": resumed}, checkpoint_id=tmp_path / "bare")
        with loader(line_server, 0, 3) as kept, loader(line_server, 0, 3) as bare:
            dcp.load({"loader": LoaderState(kept)}, checkpoint_id=tmp_path / "kept")
            dcp.load({"loader": bare}, checkpoint_id=tmp_path / "bare")
            assert kept.state_dict() == state
            assert "start" not in bare.state_dict()["coordinates"], \
                "DCP now loads leaves a fresh state lacks: say so in docs/integrations.md"
    resumed.close()
