"""Ray Train workers reading from a stoker fleet that runs on the same Ray cluster.

    python examples/ray_train.py [--servers 2] [--trainers 2] [--epochs 2] [--samples 512]

Needs the ray extra (`pip install ".[ray,client,server]"` from a checkout). It starts a local
Ray cluster (or joins the one `ray.init` already connected to), a fleet of `--servers` stoker
servers as Ray actors (each asking for its workers + 1 CPUs), and a `TorchTrainer` of
`--trainers` CPU workers. Each worker takes its rank and world size from Ray Train's context
and reads its share of every epoch from the fleet (`fleet.target` with the `resolve` resolver:
the servers' addresses come from the fleet, no DNS involved); DDP (gloo) averages a linear
model's gradients. The data: a linear regression problem written as .npy files (`format:
memmap`).

It checks what it claims: across the workers every sample of every epoch is read exactly
once, and the loss falls. It prints the servers' exit codes after the drain and exits
non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
import torch.distributed as dist
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer, prepare_model

from stoker.client import RemoteLoader
from stoker.integrations.ray import Fleet, resolve

DIM = 8


def write_data(folder: Path, n: int, seed: int) -> None:
    """y = x . w + noise, as two .npy files that `format: memmap` serves row by row."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, DIM)).astype(np.float32)
    w = rng.standard_normal(DIM).astype(np.float32)
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / "x_0.npy", x)
    np.save(folder / "y_0.npy", (x @ w + 0.01 * rng.standard_normal(n)).astype(np.float32))


def train_loop(config: dict[str, Any]) -> None:
    """One Ray Train worker: its rank's batches of every epoch, from the fleet."""
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    torch.manual_seed(0)
    model = prepare_model(torch.nn.Linear(DIM, 1))  # DDP over gloo: the gradients averaged
    opt = torch.optim.SGD(model.parameters(), lr=config["lr"])
    seen: list[tuple[int, int]] = []  # (epoch, sample index)
    losses: list[float] = []
    with RemoteLoader(config["target"], "features", batch_size=config["batch_size"],
                      seed=config["seed"], rank=rank, world_size=world, resolver=resolve,
                      dns_refresh=1.0, timeout=120) as loader:
        for epoch in range(config["epochs"]):
            loader.set_epoch(epoch)
            for batch in loader:
                loss = torch.nn.functional.mse_loss(model(batch["x"]).squeeze(1), batch["y"])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(loss.item())
                seen += [(epoch, int(i)) for i in batch["sample_index"]]
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, seen)
    counts: dict[tuple[int, int], int] = {}
    for pairs in everyone:
        for pair in pairs:
            counts[pair] = counts.get(pair, 0) + 1
    expected = config["epochs"] * config["samples"]
    lost = expected - len(counts)
    duplicated = sum(c - 1 for c in counts.values())
    k = max(1, len(losses) // 10)
    metrics = {"world_size": world, "steps": len(losses), "lost": lost,
               "duplicated": duplicated, "samples": sum(counts.values()),
               "loss_first": float(np.mean(losses[:k])), "loss_last": float(np.mean(losses[-k:]))}
    with tempfile.TemporaryDirectory() as tmp:  # the model, with the metrics, from rank 0
        checkpoint = None
        if rank == 0:
            torch.save(model.state_dict(), Path(tmp) / "model.pt")
            checkpoint = ray.train.Checkpoint.from_directory(tmp)
        ray.train.report(metrics, checkpoint=checkpoint)


def run(args: argparse.Namespace, folder: Path) -> int:
    write_data(folder / "data", args.samples, args.seed)
    config = {"server": {"grace_seconds": 5}, "datasets": {"features": {
        "format": "memmap", "source": str(folder / "data"),
        "fields": {"x": "x_*.npy", "y": "y_*.npy"}}}}
    with Fleet(config, servers=args.servers, workers=args.server_workers,
               name=args.fleet) as fleet:
        print(f"fleet {fleet.name}: {len(fleet.addresses)} servers at {fleet.addresses}")
        trainer = TorchTrainer(
            train_loop,
            train_loop_config={"target": fleet.target, "batch_size": args.batch_size,
                               "seed": args.seed, "epochs": args.epochs, "lr": 0.1,
                               "samples": args.samples},
            scaling_config=ScalingConfig(num_workers=args.trainers, use_gpu=False),
            run_config=RunConfig(name="stoker-ray-train", storage_path=str(folder / "runs")))
        m = trainer.fit().metrics
    print(f"{m['world_size']} Ray Train workers, {m['steps']} steps each, {m['samples']} "
          f"samples read: {m['lost']} lost, {m['duplicated']} duplicated")
    print(f"loss: first steps {m['loss_first']:.4f}, last steps {m['loss_last']:.4f}")
    print(f"fleet drained, server exit codes {fleet.drained}")
    ok = (m["lost"] == m["duplicated"] == 0 and m["loss_last"] < m["loss_first"]
          and all(c == 0 for c in fleet.drained))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--server-workers", type=int, default=1, help="worker processes a server")
    p.add_argument("--trainers", type=int, default=2, help="Ray Train workers (CPU)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fleet", default="stoker-example", help="the fleet's name in Ray")
    args = p.parse_args(argv)
    if not ray.is_initialized():  # CPUs for the servers (workers + 1 each) and the trainers
        ray.init(num_cpus=args.servers * (args.server_workers + 1) + args.trainers + 1,
                 include_dashboard=False)
    with tempfile.TemporaryDirectory() as tmp:
        return run(args, Path(tmp))


if __name__ == "__main__":
    sys.exit(main())
