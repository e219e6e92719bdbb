"""Lightning training from a stoker server, crashed mid-epoch and resumed exactly.

    python examples/lightning_train.py [--devices 2] [--steps 40] [--stop-at 12]

A tiny regression model trains with `trainer.fit` on `StokerDataModule` (one process, or
`--devices N` DDP ranks on CPU, gloo). The first run raises an exception at step `--stop-at`,
after Lightning's ModelCheckpoint saved `last.ckpt` there; a second run, a new process as after
a real crash, calls `trainer.fit(..., ckpt_path=last.ckpt)` and trains to `--steps`. Every rank
writes the `sample_index` of each batch it trained on; the example then checks that, for every
rank, the two runs together read exactly what one RemoteLoader at that rank reads in a run that
never stopped, and that the loss fell. Exits non-zero otherwise.

`--address HOST:PORT` uses a running server that serves dataset "line" (framework_data.py);
without it the example starts one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import torch
from framework_data import FEATURES, serve

from stoker.client import RemoteLoader
from stoker.integrations.lightning import StokerDataModule


class Stop(Exception):
    """The crash the first run simulates."""


class Regression(L.LightningModule):
    def __init__(self, record: Path, stop_at: int | None) -> None:
        super().__init__()
        self.net = torch.nn.Linear(FEATURES, 1)
        self.record, self.stop_at = record, stop_at

    def on_train_start(self) -> None:
        # Lightning trains on the data module's own loader: not wrapped, re-sharded or remade
        if self.trainer.train_dataloader is not self.trainer.datamodule.loader:
            raise RuntimeError(f"Lightning replaced the RemoteLoader with "
                               f"{type(self.trainer.train_dataloader).__name__}")

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.stop_at is not None and self.global_step == self.stop_at:
            raise Stop(f"stopped at step {self.global_step}")
        loss = torch.nn.functional.mse_loss(self.net(batch["x"]), batch["y"])
        with open(f"{self.record}.rank{self.global_rank}.jsonl", "a") as out:
            out.write(json.dumps({"step": self.global_step, "loss": loss.item(),
                                  "samples": batch["sample_index"].tolist()}) + "\n")
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def fit(args: argparse.Namespace) -> int:
    """One run (every DDP rank runs this: Lightning starts the others with the same argv)."""
    torch.manual_seed(0)
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=args.ckpt_dir, save_last=True,
                                               every_n_train_steps=args.stop_at)
    trainer = L.Trainer(accelerator="cpu", devices=args.devices,
                        strategy="ddp" if args.devices > 1 else "auto", max_steps=args.steps,
                        callbacks=[ckpt], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    data = StokerDataModule(args.address, "line", batch_size=args.batch_size, seed=args.seed,
                            timeout=60)
    model = Regression(Path(args.record), args.stop_at if args.phase == "stop" else None)
    resume = str(Path(args.ckpt_dir) / "last.ckpt") if args.phase == "resume" else None
    try:
        trainer.fit(model, datamodule=data, ckpt_path=resume)
    except Stop as e:
        print(e)
    return 0


def unstopped(address: str, args: argparse.Namespace, rank: int) -> list[list[int]]:
    """What rank `rank` reads in a run that never stopped: `--steps` batches, epoch after
    epoch."""
    seen: list[list[int]] = []
    with RemoteLoader(address, "line", batch_size=args.batch_size, seed=args.seed, rank=rank,
                      world_size=args.devices, timeout=60) as loader:
        while len(seen) < args.steps:
            for batch in loader:
                seen.append(batch["sample_index"].tolist())
                if len(seen) == args.steps:
                    break
    return seen


def phase(args: argparse.Namespace, name: str, tmp: str) -> None:
    cmd = [sys.executable, __file__, "--phase", name, "--address", args.address,
           "--ckpt-dir", str(Path(tmp) / "ckpt"), "--record", str(Path(tmp) / "seen"),
           "--devices", str(args.devices), "--steps", str(args.steps),
           "--stop-at", str(args.stop_at), "--batch-size", str(args.batch_size),
           "--seed", str(args.seed)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise SystemExit(f"FAILED: the {name} run exited {out.returncode}:\n{out.stderr}")


def check(args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    """Run both phases and compare every rank's reading with an unstopped loader's."""
    phase(args, "stop", tmp)
    print(f"run 1: crashed at step {args.stop_at}, {Path(tmp, 'ckpt', 'last.ckpt').name} saved")
    phase(args, "resume", tmp)
    print(f"run 2: resumed with ckpt_path, trained to step {args.steps}")
    result: dict[str, Any] = {"ranks": {}}
    for rank in range(args.devices):
        rows = [json.loads(line) for line in
                Path(tmp, f"seen.rank{rank}.jsonl").read_text().splitlines()]
        got, want = [r["samples"] for r in rows], unstopped(args.address, args, rank)
        differ = sum(a != b for a, b in zip(got, want, strict=False)) + abs(len(got) - len(want))
        result["ranks"][rank] = {"got": got, "want": want}
        print(f"rank {rank}: {len(got)} batches, {differ} differ from the unstopped run")
        if differ:
            raise SystemExit(f"FAILED: rank {rank} read other batches than an unstopped run")
        if rank == 0:
            losses = [r["loss"] for r in rows]
            first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
            print(f"loss: first 5 steps {first:.3f}, last 5 {last:.3f}")
            if not last < first:
                raise SystemExit("FAILED: the loss did not fall")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=1, help="DDP ranks on CPU (1: no DDP)")
    p.add_argument("--steps", type=int, default=40, help="training steps in all")
    p.add_argument("--stop-at", type=int, default=12, help="the step the first run crashes at")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--address", help="a server that serves 'line' (else one is started)")
    p.add_argument("--json", help="write every rank's batches (read and expected) here")
    p.add_argument("--phase", choices=("stop", "resume"), help=argparse.SUPPRESS)
    p.add_argument("--ckpt-dir", help=argparse.SUPPRESS)
    p.add_argument("--record", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.phase:
        return fit(args)
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="stoker-lightning-") as tmp:
        if args.address:
            result = check(args, tmp)
        else:
            with serve() as address:
                args.address = address
                result = check(args, tmp)
    if args.json:
        Path(args.json).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
