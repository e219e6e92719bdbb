"""Sweep: four identical jobs at once against one server, against one job alone.

    python benchmarks/sweep.py                  # 1024 JPEGs ~375x500, batches of 32, 3 repeats
    python benchmarks/sweep.py --quick          # smoke test, about a minute
    python benchmarks/sweep.py --json out.json

The held-out image pipeline (JPEG ~375x500 -> random resized crop 224 -> flip -> normalize ->
float32 CHW), where the server's CPU is the cost: a hyper-parameter sweep's jobs read the
same dataset with the same seed, so they ask for the same batches. Two servers with the same
config and W workers each (the default cache: requests in flight joined, built batches kept
for cache.shared_seconds within cache.shared_batches):
- lone: one job reads epoch e;
- sweep: four jobs, four processes released together, read epoch e with the same coordinates.
Each repeat reads a new epoch (nothing kept from the one before) and alternates which of the
two goes first; both servers read epoch 0 first (a warm-up, not measured).

Measured: CPU seconds of each server's process tree (front end and workers, from /proc) over
the run, and wall time; the ratio sweep / lone server CPU (issue 17's goal: <= 1.3); how the
sweep server had its batches (built, joined, cached: stoker_shared_batches_total).
Checked: every sweep job's batches are byte-identical to the lone job's (a SHA-256 over every
field of every batch, in order).
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
from _data import RAN_AS, TRANSFORMS, TRANSPORTS, make_image_folder
from _measure import machine_info, run_scenario, scenario_parser, settle, summarise
from wire import proc_table, tree_cpu

from stoker.server import ServerProcess, write_config

FULL = {"images": 1024, "batch_size": 32, "repeats": 3, "jobs": 4}
QUICK = {"images": 128, "batch_size": 16, "repeats": 1, "jobs": 4}
GOAL = 1.3  # issue 17: four jobs at most 1.3x one job's server CPU


def job(address: str, epoch: int, batch_size: int, transport: str,
        gate: Any) -> dict[str, Any]:
    """One job (a process of its own): read the epoch, digest every batch's bytes."""
    from stoker.client import RemoteLoader

    digest = hashlib.sha256()
    images = 0
    with RemoteLoader(address, "imgs", batch_size=batch_size, seed=5, shuffle=True,
                      output="numpy", timeout=300, prefetch_next_epoch=False,
                      **TRANSPORTS[transport]) as loader:
        loader.set_epoch(epoch)
        gate.wait()  # the jobs start together, once each has its loader
        t0 = time.perf_counter()
        for batch in loader:
            for name in sorted(batch):
                a = np.ascontiguousarray(batch[name])
                digest.update(f"{name} {a.dtype.str} {a.shape}".encode())
                digest.update(memoryview(a).cast("B"))
            images += len(batch["sample_index"])
        seconds = time.perf_counter() - t0
        ran = loader.stats()["transport"]
    return {"digest": digest.hexdigest(), "images": images, "seconds": seconds,
            "transport": ran}


def _job(args: tuple) -> dict[str, Any]:
    return job(*args)


def server_cpu(server: ServerProcess) -> float:
    assert server.proc is not None
    return sum(tree_cpu(proc_table(), server.proc.pid).values())


def outcomes(server: ServerProcess) -> dict[str, float]:
    """stoker_shared_batches_total by outcome (all datasets), from /metrics."""
    with urllib.request.urlopen(server.http_url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    got = dict.fromkeys(("built", "joined", "cached"), 0.0)
    for m in re.finditer(r'^stoker_shared_batches_total\{[^}]*outcome="(\w+)"[^}]*\} (\S+)$',
                         text, re.M):
        got[m.group(1)] += float(m.group(2))
    return got


def run_jobs(pool: Any, manager: Any, server: ServerProcess, jobs: int, epoch: int,
             args: argparse.Namespace) -> dict[str, Any]:
    """`jobs` jobs at once on `server`'s epoch: the server's CPU and outcomes over the run."""
    gate = manager.Barrier(jobs)
    before, counts = server_cpu(server), outcomes(server)
    t0 = time.perf_counter()
    results = pool.map(_job, [(server.address, epoch, args.batch_size, args.transport, gate)]
                       * jobs, chunksize=1)
    wall = time.perf_counter() - t0
    cpu = server_cpu(server) - before
    after = outcomes(server)
    return {"server_cpu_s": cpu, "wall_s": wall, "jobs": results,
            "outcomes": {k: after[k] - counts[k] for k in after},
            "images_per_s_per_job": float(np.median([r["images"] / r["seconds"]
                                                     for r in results]))}


def run(args: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {"benchmark": "sweep", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "machine": machine_info(numpy=np.__version__),
                           "parameters": dict(vars(args)), "repeats": []}
    problems: list[str] = []
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="stoker-sweep-") as tmp:
        root = Path(tmp) / "images"
        make_image_folder(root, args.images, 4, 437, shape=(375, 500))
        config = write_config(Path(tmp) / "c.yaml", {"datasets": {"imgs": {
            "format": "image-folder", "source": str(root), "transforms": TRANSFORMS}}})
        servers = {name: ServerProcess(config, workers=args.workers, port=0, http_port=0).start()
                   for name in ("lone", "sweep")}
        codes = {}
        try:
            with ctx.Pool(args.jobs) as pool, ctx.Manager() as manager:
                for server in servers.values():  # warm-up: epoch 0, one job
                    run_jobs(pool, manager, server, 1, 0, args)
                for r in range(args.repeats):
                    epoch = r + 1
                    order = ("lone", "sweep") if r % 2 == 0 else ("sweep", "lone")
                    rep: dict[str, Any] = {"epoch": epoch, "order": list(order)}
                    for name in order:
                        rep[name] = run_jobs(pool, manager, servers[name],
                                             1 if name == "lone" else args.jobs, epoch, args)
                    rep["cpu_ratio"] = rep["sweep"]["server_cpu_s"] / rep["lone"]["server_cpu_s"]
                    reference = rep["lone"]["jobs"][0]["digest"]
                    for i, j in enumerate(rep["sweep"]["jobs"]):
                        if j["digest"] != reference:
                            problems.append(f"epoch {epoch}: sweep job {i}'s batches differ "
                                            "from the lone job's")
                    res["repeats"].append(rep)
                    if not args.json_only:
                        o = rep["sweep"]["outcomes"]
                        print(f"  epoch {epoch}: server CPU lone "
                              f"{rep['lone']['server_cpu_s']:.2f} s, {args.jobs} jobs "
                              f"{rep['sweep']['server_cpu_s']:.2f} s (x{rep['cpu_ratio']:.2f});"
                              f" built {o['built']:.0f}, joined {o['joined']:.0f}, cached "
                              f"{o['cached']:.0f}", flush=True)
        finally:
            for name, server in servers.items():
                codes[name] = server.stop()
    res["transport_ran"] = sorted({j["transport"] for rep in res["repeats"]
                                   for name in ("lone", "sweep") for j in rep[name]["jobs"]})
    problems += [f"--transport {args.transport} asked, batches came by {got}"
                 for got in res["transport_ran"] if got != RAN_AS[args.transport]]
    ratios = [rep["cpu_ratio"] for rep in res["repeats"]]
    res["cpu_ratio"] = summarise(ratios)
    res["goal"] = GOAL
    res["meets_goal"] = res["cpu_ratio"]["median"] <= GOAL
    res["batches_per_epoch"] = args.images // args.batch_size
    res["check_problems"] = problems
    res["server_exit_code"] = next((c for c in codes.values() if c != 0), 0)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = scenario_parser(__doc__)
    ap.add_argument("--images", type=int)
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--jobs", type=int, help="jobs at once in the sweep run (default 4)")
    ap.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                    help="server worker processes (default: one per core)")
    ap.add_argument("--transport", choices=sorted(TRANSPORTS), default="shm",
                    help="how batches reach the jobs (default shm: same host)")
    args = ap.parse_args(argv)
    settle(args, quick=QUICK, full=FULL)
    return run_scenario(args, run)


if __name__ == "__main__":
    sys.exit(main())
