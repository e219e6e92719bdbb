"""The training loop's data stall, simulated as in shared/seeds/000_*: step time and time
spent waiting for data, for synchronous loading, DataLoader with workers, and stoker.

    python benchmarks/stall.py                 # data costs 5..40 ms/batch, 30 ms compute
    python benchmarks/stall.py --quick
    python benchmarks/stall.py --json out.json

The "accelerator work" of a step is a sleep of `--compute-ms` (a GPU step costs the host
almost no CPU). Loading a batch costs `cost` ms of CPU: each sample spins for cost/batch_size
(busy, not asleep: real decoding uses a core). Systems, each over the same steps:

- sync: DataLoader(num_workers=0): load, then compute; the step is their sum.
- DataLoader: num_workers=W, prefetch_factor 2.
- stoker: RemoteLoader from a `stoker serve` with W workers on this machine.

A loader with enough capacity hides the data cost: the step time is then the compute time,
and the ratio step / compute is 1. Reported: medians over the timed steps (warm-up steps
excluded) of step time and data wait, per system and data cost.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _measure import machine_info, run_scenario, scenario_parser, settle, summarise
from _sim import Costly
from torch.utils.data import DataLoader

from stoker.client import RemoteLoader
from stoker.server import ServerProcess, write_config

SYSTEMS = ("sync", "dataloader", "stoker")
LABELS = {"sync": "sync (num_workers=0)", "dataloader": "DataLoader(num_workers=W)",
          "stoker": "stoker RemoteLoader"}
WARMUP = 5  # steps not timed: process start, first batches


def loop(batches: Any, steps: int, compute_s: float) -> dict[str, Any]:
    """The simulated training loop: take a batch (timed wait), then 'compute'."""
    it = iter(batches)
    step_s, wait_s = [], []
    for k in range(steps + WARMUP):
        t0 = time.perf_counter()
        batch = next(it)
        t1 = time.perf_counter()
        _ = batch["x"].shape
        time.sleep(compute_s)
        t2 = time.perf_counter()
        if k >= WARMUP:
            step_s.append(t2 - t0)
            wait_s.append(t1 - t0)
    return {"step_ms": 1000 * statistics.median(step_s),
            "step_ms_mean": 1000 * statistics.fmean(step_s),
            "wait_ms": 1000 * statistics.median(wait_s),
            "wait_ms_mean": 1000 * statistics.fmean(wait_s)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {"benchmark": "stall", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "machine": machine_info(torch=torch.__version__),
                           "parameters": dict(vars(args)), "costs": []}
    n = (args.steps + WARMUP + 4) * args.batch_size
    compute_s = args.compute_ms / 1000
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="stoker-stall-") as tmp:
        for cost in args.costs:
            sample_ms = cost / args.batch_size
            config = write_config(Path(tmp) / f"c{cost}.yaml", {"datasets": {"sim": {
                "format": "python", "factory": "_sim:Costly",
                "options": {"n": n, "sample_ms": sample_ms}}}})
            env = {"PYTHONPATH": os.pathsep.join([str(Path(__file__).parent),
                                                 os.environ.get("PYTHONPATH", "")])}
            server = ServerProcess(config, workers=args.workers, env=env).start()
            row: dict[str, Any] = {"data_ms_per_batch": cost}
            try:
                for name in SYSTEMS:
                    runs = []
                    for _ in range(args.repeats):
                        if name == "stoker":
                            with RemoteLoader(server.address, "sim", batch_size=args.batch_size,
                                              shuffle=False, output="numpy",
                                              prefetch=args.prefetch) as loader:
                                runs.append(loop(loader, args.steps, compute_s))
                        else:
                            w = 0 if name == "sync" else args.workers
                            # Workers from a fork server, not forked here: this process runs
                            # gRPC's threads once a RemoteLoader has run, and a fork then skips
                            # gRPC's fork handlers (a forked worker can die of SIGSEGV).
                            dl = DataLoader(Costly(n, sample_ms), batch_size=args.batch_size,
                                            num_workers=w, multiprocessing_context=(
                                                "forkserver" if w else None))
                            runs.append(loop(dl, args.steps, compute_s))
                            del dl
                    row[name] = {"repeats": runs,
                                 "step_ms": summarise([r["step_ms"] for r in runs]),
                                 "wait_ms": summarise([r["wait_ms"] for r in runs])}
                    row[name]["step_over_compute"] = (row[name]["step_ms"]["median"]
                                                      / args.compute_ms)
                    if not args.json_only:
                        print(f"  data {cost:5.1f} ms  {LABELS[name]:<26} step "
                              f"{row[name]['step_ms']['median']:7.2f} ms  wait "
                              f"{row[name]['wait_ms']['median']:7.2f} ms", flush=True)
            finally:
                code = server.stop()
            if code != 0:
                problems.append(f"data {cost} ms: server exit code {code}: {server.stderr[-1000:]}")
            res["costs"].append(row)
    res["check_problems"] = problems
    res["server_exit_code"] = 0  # per-cost exit codes are in check_problems
    return res


def main(argv: list[str] | None = None) -> int:
    ap = scenario_parser(__doc__)
    ap.add_argument("--compute-ms", type=float, default=30.0)
    ap.add_argument("--costs", type=float, nargs="+", help="data ms per batch to sweep")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--steps", type=int)
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--prefetch", type=int, default=8)
    args = ap.parse_args(argv)
    settle(args, quick={"costs": [40.0], "steps": 30, "repeats": 1},
           full={"costs": [5.0, 10.0, 20.0, 40.0], "steps": 100, "repeats": 3})
    return run_scenario(args, run)


if __name__ == "__main__":
    sys.exit(main())
