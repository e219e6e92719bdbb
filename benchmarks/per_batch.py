"""CPU per batch on the default path, by process: where a small batch's fixed cost goes.

    python benchmarks/per_batch.py                        # 64 KiB batches, 20,000 of them
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

from wire import batch_shape, parse_size, proc_table, self_cpu, server_env, tree_cpu

from stoker.client import RemoteLoader
from stoker.server import ServerProcess, write_config


def is_worker(pid: int) -> bool:
    """Whether `pid` is a stoker worker process (its title says so), not a helper."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"stoker worker")
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=parse_size, default=64 << 10, help="batch bytes (64K)")
    ap.add_argument("--batches", type=int, default=20000, help="timed batches per repeat")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--shared-batches", help="the server's cache.shared_batches (default: its "
                    "default)")
    args = ap.parse_args(argv)
    batch_size, sample_bytes = batch_shape(args.size)
    cache = {} if args.shared_batches is None else {"shared_batches": args.shared_batches}
    folder = Path(tempfile.mkdtemp(prefix="stoker-per-batch-"))
    config = write_config(folder / "config.yaml", {"cache": cache, "datasets": {"b": {
        "format": "python", "factory": "wire:Constant",
        "options": {"n": batch_size * (args.batches + 1), "sample_bytes": sample_bytes}}}})
    print(f"{args.size} bytes a batch ({batch_size} x {sample_bytes}), {args.batches} batches "
          f"timed per repeat, {args.workers} workers; CPU µs per batch:")
    with ServerProcess(config, workers=args.workers,
                       env=server_env()).start() as server:
        front = server.proc.pid
        for repeat in range(args.repeats):
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
            spent = {pid: (after[pid] - before[pid]) / k * 1e6 for pid in (front, *workers)}
            print(f"  repeat {repeat}: {k / wall:8.0f} batches/s  front end {spent[front]:6.0f}"
                  f"  workers {' + '.join(f'{spent[p]:.0f}' for p in workers)}"
                  f"  trainer {client / k * 1e6:5.0f}  ({loader.stats()['transport']})")
            loader.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
