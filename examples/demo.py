"""The main job: a data server decodes JPEGs, a trainer learns from the batches it streams.

    python examples/demo.py [--epochs 5] [--steps N] [--batch-size 64] [--workers 2] [--data DIR]

Writes the shapes dataset and a server config under DIR (default: data/ in the repo), starts
`stoker serve` as a child process, trains a small CNN from a RemoteLoader, and reports loss,
throughput and how long the trainer waited for data. On a machine with CUDA it trains there:
the loader copies each batch into pinned memory and onto the GPU without blocking
(`device="cuda"`) and scales the uint8 images there (`normalize=`); on the CPU the trainer
scales them itself. It says which device it used. Exits non-zero if the loss did not fall
(last-epoch mean >= 0.7 x first-epoch mean) or the server did not shut down cleanly.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from shapes import CLASSES, make_shapes
from torch import nn

from stoker.client import RemoteLoader
from stoker.server import ServerProcess, write_config

REPO = Path(__file__).resolve().parents[1]
# The images' scaling to [-1, 1]: (x / 255 - 0.5) / 0.5, i.e. x / 127.5 - 1.
SCALE = {"image": ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))}
IMAGE_SIZE = 32  # the server resizes the 64 px files: decode and resize cost lands on its side
LOSS_RATIO = 0.7  # the last epoch's mean loss must be below this share of the first's


def small_cnn(num_classes: int) -> nn.Module:
    """Four conv blocks (32 -> 16 -> 8 -> 4 -> 2 px) and a linear head: ~60k parameters.

    The head sees the 2x2 grid, not a global average: where the mass lies (a triangle's wide
    base, a cross's empty corners) is what tells the shapes apart."""
    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(),
                nn.MaxPool2d(2)]

    return nn.Sequential(*block(3, 16), *block(16, 32), *block(32, 64), *block(64, 64),
                         nn.Flatten(), nn.Linear(64 * 2 * 2, num_classes))


def train(address: str, args: argparse.Namespace) -> tuple[list[float], dict[str, float]]:
    """Train on the server's `shapes` dataset; returns the mean loss of each epoch run and the
    loader's stats plus `seconds` (wall time of the loop) and `images`."""
    torch.manual_seed(args.seed)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    print(f"training on {device}" + (f" ({torch.cuda.get_device_name(0)})" if cuda else ""))
    model = small_cnn(len(CLASSES)).to(device)
    # On CUDA the loader lands batches on the GPU and normalises the images there.
    on_gpu = {"device": device, "normalize": SCALE} if cuda else {}
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()
    epoch_losses: list[float] = []
    step, images = 0, 0
    with RemoteLoader(address, "shapes", batch_size=args.batch_size, seed=args.seed,
                      shuffle=True, drop_last=True, **on_gpu) as loader:
        print(f"{len(loader)} batches of {args.batch_size} per epoch")
        t0 = time.perf_counter()
        for epoch in range(args.epochs):
            loader.set_epoch(epoch)  # a new shuffle order, computed by the server
            losses: list[float] = []
            for batch in loader:
                # The wire carries uint8 (4x fewer bytes than float32): scaled on the GPU by
                # the loader, else here.
                x = (batch["image"] if cuda else batch["image"].float().div_(127.5).sub_(1.0))
                loss = loss_fn(model(x), batch["label"])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(loss.item())
                step += 1
                images += x.shape[0]
                if step % args.log_every == 0:
                    print(f"epoch {epoch} step {step:4d}  loss {loss.item():.4f}")
                if step == args.steps:
                    break
            epoch_losses.append(sum(losses) / len(losses))
            print(f"epoch {epoch} done: mean loss {epoch_losses[-1]:.4f}")
            if step == args.steps:
                break
        stats = {**loader.stats(), "seconds": time.perf_counter() - t0, "images": images}
    return epoch_losses, stats


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=5, help="epochs to train (at least 2)")
    p.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: none)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=2, help="data server worker processes")
    p.add_argument("--data", type=Path, default=REPO / "data", help="dataset and config folder")
    p.add_argument("--address", help="train against running servers at HOST:PORT (they serve "
                   "`shapes`) instead of preparing data and starting one here")
    p.add_argument("--per-class", type=int, default=500, help="images per class")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10, help="print the loss every N steps")
    args = p.parse_args(argv)
    if args.epochs < 2:
        p.error("--epochs must be >= 2: the check compares the first and the last epoch")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.address:
        print(f"training against {args.address}")
        epoch_losses, stats = train(args.address, args)
        return report(epoch_losses, stats, server=None)
    data = args.data.resolve()
    t = time.perf_counter()
    source = make_shapes(data / "shapes", per_class=args.per_class, seed=args.seed)
    print(f"dataset: {source} ({len(CLASSES)} classes x {args.per_class}, "
          f"{time.perf_counter() - t:.1f}s)")
    config = write_config(data / "stoker.yaml", {"datasets": {"shapes": {
        "format": "image-folder", "source": str(source), "size": IMAGE_SIZE, "layout": "chw"}}})

    # Trainer and server share this machine: give the trainer the cores the server's workers
    # leave free (at least one). Oversubscribing makes decode and backward steal each other's
    # time slices, and on 2 cores one trainer thread for a 60k-parameter CNN is not the limit.
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(max(1, cores - args.workers))
    print(f"{cores} cores: server {args.workers} workers, trainer {torch.get_num_threads()} "
          "threads")

    with ServerProcess(config, workers=args.workers, log_level="WARNING") as server:
        print(f"data server ready at {server.address}")
        epoch_losses, stats = train(server.address, args)
        exit_code = server.stop()  # SIGTERM: drain and stop; __exit__ then has nothing to do
    print(f"server exit code: {exit_code}")
    return report(epoch_losses, stats, server=(exit_code, server.stderr))


def report(epoch_losses: list[float], stats: dict[str, float],
           server: tuple[int, str] | None) -> int:
    """Print the outcome; 0 if the loss fell and the server we started (exit code, stderr),
    if any, stopped cleanly."""
    seconds, wait = stats["seconds"], stats["wait_seconds"]
    first, last = epoch_losses[0], epoch_losses[-1]
    print(f"loss: first epoch {first:.4f} -> last epoch {last:.4f} ({last / first:.2f}x)")
    print(f"throughput: {stats['images'] / seconds:.0f} images/s ({stats['batches']} batches, "
          f"{stats['bytes'] / 2**20:.1f} MiB in {seconds:.1f}s)")
    print(f"waited for data: {wait:.2f}s ({100 * wait / seconds:.1f}% of training time)")
    failures = []
    if server is not None and server[0] != 0:
        failures.append(f"server exited with {server[0]}\n{server[1]}")
    if len(epoch_losses) < 2:
        failures.append("fewer than 2 epochs ran (raise --steps): cannot check the loss fell")
    elif not last < LOSS_RATIO * first:
        failures.append(f"last-epoch loss is not below {LOSS_RATIO} x the first epoch's")
    for failure in failures:
        print(f"FAIL: {failure}", file=sys.stderr)
    if not failures:
        print("OK: the loss fell" + (" and the server shut down cleanly" if server else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
