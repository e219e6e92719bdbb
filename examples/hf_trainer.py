"""The Hugging Face Trainer on a stoker server: crashed mid-epoch, resumed at the next batch.

    python examples/hf_trainer.py [--devices 2] [--steps 40] [--stop-at 12]

A tiny regression model trains with `StokerTrainer` (stoker.integrations.hf), whose train
loader is a RemoteLoader, in this process or, with `--devices N`, in N processes under
torchrun (DDP on CPU, gloo). The first `train()` raises an exception at step `--stop-at`, just
after the Trainer saved checkpoint-<stop-at> (with the loader's position in it); a new model,
loader and trainer then call `train(resume_from_checkpoint=True)` and train to `--steps`. The
example checks that, on every rank, the two runs together read exactly the batches one
RemoteLoader of that rank reads in a run that never stopped, and that the loss fell. Exits
non-zero otherwise.

`--address HOST:PORT` uses a running server that serves dataset "line" (framework_data.py);
without it the example starts one.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from framework_data import FEATURES, serve
from transformers import TrainerCallback, TrainingArguments

from stoker.client import RemoteLoader
from stoker.integrations.hf import StokerTrainer


class Stop(Exception):
    """The crash the first run simulates."""


class Regression(torch.nn.Module):
    """Returns {"loss": ...} as the Trainer expects; notes each batch's sample_index, and when
    the first batch of a run arrived."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(FEATURES, 1)
        self.seen: list[list[int]] = []
        self.losses: list[float] = []
        self.first_batch_at: float | None = None

    def forward(self, x: torch.Tensor, y: torch.Tensor, sample_index: torch.Tensor
                ) -> dict[str, torch.Tensor]:
        if self.first_batch_at is None:
            self.first_batch_at = time.perf_counter()
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.seen.append(sample_index.tolist())
        self.losses.append(loss.item())
        return {"loss": loss}


class StopAt(TrainerCallback):
    """Raises Stop as step `step` + 1 begins (checkpoint-`step` is saved by then)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            raise Stop(f"stopped at step {state.global_step}")


def trainer(address: str, out: str, steps: int, save_steps: int, batch_size: int = 8,
            dataset: str = "line", gradient_accumulation_steps: int = 1, **options: Any
            ) -> tuple[StokerTrainer, Regression]:
    """A new StokerTrainer (and its model) reading `dataset` from `address` (RemoteLoader's
    `options`)."""
    torch.manual_seed(0)
    args = TrainingArguments(out, max_steps=steps, save_steps=save_steps, learning_rate=0.05,
                             lr_scheduler_type="constant", optim="sgd", logging_strategy="no",
                             report_to="none", disable_tqdm=True, use_cpu=True, seed=0,
                             per_device_train_batch_size=batch_size,
                             gradient_accumulation_steps=gradient_accumulation_steps)
    loader = RemoteLoader(address, dataset, batch_size=batch_size, rank=args.process_index,
                          world_size=args.world_size, timeout=60, **options)
    model = Regression()
    return StokerTrainer(model=model, args=args, train_loader=loader), model


def unstopped(address: str, steps: int, batch_size: int, rank: int = 0, world_size: int = 1
              ) -> list[list[int]]:
    """What `rank` reads in a run that never stopped: `steps` batches, epoch after epoch."""
    seen: list[list[int]] = []
    with RemoteLoader(address, "line", batch_size=batch_size, rank=rank, world_size=world_size,
                      timeout=60) as loader:
        while len(seen) < steps:
            for batch in loader:
                seen.append(batch["sample_index"].tolist())
                if len(seen) == steps:
                    break
    return seen


def train_twice(address: str, args: argparse.Namespace, out: str) -> None:
    """This process's part (every rank runs it): a run stopped at `--stop-at`, then one
    resumed from its checkpoint; writes what it read to `out`/rank<r>.json."""
    first, model1 = trainer(address, out, args.steps, args.stop_at, args.batch_size)
    first.add_callback(StopAt(args.stop_at))
    try:
        first.train()
        raise SystemExit("FAILED: the first run did not stop")
    except Stop as e:
        if first.args.process_index == 0:
            print(f"run 1: {e}, {Path(out, f'checkpoint-{args.stop_at}').name} saved")
    first.train_loader.close()
    if torch.distributed.is_initialized():  # a real crash stops every rank; this one, each
        torch.distributed.barrier()          # at its own time: wait for the checkpoint
    second, model2 = trainer(address, out, args.steps, args.stop_at, args.batch_size)
    second.train(resume_from_checkpoint=True)
    rank = second.args.process_index
    if rank == 0:
        print(f"run 2: resumed with resume_from_checkpoint, trained to step {args.steps}")
    second.train_loader.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps(
        {"got": model1.seen + model2.seen, "losses": model1.losses + model2.losses,
         "resumed_batches": len(model2.seen)}))


def check(address: str, args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    """Train twice (in this process, or in `--devices` processes under torchrun) and compare
    every rank's batches with an unstopped loader's at that rank."""
    if args.devices == 1:
        train_twice(address, args, tmp)
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.devices}",
               f"--master-port={port}", __file__, "--worker", tmp, "--address", address,
               "--steps", str(args.steps), "--stop-at", str(args.stop_at), "--batch-size",
               str(args.batch_size)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        print(done.stdout, end="")
        if done.returncode != 0:
            raise SystemExit(f"FAILED: torchrun exited {done.returncode}:\n{done.stderr}")
    result: dict[str, Any] = {"ranks": {}}
    for rank in range(args.devices):
        read = json.loads(Path(tmp, f"rank{rank}.json").read_text())
        got = read["got"]
        want = unstopped(address, args.steps, args.batch_size, rank, args.devices)
        differ = sum(a != b for a, b in zip(got, want, strict=False)) + abs(len(got) - len(want))
        print(f"rank {rank}: {len(got)} batches, {differ} differ from the unstopped run")
        if differ:
            raise SystemExit(f"FAILED: rank {rank} read other batches than an unstopped run")
        result["ranks"][rank] = {"got": got, "want": want,
                                 "resumed_batches": read["resumed_batches"]}
    losses = json.loads(Path(tmp, "rank0.json").read_text())["losses"]
    first5, last5 = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    print(f"loss: first 5 steps {first5:.3f}, last 5 {last5:.3f}")
    if not last5 < first5:
        raise SystemExit("FAILED: the loss did not fall")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=1,
                   help="processes (DDP on CPU, gloo, started by torchrun; 1: this one)")
    p.add_argument("--steps", type=int, default=40, help="training steps in all")
    p.add_argument("--stop-at", type=int, default=12, help="the step the first run crashes at")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--address", help="a server that serves 'line' (else one is started)")
    p.add_argument("--json", help="write every rank's batches (read and expected) here")
    p.add_argument("--worker", metavar="DIR", help=argparse.SUPPRESS)  # a torchrun rank
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if args.worker:
        train_twice(args.address, args, args.worker)
        return 0
    with tempfile.TemporaryDirectory(prefix="stoker-hf-") as tmp:
        if args.address:
            result = check(args.address, args, tmp)
        else:
            with serve() as address:
                result = check(address, args, tmp)
    if args.json:
        Path(args.json).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
