"""Start-up: seconds from creating the loader to holding the first batch.

    python benchmarks/startup.py [--quick] [--json out.json]

- DataLoader(num_workers=W) with each multiprocessing start method: fork, spawn, forkserver
  (workers are started on the first iter(); spawn and forkserver re-import the dataset's
  module and torch in every worker);
- stoker: RemoteLoader against a server that is already running (how a trainer meets it:
  servers outlive trainers), so the figure is channel, DescribeDataset, stream and the first
  batch; the server's own start (spawn W workers, open datasets) is reported apart.

Dataset: the image pipeline's JPEG folder with a plain resize, so a first batch costs some
real decoding. Medians over repeats; each repeat is a fresh loader.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _data import make_image_folder
from _measure import machine_info, run_scenario, scenario_parser, settle, summarise
from torch.utils.data import DataLoader

from stoker.client import RemoteLoader
from stoker.server import ServerProcess, write_config
from stoker.server.formats.image_folder import ImageFolder
from stoker.server.formats.image_folder_config import ImageFolderDataset
from stoker.server.sources.local import LocalStorage

METHODS = ("fork", "spawn", "forkserver")


def first_batch_s(make: Any) -> float:
    t0 = time.perf_counter()
    loader = make()
    batch = next(iter(loader))
    elapsed = time.perf_counter() - t0
    assert batch["image"].shape[0] > 0
    close = getattr(loader, "close", None)
    if close:
        close()
    del loader
    return elapsed


def run(args: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {"benchmark": "startup", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "machine": machine_info(torch=torch.__version__, numpy=np.__version__),
                           "parameters": dict(vars(args)), "systems": {}}
    with tempfile.TemporaryDirectory(prefix="stoker-startup-") as tmp:
        root = Path(tmp) / "images"
        make_image_folder(root, args.images, 4, 437, shape=(375, 500))
        ds = ImageFolder(ImageFolderDataset(format="image-folder", source=str(root), size=224),
                         LocalStorage(root))
        config = write_config(Path(tmp) / "c.yaml", {"datasets": {"imgs": {
            "format": "image-folder", "source": str(root), "size": 224}}})
        t0 = time.perf_counter()
        server = ServerProcess(config, workers=args.workers).start()
        res["server_start_s"] = time.perf_counter() - t0
        try:
            makers = {f"dataloader_{m}": (lambda m=m: DataLoader(
                ds, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                multiprocessing_context=m)) for m in METHODS}
            makers["stoker"] = lambda: RemoteLoader(server.address, "imgs",
                                                    batch_size=args.batch_size, timeout=60)
            for r in range(args.repeats):
                for name, make in makers.items():
                    s = first_batch_s(make)
                    res["systems"].setdefault(name, []).append(s)
                    if not args.json_only:
                        print(f"  repeat {r}  {name:<20} {s:7.3f} s", flush=True)
        finally:
            res["server_exit_code"] = server.stop()
    res["summary"] = {name: summarise(v) for name, v in res["systems"].items()}
    res["check_problems"] = []
    return res


def main(argv: list[str] | None = None) -> int:
    ap = scenario_parser(__doc__)
    ap.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--images", type=int, default=128)
    ap.add_argument("--repeats", type=int)
    args = ap.parse_args(argv)
    settle(args, quick={"repeats": 1}, full={"repeats": 5})
    return run_scenario(args, run)


if __name__ == "__main__":
    sys.exit(main())
