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
        pids += [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    total = {"RssAnon": 0, "VmRSS": 0}
    for p in pids:
        for k, v in status(p).items():
            total[k] += v
    return total


def run(args: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {"benchmark": "memory", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "machine": machine_info(numpy=np.__version__),
                           "parameters": dict(vars(args)), "samples": []}
    n = args.batches * args.batch_size
    with tempfile.TemporaryDirectory(prefix="stoker-memory-") as tmp:
        config = write_config(Path(tmp) / "c.yaml", {"datasets": {"sim": {
            "format": "python", "factory": "_sim:Costly", "options": {"n": n, "sample_ms": 0}}}})
        env = {"PYTHONPATH": os.pathsep.join([str(Path(__file__).parent),
                                             os.environ.get("PYTHONPATH", "")])}
        server = ServerProcess(config, workers=args.workers, env=env).start()
        try:
            every = max(args.batches // 40, 1)
            t0 = time.perf_counter()
            with RemoteLoader(server.address, "sim", batch_size=args.batch_size, shuffle=True,
                              output="numpy", prefetch=args.prefetch, timeout=120) as loader:
                for k, _ in enumerate(loader, 1):
                    if k % every == 0 or k == args.batches:
                        res["samples"].append({
                            "batch": k, "seconds": time.perf_counter() - t0,
                            "server": group(server.proc.pid, children=True),
                            "client": group(os.getpid(), children=False)})
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
    return res


def report(res: dict[str, Any]) -> str:
    s, p = res["summary"], res["parameters"]
    lines = ["", f"memory over {p['batches']} batches of {p['batch_size']} ({p['workers']} "
                 f"server workers): batch {s['from_batch']} -> {s['to_batch']}", "",
             f"{'':<8}{'':<9}{'first MiB':>11}{'last MiB':>10}{'peak MiB':>10}{'growth':>9}"]
    for who in ("server", "client"):
        for key in ("RssAnon", "VmRSS"):
            v = s[who][key]
            lines.append(f"{who:<8}{key:<9}{v['first'] / 2**20:>11.1f}{v['last'] / 2**20:>10.1f}"
                         f"{v['peak'] / 2**20:>10.1f}{v['growth']:>+9.2%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = scenario_parser(__doc__)
    ap.add_argument("--batches", type=int)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--warmup", type=int, help="batches before the first counted sample")
    ap.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--prefetch", type=int, default=16)
    args = ap.parse_args(argv)
    settle(args, quick={"batches": 2_000}, full={"batches": 20_000})
    if args.warmup is None:
        args.warmup = args.batches // 20
    return run_scenario(args, run, report)


if __name__ == "__main__":
    sys.exit(main())
