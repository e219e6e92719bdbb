"""What every benchmark here measures and writes the same way: machine facts, busy time of
the whole machine, medians, and the JSON + exit code at the end of a run.

Benchmarks run as scripts (`python benchmarks/NAME.py`), so this folder is on sys.path.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# How stoker batches reached the trainer in a pipeline run (its --transport).
TRANSPORT_LABELS = {"shm": "shared memory (same host)", "grpc": "gRPC frames",
                    "socket": "the data socket (TCP beside gRPC)"}


def transport_of(parameters: dict) -> str:
    """A run's transport; runs from before --transport had --socket (gRPC) or nothing (shm)."""
    return parameters.get("transport") or ("grpc" if parameters.get("socket") else "shm")


def machine_info(**versions: str) -> dict[str, Any]:
    """Machine facts for the JSON, plus the versions the caller names (numpy=..., ...)."""
    return {"cpu_count": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)),
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(), **versions,
            "load_avg_at_start": list(os.getloadavg())}


def machine_busy_seconds() -> float:
    """CPU seconds all processes on this (virtual) machine have been busy, from /proc/stat.

    Busy excludes idle and iowait; steal (time the hypervisor gave to others) is excluded
    too, since nobody here ran then. NaN where /proc/stat is missing.
    """
    try:
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq = map(int, f.readline().split()[1:8])
    except (OSError, ValueError):
        return float("nan")
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def summarise(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def write_results(res: dict[str, Any], report: str, json_path: str | None, quiet: bool) -> int:
    """Print the report, write the JSON; exit code 1 if a check failed or the server did
    not stop cleanly (a figure from a broken run is no figure)."""
    if not quiet:
        print(report)
    if json_path:
        Path(json_path).write_text(json.dumps(res, indent=2, default=str) + "\n")
        if not quiet:
            print(f"results written to {json_path}")
    return 1 if res["check_problems"] or res["server_exit_code"] != 0 else 0


def scenario_parser(doc: str) -> argparse.ArgumentParser:
    """An argument parser with what every scenario takes: --json, --json-only, --quick."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--json-only", action="store_true", help="print nothing but errors")
    ap.add_argument("--quick", action="store_true", help="small settings")
    return ap


def settle(args: argparse.Namespace, quick: dict[str, Any], full: dict[str, Any]) -> None:
    """Arguments left unset take the quick or the full setting."""
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def run_scenario(args: argparse.Namespace, run: Callable[[argparse.Namespace], dict[str, Any]],
                 report: Callable[[dict[str, Any]], str]) -> int:
    """Run, time, print the report, write the JSON; the exit code of write_results."""
    t0 = time.perf_counter()
    res = run(args)
    res["total_s"] = time.perf_counter() - t0
    return write_results(res, report(res) + f"\n\ntotal {res['total_s']:.0f} s", args.json,
                         args.json_only)
