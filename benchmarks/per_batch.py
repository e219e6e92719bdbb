"""CPU per batch on the default path, by process: where a small batch's fixed cost goes.

    python benchmarks/per_batch.py                        # 64 KiB batches, 2 x 20,000
    python benchmarks/per_batch.py --quick                # 1 x 2,000
    python benchmarks/per_batch.py --size 1M --batches 3000
    python benchmarks/per_batch.py --shared-batches 0     # without batches kept for other jobs

One `stoker serve` (2 workers) serves wire.py's `Constant` dataset, whose samples cost nothing
to make, to one RemoteLoader in this process told it is on another machine (output numpy,
shared_memory=False: the data connection). Each repeat reads a fresh loader's epoch after a
warm-up batch and reports batches/s and the CPU microseconds per batch of the front end (every
thread of `stoker serve`), of each worker process, and of this process (the trainer's side),
read from /proc and getrusage. Not a comparison with a peer (wire.py is that): a breakdown to
guide work on the fixed cost per batch (docs/tuning.md).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _measure import run_scenario, scenario_parser, settle
from wire import batch_shape, parse_size, proc_table, self_cpu, server_env, tree_cpu

from stoker.client import RemoteLoader
from stoker.server import ServerProcess, write_config


def is_worker(pid: int) -> bool:
    """Whether `pid` is a stoker worker process (its title says so), not a helper."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"stoker worker")
    except OSError:
        return False


def run(args: argparse.Namespace) -> dict[str, Any]:
    batch_size, sample_bytes = batch_shape(args.size)
    cache = {} if args.shared_batches is None else {"shared_batches": args.shared_batches}
    res: dict[str, Any] = {"parameters": dict(vars(args)), "batch_size": batch_size,
                           "sample_bytes": sample_bytes, "repeats": [], "check_problems": []}
    folder = Path(tempfile.mkdtemp(prefix="stoker-per-batch-"))
    config = write_config(folder / "config.yaml", {"cache": cache, "datasets": {"b": {
        "format": "python", "factory": "wire:Constant",
        "options": {"n": batch_size * (args.batches + 1), "sample_bytes": sample_bytes}}}})
    server = ServerProcess(config, workers=args.workers, env=server_env()).start()
    try:
        front = server.proc.pid
        for _ in range(args.repeats):
            loader = RemoteLoader(server.address, "b", batch_size=batch_size, shuffle=False,
                                  drop_last=True, output="numpy", shared_memory=False)
            batches = iter(loader)
            next(batches)  # the warm-up: stream and data connection start
            before = tree_cpu(proc_table(), front)
            workers = [pid for pid in before if is_worker(pid)]
            t0, c0, k = time.perf_counter(), self_cpu(), 0
            for _ in batches:
                k += 1
            wall, client = time.perf_counter() - t0, self_cpu() - c0
            after = tree_cpu(proc_table(), front)
            res["repeats"].append({
                "batches": k, "batches_per_s": k / wall,
                "front_us": (after[front] - before[front]) / k * 1e6,
                "workers_us": [(after[p] - before[p]) / k * 1e6 for p in workers],
                "trainer_us": client / k * 1e6, "transport": loader.stats()["transport"]})
            loader.close()
            if res["repeats"][-1]["transport"] != "data_socket":
                res["check_problems"].append(
                    f"batches came by {res['repeats'][-1]['transport']}, not the data socket")
    finally:
        res["server_exit_code"] = server.stop()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = scenario_parser(__doc__ or "")
    ap.add_argument("--size", type=parse_size, default=64 << 10, help="batch bytes (64K)")
    ap.add_argument("--batches", type=int, help="timed batches per repeat (20000; quick 2000)")
    ap.add_argument("--repeats", type=int, help="repeats (2; quick 1)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--shared-batches", help="the server's cache.shared_batches (default: its "
                    "default)")
    args = ap.parse_args(argv)
    settle(args, {"batches": 2000, "repeats": 1}, {"batches": 20000, "repeats": 2})
    return run_scenario(args, run)


if __name__ == "__main__":
    sys.exit(main())
