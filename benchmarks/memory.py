"""Memory over a long run: resident memory of the server (front end + workers) and of the
client, sampled as batches flow.

    python benchmarks/memory.py                 # 20,000 batches
    python benchmarks/memory.py --quick         # 2,000
    python benchmarks/memory.py --json out.json

Reported per process group: RssAnon (heap and arrays: what grows when something leaks; shared
memory segments excluded) and Rss (all resident pages, the segments a process maps included),
at the first checkpoint after warm-up and at the end, with the peak and the growth between
them. The dataset is small and cheap (`_sim.Costly`, no CPU spin), so many batches pass: what
grows per batch or per sample would show.

    python benchmarks/memory.py --prefix-cache  # an image folder, the prefix cache filled

With --prefix-cache the dataset is an image folder (small JPEGs, random resized crop), read for
as many epochs as the batches take, with cache.decoded_bytes and cache.spill_bytes set below
the decoded dataset's size, so that the cache fills, evicts and spills all along. Also sampled:
the server's shared memory (its batch segments in /dev/shm, and the prefix cache's memory
tier) and the cache's disk tier; checked: each tier within its bound (plus one entry per
worker being written).
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
from _measure import machine_info, run_scenario, scenario_parser, settle

from stoker.client import RemoteLoader
from stoker.server import ServerProcess, write_config


def status(pid: int) -> dict[str, int]:
    """RssAnon and VmRSS of one process, bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "VmRSS"):
            out[key] = int(value.split()[0]) * 1024
    return out


def group(pid: int, children: bool) -> dict[str, int]:
    pids = [pid]
    if children:
        # Every thread's children: the pool starts its workers from threads other than the
        # main one (the main thread's children file alone missed every worker).
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                pids += [int(c) for c in (task / "children").read_text().split()]
            except OSError:  # a thread that ended while we look
                pass
    total = {"RssAnon": 0, "VmRSS": 0}
    for p in pids:
        try:
            for k, v in status(p).items():
                total[k] += v
        except OSError:  # a worker that exited (replaced) while we look
            pass
    return total


def folder_bytes(path: Path) -> int:
    """Bytes in the files under `path` (0 if it is gone), in whole pages as tmpfs and the
    page cache hold them; a file removed while we look counts 0."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += -(-os.stat(os.path.join(root, name)).st_size // 4096) * 4096
            except FileNotFoundError:
                pass
    return total


def shared(pid: int, spill: Path | None) -> dict[str, int]:
    """Server `pid`'s shared memory: batch segments, the prefix cache's tiers."""
    from stoker.server.sources.prefix_cache import PREFIX, memory_dir

    shm = Path("/dev/shm")
    segments = 0
    for f in shm.glob(f"stoker_{pid}_*"):
        try:
            segments += f.stat().st_size
        except FileNotFoundError:  # a segment dropped while we look
            pass
    return {"segments": segments, "prefix_memory": folder_bytes(memory_dir(pid)),
            "prefix_disk": folder_bytes(spill / f"{PREFIX}{pid}") if spill else 0}


def dataset_config(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    n = args.batches * args.batch_size
    if not args.prefix_cache:
        return {"datasets": {"sim": {"format": "python", "factory": "_sim:Costly",
                                     "options": {"n": n, "sample_ms": 0}}}}
    from _data import make_image_folder

    make_image_folder(tmp / "images", args.images, 8, 96)
    return {"cache": {"dir": str(tmp / "cache"), "decoded_bytes": args.decoded_bytes,
                      "spill_bytes": args.spill_bytes, "spill_dir": str(tmp / "spill")},
            "datasets": {"sim": {"format": "image-folder", "source": str(tmp / "images"),
                                 "transforms": [{"random_resized_crop": {"size": 64}},
                                                {"horizontal_flip": {}}]}}}


def run(args: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {"benchmark": "memory", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "machine": machine_info(numpy=np.__version__),
                           "parameters": dict(vars(args)), "samples": []}
    with tempfile.TemporaryDirectory(prefix="stoker-memory-") as tmp:
        config = write_config(Path(tmp) / "c.yaml", dataset_config(args, Path(tmp)))
        spill = Path(tmp) / "spill" if args.prefix_cache else None
        env = {"PYTHONPATH": os.pathsep.join([str(Path(__file__).parent),
                                             os.environ.get("PYTHONPATH", "")])}
        server = ServerProcess(config, workers=args.workers, env=env).start()
        try:
            every = max(args.batches // 40, 1)
            t0 = time.perf_counter()
            with RemoteLoader(server.address, "sim", batch_size=args.batch_size, shuffle=True,
                              output="numpy", prefetch=args.prefetch, timeout=120) as loader:
                k = 0
                while k < args.batches:  # one epoch, or (an image folder) as many as it takes
                    for _ in loader:
                        k += 1
                        if k % every == 0 or k == args.batches:
                            res["samples"].append({
                                "batch": k, "seconds": time.perf_counter() - t0,
                                "server": group(server.proc.pid, children=True),
                                "client": group(os.getpid(), children=False),
                                "shared": shared(server.proc.pid, spill)})
                        if k == args.batches:
                            break
        finally:
            res["server_exit_code"] = server.stop()
    warm = [s for s in res["samples"] if s["batch"] >= args.warmup] or res["samples"]
    first, last = warm[0], warm[-1]
    res["summary"] = {
        who: {key: {"first": first[who][key], "last": last[who][key],
                    "peak": max(s[who][key] for s in res["samples"]),
                    "growth": last[who][key] / first[who][key] - 1}
              for key in ("RssAnon", "VmRSS")}
        for who in ("server", "client")}
    res["summary"]["from_batch"], res["summary"]["to_batch"] = first["batch"], last["batch"]
    res["check_problems"] = []
    if args.prefix_cache:
        # A tier may be over its bound by the entries being written: one per worker.
        entry = 4096 + 4096 * -(-(3 * 120 * 120) // 4096)  # the largest image's pixels
        for key, bound in (("prefix_memory", args.decoded_bytes),
                           ("prefix_disk", args.spill_bytes)):
            peak = max(x["shared"][key] for x in res["samples"])
            res["summary"][key] = {"peak": peak, "bound": _bytes(bound)}
            if peak > _bytes(bound) + args.workers * entry:
                res["check_problems"].append(f"{key}: {peak} bytes, over its bound {bound}")
        res["summary"]["segments"] = {"peak": max(x["shared"]["segments"]
                                                  for x in res["samples"])}
    return res


def _bytes(size: str) -> int:
    from pydantic import ByteSize, TypeAdapter

    return int(TypeAdapter(ByteSize).validate_python(size))


def main(argv: list[str] | None = None) -> int:
    ap = scenario_parser(__doc__)
    ap.add_argument("--batches", type=int)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--warmup", type=int, help="batches before the first counted sample")
    ap.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--prefetch", type=int, default=16)
    ap.add_argument("--prefix-cache", action="store_true",
                    help="an image folder through the prefix cache (see above)")
    ap.add_argument("--images", type=int, default=2000, help="--prefix-cache: JPEGs ~96x96")
    ap.add_argument("--decoded-bytes", default="16MiB", help="--prefix-cache: its memory tier")
    ap.add_argument("--spill-bytes", default="16MiB", help="--prefix-cache: its disk tier")
    args = ap.parse_args(argv)
    settle(args, quick={"batches": 2_000}, full={"batches": 20_000})
    if args.warmup is None:
        args.warmup = args.batches // 20
    return run_scenario(args, run)


if __name__ == "__main__":
    sys.exit(main())
