"""Scale: images/s against the number of worker processes and of servers.

    python benchmarks/scale.py [--quick] [--json out.json]

The image pipeline (JPEG ~375x500 -> random resized crop 224 -> flip -> uint8 CHW; the client
does not normalise, so the figure is the servers' rate) read by one RemoteLoader from:
- one server with W = 1..cores worker processes;
- S = 1..cores servers of one worker each (the client spreads credits over them).

From the per-core rate r (images/s per worker process) the sizing model in docs/benchmarks.md
follows: a trainer consuming R images/s needs ceil(R / (r x cores per node x u)) CPU nodes,
u the utilisation one can run at (0.8, say).
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
from _data import make_image_folder
from _measure import machine_info, run_scenario, scenario_parser, settle, summarise

from stoker.client import RemoteLoader
from stoker.server import ServerProcess, write_config

GEOMETRY = [{"random_resized_crop": {"size": 224}}, {"horizontal_flip": {"p": 0.5}}]


def epoch_rate(addresses: list[str], batch_size: int, epoch: int) -> float:
    with RemoteLoader(addresses, "imgs", batch_size=batch_size, seed=0, prefetch=16,
                      timeout=120) as loader:
        loader.set_epoch(epoch)
        it = iter(loader)
        next(it)  # warm-up: streams open
        t0, n = time.perf_counter(), 0
        for batch in it:
            n += batch["image"].shape[0]
        return n / (time.perf_counter() - t0)


def measure(config: Path, servers: int, workers: int, args: argparse.Namespace) -> list[float]:
    procs = [ServerProcess(config, workers=workers, port=0, http_port=0).start()
             for _ in range(servers)]
    try:
        return [epoch_rate([p.address for p in procs], args.batch_size, r)
                for r in range(args.repeats)]
    finally:
        for p in procs:
            p.stop()


def run(args: argparse.Namespace) -> dict[str, Any]:
    cores = len(os.sched_getaffinity(0))
    res: dict[str, Any] = {"benchmark": "scale", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "machine": machine_info(numpy=np.__version__),
                           "parameters": dict(vars(args)), "workers": [], "servers": []}
    with tempfile.TemporaryDirectory(prefix="stoker-scale-") as tmp:
        root = Path(tmp) / "images"
        make_image_folder(root, args.images, 4, 437, shape=(375, 500))
        config = write_config(Path(tmp) / "c.yaml", {"datasets": {"imgs": {
            "format": "image-folder", "source": str(root), "transforms": GEOMETRY}}})
        for w in range(1, cores + 1):
            rates = measure(config, 1, w, args)
            res["workers"].append({"workers": w, "images_per_s": summarise(rates)})
            if not args.json_only:
                print(f"  1 server, {w} workers: {summarise(rates)['median']:.0f} images/s")
        for s in range(1, cores + 1):
            rates = measure(config, s, 1, args)
            res["servers"].append({"servers": s, "images_per_s": summarise(rates)})
            if not args.json_only:
                print(f"  {s} servers x 1 worker: {summarise(rates)['median']:.0f} images/s")
    one = res["workers"][0]["images_per_s"]["median"]
    res["per_worker_images_per_s"] = one
    for row in res["workers"]:
        row["efficiency"] = row["images_per_s"]["median"] / (one * row["workers"])
    for row in res["servers"]:
        row["efficiency"] = row["images_per_s"]["median"] / (one * row["servers"])
    res["check_problems"], res["server_exit_code"] = [], 0
    return res


def main(argv: list[str] | None = None) -> int:
    ap = scenario_parser(__doc__)
    ap.add_argument("--images", type=int)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--repeats", type=int)
    args = ap.parse_args(argv)
    settle(args, quick={"images": 128, "repeats": 1}, full={"images": 1024, "repeats": 3})
    return run_scenario(args, run)


if __name__ == "__main__":
    sys.exit(main())
