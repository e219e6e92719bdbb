"""Big batches against small ones from the same server: the image pipeline at batch 256 and
at batch 32, 2 workers (issue 31).

    python benchmarks/pipeline_batch.py             # 2048 JPEGs ~375x500, 3 repeats
    python benchmarks/pipeline_batch.py --quick     # smoke test
    python benchmarks/pipeline_batch.py --json out.json

Pipeline: JPEG ~375x500 -> random resized crop 224 -> horizontal flip -> uint8 CHW (the
held-out pipeline, normalised on the trainer's device, so not here). One server of
`--workers` workers; one RemoteLoader per batch size with its default settings, both open
for the whole run, reading alternate epochs (a new epoch each read, so nothing comes from the
server's shared-batch cache). images/s over a whole epoch from iter(), after one untimed
warm-up epoch (the fill included: W workers that start together finish k x W batches in k
batch times, so a loader that keeps them busy measures their rate). While one worker builds
a whole batch, a batch of 256 is 8x the work a batch of 32 is, and an epoch of few big
batches starts later and ends more ragged: goal, big / small >= 0.9.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _data import TRANSFORMS, make_image_folder
from _measure import machine_info, run_scenario, scenario_parser, settle, summarise

from stoker.client import RemoteLoader
from stoker.server import ServerProcess, write_config

FULL = {"images": 2048, "big": 256, "small": 32, "repeats": 3}
QUICK = {"images": 256, "big": 64, "small": 16, "repeats": 1}
GOAL = 0.9


def read_epoch(loader: RemoteLoader, epoch: int, batch_size: int,
               problems: list[str]) -> dict[str, float]:
    loader.set_epoch(epoch)
    batches = len(loader)
    t0 = time.perf_counter()
    it = iter(loader)
    first = next(it)
    t1 = time.perf_counter()
    got = 1
    for batch in it:
        got += 1
        last = batch
    t2 = time.perf_counter()
    for b in (first, last):
        if tuple(b["image"].shape) != (batch_size, 3, 224, 224) and not problems:
            problems.append(f"batch {batch_size}: image {list(b['image'].shape)}")
    if got != batches:
        problems.append(f"batch {batch_size} epoch {epoch}: {got} batches, wanted {batches}")
    return {"epoch": epoch, "images_per_s": batches * batch_size / (t2 - t0),
            "after_first_images_per_s": (batches - 1) * batch_size / (t2 - t1),
            "first_batch_s": t1 - t0}


def run(args: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {"benchmark": "pipeline_batch",
                           "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "machine": machine_info(numpy=np.__version__),
                           "parameters": dict(vars(args)), "goal": GOAL,
                           "transforms": TRANSFORMS[:-1]}
    problems: list[str] = []
    sizes = {"big": args.big, "small": args.small}
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in sizes}
    with tempfile.TemporaryDirectory(prefix="stoker-pipebatch-") as tmp:
        data = Path(args.data_dir) if args.data_dir else Path(tmp) / "images"
        if not any(data.glob("class_*/*.jpg")):
            make_image_folder(data, args.images, 10, 437, shape=(375, 500))
        res["data"] = {"images": len(list(data.glob("class_*/*.jpg")))}
        config = write_config(Path(tmp) / "c.yaml", {"datasets": {"imgs": {
            "format": "image-folder", "source": str(data), "transforms": TRANSFORMS[:-1]}}})
        t0 = time.perf_counter()
        server = ServerProcess(config, workers=args.workers).start(timeout=300)
        res["server_start_s"] = time.perf_counter() - t0
        # The two loaders' epochs are interleaved: neither builds ahead into the other's.
        loaders = {k: RemoteLoader(server.address, "imgs", batch_size=bs, seed=0,
                                   prefetch_next_epoch=False)
                   for k, bs in sizes.items()}
        try:
            # Untimed: the JPEGs into the page cache, the workers' first decodes.
            res["warm_up"] = read_epoch(loaders["small"], 1000, args.small, problems)
            for r in range(args.repeats):
                order = list(sizes) if r % 2 == 0 else list(sizes)[::-1]
                for i, k in enumerate(order):
                    m = read_epoch(loaders[k], 2 * r + i, sizes[k], problems)
                    runs[k].append(m)
                    if not args.json_only:
                        print(f"  repeat {r} batch {sizes[k]:>4}  {m['images_per_s']:7.1f} "
                              f"images/s  first batch {m['first_batch_s']:.2f} s", flush=True)
        finally:
            for ld in loaders.values():
                ld.close()
            code = server.stop()
    res["systems"] = {k: {"batch_size": sizes[k], "repeats": runs[k],
                          "images_per_s": summarise([m["images_per_s"] for m in runs[k]]),
                          "after_first_images_per_s": summarise(
                              [m["after_first_images_per_s"] for m in runs[k]]),
                          "first_batch_s": summarise([m["first_batch_s"] for m in runs[k]])}
                      for k in sizes}
    med = {k: res["systems"][k]["images_per_s"]["median"] for k in sizes}
    res["ratio_big_over_small"] = med["big"] / med["small"]
    res["check_problems"], res["server_exit_code"] = problems, code
    return res


def main(argv: list[str] | None = None) -> int:
    ap = scenario_parser(__doc__)
    ap.add_argument("--images", type=int)
    ap.add_argument("--big", type=int, help="the big batch size (256)")
    ap.add_argument("--small", type=int, help="the small batch size (32)")
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--data-dir", help="use (or fill) this folder of JPEGs")
    args = ap.parse_args(argv)
    settle(args, QUICK, FULL)
    if args.images // args.big < 2:
        ap.error("need at least 2 big batches an epoch")
    return run_scenario(args, run)


if __name__ == "__main__":
    sys.exit(main())
