"""The prefix cache: the held-out image pipeline's first epoch (cold: every JPEG decoded)
against its second (warm: the decoded pixels read from cache.decoded_bytes), same server,
same cores.

    python benchmarks/prefix_cache.py              # 1024 JPEGs ~375x500, 3 repeats
    python benchmarks/prefix_cache.py --quick      # 192 JPEGs, 1 repeat (about a minute)
    python benchmarks/prefix_cache.py --json out.json

Pipeline (benchmarks/pipeline.py's): JPEG ~375x500 -> random resized crop 224 -> flip ->
normalize, float32 CHW, batches of 32, read with a default RemoteLoader (on one host: the
data connection). The prefix is the decode (the first step is random): the cache holds each
image's full RGB pixels.
Each repeat starts a fresh server (an empty cache), reads epoch 0, then epoch 1; the figure
is samples/s of each and their ratio (issue 17's target: >= 2.5x). An epoch of a server
without the cache is measured too, so that the cut of the pipeline is seen to cost epoch 0
nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
from _data import TRANSFORMS, make_image_folder
from _measure import machine_info, run_scenario, scenario_parser, settle, summarise

from stoker.client import RemoteLoader
from stoker.server import ServerProcess, write_config

FULL = {"images": 1024, "repeats": 3}
QUICK = {"images": 192, "repeats": 1}
TARGET = 2.5


def epoch_rate(server: ServerProcess, args: argparse.Namespace, epoch: int) -> float:
    """Samples/s of one epoch, read to the end."""
    t0 = time.perf_counter()
    n = 0
    with RemoteLoader(server.address, "imgs", batch_size=args.batch_size, seed=1,
                      drop_last=False, output="numpy", timeout=300) as loader:
        loader.set_epoch(epoch)
        for batch in loader:
            n += len(batch["label"])
    return n / (time.perf_counter() - t0)


def cache_metrics(server: ServerProcess) -> dict[str, float]:
    with urllib.request.urlopen(server.http_url + "/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return {name: float(v) for name, v in (line.rsplit(" ", 1) for line in lines
                                           if line.startswith("stoker_prefix_cache_"))}


def run(args: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {"benchmark": "prefix_cache",
                           "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "machine": machine_info(numpy=np.__version__),
                           "parameters": dict(vars(args)), "repeats": []}
    with tempfile.TemporaryDirectory(prefix="stoker-prefix-") as tmp:
        root = Path(tmp) / "images"
        make_image_folder(root, args.images, 10, 437, shape=(375, 500))
        dataset = {"imgs": {"format": "image-folder", "source": str(root),
                            "transforms": TRANSFORMS}}
        cached = write_config(Path(tmp) / "cached.yaml", {
            "cache": {"dir": str(Path(tmp) / "cache"), "decoded_bytes": args.decoded_bytes},
            "datasets": dataset})
        plain = write_config(Path(tmp) / "plain.yaml", {"datasets": dataset})
        codes = []
        for r in range(args.repeats):
            row: dict[str, Any] = {}
            server = ServerProcess(plain, workers=args.workers).start()
            try:
                row["no_cache"] = epoch_rate(server, args, 0)
            finally:
                codes.append(server.stop())
            server = ServerProcess(cached, workers=args.workers).start()
            try:
                row["cold"] = epoch_rate(server, args, 0)
                row["warm"] = epoch_rate(server, args, 1)
                row["metrics"] = cache_metrics(server)
            finally:
                codes.append(server.stop())
            row["ratio"] = row["warm"] / row["cold"]
            res["repeats"].append(row)
            if not args.json_only:
                print(f"  repeat {r}: no cache {row['no_cache']:.0f}/s, cold {row['cold']:.0f}/s,"
                      f" warm {row['warm']:.0f}/s, {row['ratio']:.2f}x", flush=True)
    res["server_exit_code"] = max(codes, key=abs)
    res["summary"] = {k: summarise([row[k] for row in res["repeats"]])
                      for k in ("no_cache", "cold", "warm", "ratio")}
    ratio = statistics.median(row["ratio"] for row in res["repeats"])
    res["meets_target"] = ratio >= TARGET
    last = res["repeats"][-1]["metrics"]
    # A warm epoch that missed means the cache did not hold the dataset: no figure at all.
    res["check_problems"] = [] if last.get('stoker_prefix_cache_hits_total{tier="memory"}', 0) \
        >= args.images else [f"the warm epoch did not hit the cache: {last}"]
    return res


def main(argv: list[str] | None = None) -> int:
    ap = scenario_parser(__doc__)
    ap.add_argument("--images", type=int)
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--decoded-bytes", default="4GiB", help="cache.decoded_bytes")
    args = ap.parse_args(argv)
    settle(args, QUICK, FULL)
    return run_scenario(args, run)


if __name__ == "__main__":
    sys.exit(main())
