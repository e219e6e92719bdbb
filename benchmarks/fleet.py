"""One trainer against many server workers: does one rank keep a fleet busy? (issue 31)

    python benchmarks/fleet.py                  # W = 4, 8, 16 and two servers of 8, 3 repeats
    python benchmarks/fleet.py --quick          # smoke test, W = 2, 4 and two servers of 2
    python benchmarks/fleet.py --json out.json

The dataset (`_sim:Waiting`, `format: python`): samples of 32 KiB that each take 2 ms of wall
time asleep, standing for the decode time of a sample on cores this machine lacks: a worker
costs this machine almost no CPU, so 16 workers on 2 cores are 16 workers' worth of capacity,
W / 2 ms samples/s. Batches of 256 (8 MiB, as image batches are). One client rank with the
loader's default settings but `shared_memory=False`, so batches cross the wire as they do
between machines.

- Throughput: one server of W workers for each W, then two servers of `--pair` workers (the
  one already running and a second), read by one RemoteLoader: samples/s over an epoch of
  `--batches` batches from iter() (the fill included), against the workers' capacity
  (goal: >= 0.85 of total workers / 2 ms).
- First batch: seconds from iter() to the first batch, the loader described already (goal
  from a server of `--boundary-workers`: <= a quarter of one worker's time for a whole
  batch, 256 x 2 ms / 4 = 0.13 s).
- Epoch boundaries: a consumer that steps every `--step-ms` (a sleep) reads epochs of
  `--epoch-batches` batches from the server of `--boundary-workers`, in both loop styles:
  set_epoch(e) before each epoch, and iterating the loader again (it moves on by itself).
  Stall: the share of the loop's time spent waiting for a batch, after the run's first batch
  (goal < 3%); the wait at each epoch's first batch beside it.

Every server starts once (they start slowly here) and serves every repeat; each repeat reads
an epoch no other read has asked for, so no batch comes from the server's shared-batch cache.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
from _measure import machine_info, run_scenario, scenario_parser, settle, summarise

from stoker.client import RemoteLoader
from stoker.server import ServerProcess, write_config

HERE = Path(__file__).resolve().parent
FULL = {"workers": [4, 8, 16], "pair": 8, "boundary_workers": 8, "batches": 48,
        "repeats": 3, "epochs": 6, "epoch_batches": 10, "step_ms": 100.0}
QUICK = {"workers": [2, 4], "pair": 2, "boundary_workers": 4, "batches": 16, "repeats": 1,
         "epochs": 3, "epoch_batches": 4, "step_ms": 50.0}
GOALS = {"capacity_ratio": 0.85, "first_batch_share": 0.25, "stall": 0.03}
STYLES = {"set_epoch": "set_epoch(e) each epoch", "again": "iterating the loader again"}


def start_server(config: Path, workers: int) -> tuple[ServerProcess, float]:
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    server = ServerProcess(config, workers=workers, env=env).start(timeout=300)
    return server, time.perf_counter() - t0


def loader_for(addresses: list[str], dataset: str, args: argparse.Namespace) -> RemoteLoader:
    # The defaults a new user has, but batches on the wire as between machines.
    return RemoteLoader(addresses, dataset, batch_size=args.batch_size, seed=0,
                        shared_memory=False)


def check(batch: dict[str, Any], args: argparse.Namespace, problems: list[str]) -> None:
    x = batch["x"]
    if tuple(x.shape) != (args.batch_size, args.sample_bytes) and not problems:
        problems.append(f"a batch's x is {list(x.shape)}, wanted "
                        f"{[args.batch_size, args.sample_bytes]}")


def wait_idle(servers: list[ServerProcess], within: float = 30.0) -> None:
    """Until no server has a batch queued or building (/v1/stats): the previous loader's work
    (what it fetched ahead of the epoch that followed, dropped at close) is done, and each
    run starts on idle servers, as a new job does."""
    deadline = time.monotonic() + within
    for server in servers:
        while True:
            with urllib.request.urlopen(f"{server.http_url}/v1/stats", timeout=5) as r:
                stats = json.load(r)
            if not stats["queued_batches"] and not stats["building_batches"]:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{server.address} still busy after {within} s: {stats}")
            time.sleep(0.02)


def read_epoch(servers: list[ServerProcess], epoch: int, args: argparse.Namespace,
               problems: list[str]) -> dict[str, Any]:
    """One epoch of `fleet` by one fresh loader: the first batch's time from iter(), and
    samples/s from iter() to the last batch. The fill is counted: W workers that start
    together finish an epoch of k x W batches in k batch times, so over a whole epoch a
    loader that keeps them busy measures their capacity exactly (after the first batch
    instead, the batches built beside it would count as free)."""
    wait_idle(servers)
    with loader_for([s.address for s in servers], "fleet", args) as loader:
        loader.set_epoch(epoch)
        batches = len(loader)  # described before the clock starts
        t0 = time.perf_counter()
        it = iter(loader)
        check(next(it), args, problems)
        t1 = time.perf_counter()
        rest = 0
        for batch in it:
            check(batch, args, problems)
            rest += 1
        t2 = time.perf_counter()
        window = loader.stats()["prefetch"]
    if rest + 1 != batches:
        problems.append(f"epoch {epoch}: {rest + 1} batches, wanted {batches}")
    return {"epoch": epoch, "first_batch_s": t1 - t0,
            "samples_per_s": batches * args.batch_size / (t2 - t0),
            "after_first_samples_per_s": rest * args.batch_size / (t2 - t1), "window": window}


def throughput(name: str, servers: list[ServerProcess], workers: int, base_epoch: int,
               args: argparse.Namespace, problems: list[str]) -> dict[str, Any]:
    runs = [read_epoch(servers, base_epoch + r, args, problems) for r in range(args.repeats)]
    capacity = workers * 1000 / args.sample_ms
    rate = summarise([r["samples_per_s"] for r in runs])
    row = {"name": name, "servers": len(servers), "workers": workers, "repeats": runs,
           "samples_per_s": rate, "capacity_samples_per_s": capacity,
           "capacity_ratio": rate["median"] / capacity,
           "first_batch_s": summarise([r["first_batch_s"] for r in runs]),
           "window": runs[-1]["window"]}
    if not args.json_only:
        print(f"  {name:<22} {rate['median']:8.0f} samples/s  {row['capacity_ratio']:.2f} of "
              f"{capacity:.0f}  first batch {row['first_batch_s']['median']:.3f} s", flush=True)
    return row


def boundary_run(address: str, style: str, base_epoch: int,
                 args: argparse.Namespace, problems: list[str]) -> dict[str, Any]:
    """`epochs` epochs of `epoch_batches` batches, a step of `step_ms` after each batch. A
    batch's wait runs from the end of the step before it (iter(), set_epoch and the end of
    the epoch before all fall into the next batch's wait)."""
    step_s = args.step_ms / 1000
    waits: list[tuple[int, int, float]] = []  # (epoch, batch in epoch, seconds)
    with loader_for([address], "epochs", args) as loader:
        loader.set_epoch(base_epoch)
        len(loader)
        t = time.perf_counter()
        first_got = t
        for e in range(args.epochs):
            if style == "set_epoch":
                loader.set_epoch(base_epoch + e)
            k = -1
            for k, batch in enumerate(loader):
                got = time.perf_counter()
                if not waits:
                    first_got = got
                waits.append((e, k, got - t))
                check(batch, args, problems)
                time.sleep(step_s)
                t = time.perf_counter()
            if k + 1 != args.epoch_batches:
                problems.append(f"{style} epoch {e}: {k + 1} batches, wanted "
                                f"{args.epoch_batches}")
        end = time.perf_counter()
        loader_stall = loader.stats()["stall"]
    waited = sum(w for _, _, w in waits[1:])  # the run's first batch is start-up, not a boundary
    steps = len(waits) - 1
    return {"style": style, "stall": waited / (end - first_got),
            "batches_per_s": steps / (end - first_got),
            "boundary_wait_s": statistics.median([w for e, k, w in waits if k == 0 and e > 0]
                                                 or [float("nan")]),
            "within_epoch_wait_s": statistics.median([w for _, k, w in waits if k > 0]),
            "loader_stats_stall": loader_stall}


def boundaries(address: str, args: argparse.Namespace,
               problems: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, style in enumerate(STYLES):
        runs = [boundary_run(address, style, 10_000 * (i + 1) + 100 * r, args, problems)
                for r in range(args.repeats)]
        out[style] = {"repeats": runs, "stall": summarise([r["stall"] for r in runs]),
                      "batches_per_s": summarise([r["batches_per_s"] for r in runs]),
                      "boundary_wait_s": summarise([r["boundary_wait_s"] for r in runs]),
                      "within_epoch_wait_s": summarise([r["within_epoch_wait_s"] for r in runs])}
        if not args.json_only:
            s = out[style]
            print(f"  epochs, {STYLES[style]:<28} stall {s['stall']['median']:.1%}  "
                  f"{s['batches_per_s']['median']:.2f} batches/s  wait at a boundary "
                  f"{s['boundary_wait_s']['median']:.3f} s", flush=True)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {"benchmark": "fleet", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "machine": machine_info(numpy=np.__version__),
                           "parameters": dict(vars(args)), "goals": GOALS, "throughput": [],
                           "server_start_s": {}}
    problems: list[str] = []
    per_batch_s = args.batch_size * args.sample_ms / 1000  # one worker's whole batch
    res["first_batch_goal_s"] = GOALS["first_batch_share"] * per_batch_s
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="stoker-fleet-")))
        sample = {"sample_ms": args.sample_ms, "sample_bytes": args.sample_bytes}
        config = write_config(tmp / "fleet.yaml", {"datasets": {
            "fleet": {"format": "python", "factory": "_sim:Waiting",
                      "options": {"n": args.batch_size * args.batches, **sample}},
            "epochs": {"format": "python", "factory": "_sim:Waiting",
                       "options": {"n": args.batch_size * args.epoch_batches, **sample}}}})
        for c, w in enumerate(args.workers):
            server, start_s = start_server(config, w)
            res["server_start_s"][f"1x{w}"] = start_s
            try:
                res["throughput"].append(throughput(f"1 server x {w} workers", [server],
                                                    w, 100 * c, args, problems))
                if w == args.boundary_workers:
                    res["boundaries"] = boundaries(server.address, args, problems)
                if w == args.pair:
                    second, start_s = start_server(config, w)
                    res["server_start_s"][f"2nd 1x{w}"] = start_s
                    try:
                        res["throughput"].append(throughput(
                            f"2 servers x {w} workers", [server, second],
                            2 * w, 100 * len(args.workers), args, problems))
                    finally:
                        if (code := second.stop()) != 0:
                            problems.append(f"second server of {w}: exit code {code}: "
                                            f"{second.stderr[-1000:]}")
            finally:
                if (code := server.stop()) != 0:
                    problems.append(f"server of {w}: exit code {code}: {server.stderr[-1000:]}")
    at = next(r for r in res["throughput"] if r["servers"] == 1
              and r["workers"] == args.boundary_workers)
    res["first_batch_s"] = at["first_batch_s"]
    res["check_problems"], res["server_exit_code"] = problems, 0  # exit codes: in problems
    res["load_avg_at_end"] = list(os.getloadavg())
    return res


def main(argv: list[str] | None = None) -> int:
    ap = scenario_parser(__doc__)
    ap.add_argument("--workers", type=int, nargs="+", help="W of the one-server runs (4 8 16)")
    ap.add_argument("--pair", type=int, help="workers of each of the two servers (8)")
    ap.add_argument("--boundary-workers", type=int,
                    help="the W (one of --workers) of the first-batch and epoch runs (8)")
    ap.add_argument("--batches", type=int, help="batches an epoch of the throughput runs (48)")
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--epochs", type=int, help="epochs of an epoch-boundary run (6)")
    ap.add_argument("--epoch-batches", type=int, help="batches an epoch there (10)")
    ap.add_argument("--step-ms", type=float, help="the consumer's step there (100)")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--sample-ms", type=float, default=2.0)
    ap.add_argument("--sample-bytes", type=int, default=32 << 10)
    args = ap.parse_args(argv)
    settle(args, QUICK, FULL)
    if args.boundary_workers not in args.workers or args.pair not in args.workers:
        ap.error("--boundary-workers and --pair must be among --workers")
    if args.batches < 2 or args.epochs < 2:
        ap.error("--batches and --epochs must be >= 2")
    return run_scenario(args, run)


if __name__ == "__main__":
    sys.exit(main())
