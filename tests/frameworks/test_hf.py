"""The Hugging Face Trainer: StokerTrainer resumes a run stopped mid-epoch at the exact next
batch, and resuming at step 10,000 reads no skipped batch and takes as long as at step 10."""

from __future__ import annotations

import json
import re
import shutil
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from stoker.integrations.hf import STATE_FILE
from stoker.server import ServerProcess

from resumed_runs import stopped_and_resumed

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import hf_trainer  # examples/hf_trainer.py: its model and trainer are this test's

pytestmark = [pytest.mark.timeout(180),
              # the Trainer's own notes on a plain nn.Module, CPU, and so on
              pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]

LONG = 20_480  # samples of dataset "long": 20,480 batches of 1 an epoch, step 10,000 mid-epoch


@pytest.fixture(scope="module")
def long_server(start_server_module: Callable[..., ServerProcess]) -> ServerProcess:
    examples = Path(hf_trainer.__file__).parent
    return start_server_module(
        {"long": {"format": "python", "factory": "framework_data:line",
                  "options": {"n": LONG}}}, env={"PYTHONPATH": str(examples)})


def batches_served(server: ServerProcess, dataset: str) -> int:
    """The server's own count of the batches it sent of `dataset` (/metrics)."""
    text = urllib.request.urlopen(server.http_url + "/metrics", timeout=10).read().decode()
    return sum(int(float(n)) for n in re.findall(
        rf'^stoker_batches_total{{dataset="{dataset}"[^}}]*}} (\S+)$', text, re.M))


@pytest.mark.parametrize("devices", [1, 2])
def test_a_run_stopped_mid_epoch_resumes_at_the_exact_next_batch(
        line_server: ServerProcess, run_example, ledger, tmp_path: Path, devices: int
) -> None:
    # 240 samples, batch 8: epochs of 30 steps in one process, 15 on each of 2 DDP ranks
    # (torchrun, gloo); the runs cross them.
    run = stopped_and_resumed(run_example, "hf_trainer.py", line_server.address, devices,
                              tmp_path)
    out, ranks, got = run.out, run.ranks, run.samples("got")
    lost, duplicated = ledger.compare(got, run.samples("want"))
    ledger.record("clients", f"HF Trainer ({devices} process{'es, DDP gloo' if devices > 1 else ''}"
                  ") stopped by an exception at step 12 of 36, resume_from_checkpoint",
                  lost=lost, duplicated=duplicated,
                  detail=f"{len(got)} samples, each rank in an unstopped run's order")
    for rank in ranks.values():
        assert rank["got"] == rank["want"], out.stdout
        assert rank["resumed_batches"] == 24


def test_with_gradient_accumulation_that_does_not_divide_the_epoch(
        line_server: ServerProcess, ledger, tmp_path: Path) -> None:
    """4 batches a step, epochs of 30 batches (8 steps, the last of 2): stopped at step 3,
    resumed to step 10 in the next epoch. The Trainer counts the epoch's consumed batches as
    steps x 4; the loader's position says the same."""

    def run(stop_at: int | None) -> list[list[int]]:
        trainer, model = hf_trainer.trainer(line_server.address, str(tmp_path), 10, 3,
                                            gradient_accumulation_steps=4)
        if stop_at is not None:
            trainer.add_callback(hf_trainer.StopAt(stop_at))
            with pytest.raises(hf_trainer.Stop):
                trainer.train()
        else:
            trainer.train(resume_from_checkpoint=True)
        trainer.train_loader.close()
        return model.seen

    got = run(3) + run(None)
    want = hf_trainer.unstopped(line_server.address, 38, 8)
    lost, duplicated = ledger.compare([i for b in got for i in b], [i for b in want for i in b])
    ledger.record("clients", "HF Trainer with gradient_accumulation_steps=4 (epochs of 30 "
                  "batches) stopped at step 3, resume_from_checkpoint", lost=lost,
                  duplicated=duplicated, detail=f"{len(got)} batches in an unstopped run's order")
    assert got == want


def resume_at(server: ServerProcess, folder: Path, step: int) -> tuple[float, int]:
    """Resume from checkpoint-`step` and train one step: (seconds from train() to the first
    batch, batches the server sent meanwhile)."""
    trainer, model = hf_trainer.trainer(server.address, str(folder), step + 1, 1000,
                                        batch_size=1, dataset="long", prefetch=4)
    before = batches_served(server, "long")
    t0 = time.perf_counter()
    trainer.train(resume_from_checkpoint=str(folder / f"checkpoint-{step}"))
    sent = batches_served(server, "long") - before
    assert model.first_batch_at is not None and len(model.seen) == 1
    # ... and that batch is the epoch's batch `step`, as the server computes it
    assert model.seen[0] == trainer.train_loader.batch_at(0, step)["sample_index"].tolist()
    trainer.train_loader.close()
    return model.first_batch_at - t0, sent


def test_resuming_at_step_10000_reads_nothing_skipped_and_is_as_quick_as_at_10(
        long_server: ServerProcess, tmp_path: Path) -> None:
    trainer, _ = hf_trainer.trainer(long_server.address, str(tmp_path), 10, 10, batch_size=1,
                                    dataset="long", prefetch=4)
    trainer.train()
    trainer.train_loader.close()
    saved = tmp_path / "checkpoint-10"
    assert json.loads((saved / STATE_FILE).read_text())["next_batch"] == 10
    # Step 10,000's checkpoint: step 10's with the step moved on in both records the Trainer
    # and the loader keep (training 10,000 steps here would take minutes).
    far = tmp_path / "checkpoint-10000"
    shutil.copytree(saved, far)
    for name, key, value in (("trainer_state.json", "global_step", 10_000),
                             ("trainer_state.json", "epoch", 10_000 / LONG),
                             (STATE_FILE, "next_batch", 10_000)):
        state = json.loads((far / name).read_text())
        state[key] = value
        (far / name).write_text(json.dumps(state))
    timings: dict[int, list[float]] = {10: [], 10_000: []}
    served: dict[int, list[int]] = {10: [], 10_000: []}
    for step in (10, 10_000, 10, 10_000):  # alternated: neither gets the warm start alone
        seconds, sent = resume_at(long_server, tmp_path, step)
        timings[step].append(seconds)
        served[step].append(sent)
    near, far_s = min(timings[10]), min(timings[10_000])
    print(f"first batch after resuming at step 10: {near:.3f} s, at step 10,000: {far_s:.3f} s;"
          f" batches the server sent: {served}")
    # HF alone would read and discard 10,000 batches; here the server sends the step's batch
    # and the prefetch window (4), whatever the step.
    assert max(served[10_000]) <= 10 and max(served[10]) <= 10, served
    assert far_s < 2 * near + 0.5, timings


def test_bad_loaders_and_checkpoints_are_refused_naming_what_is_wrong(
        line_server: ServerProcess, tmp_path: Path) -> None:
    from transformers import TrainingArguments

    from stoker.client import RemoteLoader
    from stoker.integrations.hf import StokerTrainer

    args = TrainingArguments(str(tmp_path), max_steps=1, report_to="none", use_cpu=True)
    with pytest.raises(TypeError, match="train_loader must be a RemoteLoader, got list"):
        StokerTrainer(model=hf_trainer.Regression(), args=args, train_loader=[])
    with RemoteLoader(line_server.address, "line", batch_size=8, rank=1, world_size=2) as wrong:
        with pytest.raises(ValueError, match="train_loader reads rank 1 of world_size 2, but "
                                             "this process is rank 0 of 1"):
            StokerTrainer(model=hf_trainer.Regression(), args=args, train_loader=wrong)
    trainer, _ = hf_trainer.trainer(line_server.address, str(tmp_path), 1, 1)
    bare = tmp_path / "checkpoint-5"  # a plain Trainer's: no loader state
    bare.mkdir()
    with pytest.raises(FileNotFoundError, match=rf"checkpoint-5 has no {STATE_FILE}: not saved "
                                                r"by StokerTrainer.*loader\.seek"):
        trainer.train(resume_from_checkpoint=str(bare))
    (bare / STATE_FILE).write_text(json.dumps(trainer.train_loader.state_dict()))
    (bare / "trainer_state.json").write_text(json.dumps({"epoch": 3.5, "global_step": 105}))
    with pytest.raises(ValueError, match=r"is at epoch 0, the Trainer's state in .* at epoch 3: "
                                         r"not one checkpoint"):
        trainer.train(resume_from_checkpoint=str(bare))
    trainer.train_loader.close()
    # A loader state from another step than the Trainer's: the Trainer's skip says so
    trainer, _ = hf_trainer.trainer(line_server.address, str(tmp_path / "run"), 2, 2)
    trainer.train()
    trainer.train_loader.close()
    saved = tmp_path / "run" / "checkpoint-2"
    (saved / STATE_FILE).write_text(json.dumps({**json.loads((saved / STATE_FILE).read_text()),
                                                "next_batch": 1}))
    trainer, _ = hf_trainer.trainer(line_server.address, str(tmp_path / "run"), 3, 2)
    with pytest.raises(RuntimeError, match="the Trainer resumes after batch 2 of its epoch, but "
                                           "the loader is at batch 1 of epoch 0"):
        trainer.train(resume_from_checkpoint=str(saved))
    trainer.train_loader.close()
