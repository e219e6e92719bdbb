"""What every benchmark here measures and writes the same way: machine facts, busy time of
the whole machine, medians, and the JSON + exit code at the end of a run.

Benchmarks run as scripts (`python benchmarks/NAME.py`), so this folder is on sys.path.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scenarios import ROOT, Scenario, of_script

# Set by `python -m benchmarks` for the script it runs: the scenario, and the command to record.
SCENARIO_ENV, COMMAND_ENV = "STOKER_BENCH_SCENARIO", "STOKER_BENCH_COMMAND"
# At the script's start, before it runs anything: the load of whatever else the machine does.
LOAD_BEFORE = os.getloadavg()
STARTED = time.strftime("%Y-%m-%dT%H:%M:%S%z")

# How stoker batches reached the trainer in a pipeline run (its --transport).
TRANSPORT_LABELS = {"shm": "shared memory (same host, no data connection)",
                    "grpc": "gRPC frames", "socket": "the data socket (TCP beside gRPC)"}


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


def write_results(res: dict[str, Any], json_path: str | None, quiet: bool) -> int:
    """Stamp the results with their provenance, write the JSON (this is the one place results
    are written), print the scenario's page sections; exit code 1 if a check failed or the
    server did not stop cleanly (a figure from a broken run is no figure)."""
    scenario = this_scenario()
    res.setdefault("started", STARTED)
    res["provenance"] = provenance(scenario, res.get("machine"))
    if json_path:
        Path(json_path).write_text(json.dumps(res, indent=2, default=str) + "\n")
    if not quiet:
        if scenario is not None:
            print(sections_text(scenario, res))
        if res.get("check_problems"):
            print("CHECK PROBLEMS:", *(f"  - {x}" for x in res["check_problems"]), sep="\n")
        if "total_s" in res:
            print(f"total {res['total_s']:.0f} s")
        if json_path:
            print(f"results written to {json_path}")
    return 1 if res.get("check_problems") or res.get("server_exit_code", 0) != 0 else 0


def this_scenario() -> Scenario | None:
    """The scenario this process runs: named by `python -m benchmarks`, else the first that
    runs this script."""
    return of_script(Path(sys.argv[0]).name, os.environ.get(SCENARIO_ENV))


def sections_text(scenario: Scenario, res: dict[str, Any]) -> str:
    """The scenario's sections of docs/benchmarks.md, as markdown (plots to a scratch folder)."""
    from report import render  # matplotlib: only once there is something to draw

    with tempfile.TemporaryDirectory(prefix="stoker-bench-plots-") as plots:
        return "\n".join(render(scenario, res, Path(plots)))


def _git(*args: str) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def peer_versions(names: tuple[str, ...], known: dict[str, Any]) -> dict[str, str]:
    """Each distribution's version here, or the one the run reported (`known`: a peer that
    ran in another interpreter, e.g. TensorFlow from .venv-tf)."""
    out = {}
    for name in names:
        reported = known.get(name) or known.get(name.lower())
        if reported:
            out[name] = str(reported)
            continue
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def provenance(scenario: Scenario | None, machine: dict[str, Any] | None = None
               ) -> dict[str, Any]:
    """What a figure needs to be read: the commit it ran on (and its date, and the files
    changed but not committed then), the command, the machine and its load before the run,
    and the versions of stoker's peers in it."""
    commit = _git("rev-parse", "HEAD")
    changed = [line[3:] for line in _git("status", "--porcelain", "--untracked-files=no")
               .splitlines()]
    argv = [Path(sys.argv[0]).name, *sys.argv[1:]]
    return {
        "commit": commit or None,
        "commit_date": _git("show", "-s", "--format=%cI", "HEAD") or None,
        "uncommitted": changed,
        "command": os.environ.get(COMMAND_ENV) or f"python benchmarks/{' '.join(argv)}",
        "script": f"python benchmarks/{' '.join(argv)}",
        "started": STARTED,
        "machine": {"cores": os.cpu_count(), "cores_usable": len(os.sched_getaffinity(0)),
                    "cpu": cpu_model(), "platform": platform.platform(),
                    "python": platform.python_version(),
                    "load_before": [round(x, 2) for x in LOAD_BEFORE]},
        "peers": peer_versions(scenario.peers if scenario else (), machine or {}),
    }


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


def run_scenario(args: argparse.Namespace,
                 run: Callable[[argparse.Namespace], dict[str, Any]]) -> int:
    """Run, time, write the JSON, print the page's sections; the exit code of write_results."""
    t0 = time.perf_counter()
    res = run(args)
    res["total_s"] = time.perf_counter() - t0
    return write_results(res, args.json, args.json_only)
