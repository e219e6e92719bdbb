"""The Hugging Face Trainer on a stoker server: crashed mid-epoch, resumed at the next batch.

    python examples/hf_trainer.py [--steps 40] [--stop-at 12]

A tiny regression model trains with `StokerTrainer` (stoker.integrations.hf), whose train
loader is a RemoteLoader. The first `train()` raises an exception at step `--stop-at`, just
after the Trainer saved checkpoint-<stop-at> (with the loader's position in it); a new model,
loader and trainer then call `train(resume_from_checkpoint=True)` and train to `--steps`. The
example checks that the two runs together read exactly the batches one RemoteLoader reads in
a run that never stopped, that the resumed run asked the server for none of the skipped
batches, and that the loss fell. Exits non-zero otherwise.

`--address HOST:PORT` uses a running server that serves dataset "line" (framework_data.py);
without it the example starts one.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
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
            dataset: str = "line", **options: Any) -> tuple[StokerTrainer, Regression]:
    """A new StokerTrainer (and its model) reading `dataset` from `address` (RemoteLoader's
    `options`)."""
    torch.manual_seed(0)
    args = TrainingArguments(out, max_steps=steps, save_steps=save_steps, learning_rate=0.05,
                             lr_scheduler_type="constant", optim="sgd", logging_strategy="no",
                             report_to="none", disable_tqdm=True, use_cpu=True, seed=0,
                             per_device_train_batch_size=batch_size)
    loader = RemoteLoader(address, dataset, batch_size=batch_size, rank=args.process_index,
                          world_size=args.world_size, timeout=60, **options)
    model = Regression()
    return StokerTrainer(model=model, args=args, train_loader=loader), model


def unstopped(address: str, steps: int, batch_size: int) -> list[list[int]]:
    """What a run that never stopped reads: `steps` batches, epoch after epoch."""
    seen: list[list[int]] = []
    with RemoteLoader(address, "line", batch_size=batch_size, timeout=60) as loader:
        while len(seen) < steps:
            for batch in loader:
                seen.append(batch["sample_index"].tolist())
                if len(seen) == steps:
                    break
    return seen


def check(address: str, args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    first, model1 = trainer(address, tmp, args.steps, args.stop_at, args.batch_size)
    first.add_callback(StopAt(args.stop_at))
    try:
        first.train()
        raise SystemExit("FAILED: the first run did not stop")
    except Stop as e:
        print(f"run 1: {e}, {Path(tmp, f'checkpoint-{args.stop_at}').name} saved")
    first.train_loader.close()
    second, model2 = trainer(address, tmp, args.steps, args.stop_at, args.batch_size)
    asked = second.train_loader.stats()["batches"]
    second.train(resume_from_checkpoint=True)
    print(f"run 2: resumed with resume_from_checkpoint, trained to step {args.steps}; the "
          f"loader handed out {second.train_loader.stats()['batches'] - asked} batches")
    got, want = model1.seen + model2.seen, unstopped(address, args.steps, args.batch_size)
    differ = sum(a != b for a, b in zip(got, want, strict=False)) + abs(len(got) - len(want))
    print(f"{len(got)} batches, {differ} differ from the unstopped run")
    if differ:
        raise SystemExit("FAILED: the two runs read other batches than an unstopped run")
    losses = model1.losses + model2.losses
    first5, last5 = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    print(f"loss: first 5 steps {first5:.3f}, last 5 {last5:.3f}")
    if not last5 < first5:
        raise SystemExit("FAILED: the loss did not fall")
    second.train_loader.close()
    return {"got": got, "want": want, "resumed_batches": len(model2.seen)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40, help="training steps in all")
    p.add_argument("--stop-at", type=int, default=12, help="the step the first run crashes at")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--address", help="a server that serves 'line' (else one is started)")
    p.add_argument("--json", help="write the batches read and expected here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    logging.getLogger("transformers").setLevel(logging.ERROR)
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
