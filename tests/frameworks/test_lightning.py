"""PyTorch Lightning: a fit stopped by an exception mid-epoch and resumed with ckpt_path reads
what an unstopped run reads, in one process and on 2 DDP ranks (gloo, CPU), through
StokerDataModule (examples/lightning_train.py is the job: Lightning's DDP launcher starts the
other rank by running the script again)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stoker.server import ServerProcess

from resumed_runs import stopped_and_resumed

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("devices", [1, 2])
def test_fit_stopped_mid_epoch_resumes_with_ckpt_path_at_the_exact_next_batch(
        line_server: ServerProcess, run_example, ledger, tmp_path: Path, devices: int
) -> None:
    # 240 samples, batch 8: epochs of 30 steps at 1 rank, 15 at 2; the run crosses them.
    run = stopped_and_resumed(run_example, "lightning_train.py", line_server.address, devices,
                              tmp_path)
    out, ranks, got = run.out, run.ranks, run.samples("got")
    lost, duplicated = ledger.compare(got, run.samples("want"))
    ledger.record("clients", f"Lightning fit ({devices} process{'es' if devices > 1 else ''}"
                  f"{', DDP gloo' if devices > 1 else ''}) stopped by an exception at step 12 "
                  "of 36, resumed with ckpt_path", lost=lost, duplicated=duplicated,
                  detail=f"{len(got)} samples, each rank in an unstopped run's order")
    for rank in ranks.values():
        assert len(rank["got"]) == 36
        assert rank["got"] == rank["want"], out.stdout
    if devices == 2:  # the ranks read disjoint shares: Lightning did not re-shard
        assert not {i for b in ranks["0"]["got"][:15] for i in b} & \
            {i for b in ranks["1"]["got"][:15] for i in b}


def test_the_data_module_takes_its_rank_from_the_trainer_and_says_so() -> None:
    from stoker.integrations.lightning import StokerDataModule

    for name in ("rank", "world_size"):
        with pytest.raises(TypeError, match=f"StokerDataModule takes no '{name}': the "
                                            "trainer's global rank and world size"):
            StokerDataModule("127.0.0.1:1", "line", 8, **{name: 0})
    with pytest.raises(RuntimeError, match=r"made for a Trainer: pass it to trainer\.fit"):
        StokerDataModule("127.0.0.1:1", "line", 8).train_dataloader()
