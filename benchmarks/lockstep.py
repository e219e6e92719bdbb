"""Ranks in lockstep (issue 41): data-parallel training waits at every step for the slowest
rank's batch.

    python benchmarks/lockstep.py                 # 8 ranks, 2 servers x 8 workers (issue 41)
    python benchmarks/lockstep.py --quick         # 2 ranks, 2 servers x 2 workers, 10 + 30 steps
    python benchmarks/lockstep.py --json out.json

R rank processes, each with its own loader, step together: take a batch (the wait), a
barrier (every rank has its batch: the all-reduce's synchronisation), then `--compute-ms` of
"accelerator work" (a sleep: a GPU step costs the host little CPU). Samples take
`--sample-ms` asleep on the data side (`_sim:Waiting`: decode time on CPU nodes this machine
does not have) and are `--sample-bytes` each. Systems, over the same steps:

- bound: the same loop with one batch already in hand (no loader): what the steps cost
  alone; the others are measured against it.
- stoker: RemoteLoader(rank=r, world_size=R) against S servers of W workers.
- dataloader: torch DataLoader per rank, num_workers = S x W / R (the same total workers),
  over the rank's share of the same dataset.

Each system runs `--repeats` times (3; --quick 1), alternating (bound, stoker, DataLoader,
bound, ...), each repeat with its own seed; a repeat's ratio is against the bound of the same
repeat, and the repeat with the median ratio gives a system's figures (every repeat's ratio
is in the JSON and on the page: this machine is shared, and one run can lose 10% to it).
Reported per system: steps/s (rank 0's timed steps over their time), the ratio to the bound,
the stall (1 - compute time / step time) and the p99 of the wait per step (batch and
barrier). Every rank's figures are in the JSON.

CPU per step (`cpu_ms_per_step`): CPU seconds (user + system, from /proc/<pid>/stat) spent
over rank 0's timed steps, divided by those steps, split into the rank processes
themselves (their loader threads included), the rank processes' children (DataLoader's
workers), the servers' front ends and the servers' workers (their child processes). On a
machine with fewer cores than busy processes this is what the steps are waiting for.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _measure import machine_info, run_scenario, scenario_parser, settle

HERE = Path(__file__).resolve().parent
SYSTEMS = ("bound", "stoker", "dataloader")
LABELS = {"bound": "same loop, data in hand (bound)", "stoker": "stoker RemoteLoader",
          "dataloader": "DataLoader (same total workers)"}
# Steps not timed: the first batches and the window's growth. Every rank's window is asked
# for at once at the start (8 ranks x ~30 batches: about a second of the servers' work at
# 1.28x what the steps take), so the servers catch up for a second or so: steps/s is the
# steady state after that; `warmup_s` says what the start took, against the bound's.
WARMUP = 30


def _rank_main(system: str, rank: int, args: dict[str, Any], addresses: list[str],
               barrier: Any, out: Any, pids: Any = None) -> None:
    """One rank: its loader, then the loop; its figures go to `out`."""
    sys.path.insert(0, str(HERE))
    import torch

    torch.set_num_threads(1)
    warmup = args["warmup_steps"]
    steps, compute_s = args["steps"] + warmup, args["compute_ms"] / 1000
    world, batch = args["ranks"], args["batch_size"]
    close = None
    if system == "bound":
        held = {"x": torch.zeros((batch, args["sample_bytes"]), dtype=torch.uint8)}

        def source() -> Any:
            while True:
                yield held
        batches = source()
    elif system == "stoker":
        from stoker.client import RemoteLoader

        loader = RemoteLoader(addresses, "sim", batch_size=batch, rank=rank, world_size=world,
                              shuffle=True, seed=args["seed"], timeout=120,
                              **args["stoker_options"])
        close = loader.close
        batches = _epochs(loader)
    else:
        from _sim import Waiting
        from torch.utils.data import DataLoader, Subset

        data = Waiting(args["samples"], args["sample_ms"], args["sample_bytes"],
                       args["sleep_quantum_ms"])
        mine = Subset(data, range(rank, args["samples"], world))
        workers = max(1, args["servers"] * args["workers"] // world)
        dl = DataLoader(mine, batch_size=batch, shuffle=True, num_workers=workers,
                        prefetch_factor=2, persistent_workers=True, drop_last=True)
        batches = _epochs(dl)
    if pids is not None:  # a queue: (rank pids, server pids), put once the ranks started
        pids = pids.get(timeout=120)
    it = iter(batches)
    waits, steps_s, takes, take_cpu = [], [], [], []
    barrier.wait()  # every rank's loader made: start together
    t_begin = time.perf_counter()
    t_start = 0.0
    cpu0: dict[str, float] = {}
    snap = None
    for k in range(steps):
        t0 = time.perf_counter()
        if k == warmup:
            t_start = t0
            if rank == 0 and pids is not None:  # on a thread: /proc is read while ranks step
                snap = threading.Thread(target=lambda: cpu0.update(
                    cpu_snapshot(list(pids[0]), list(pids[1]))))
                snap.start()
        c0 = time.thread_time()
        b = next(it)
        _ = b["x"].shape
        t_took = time.perf_counter()
        c1 = time.thread_time()
        barrier.wait()
        t1 = time.perf_counter()
        time.sleep(compute_s)
        t2 = time.perf_counter()
        if k >= warmup:
            waits.append(t1 - t0)
            takes.append(t_took - t0)
            take_cpu.append(c1 - c0)
            steps_s.append(t2 - t0)
    total = time.perf_counter() - t_start
    cpu: dict[str, float] = {}
    if snap is not None:
        snap.join()
        cpu1 = cpu_snapshot(list(pids[0]), list(pids[1]))
        cpu = {k: 1000 * (cpu1[k] - cpu0[k]) / args["steps"] for k in cpu1}
    if close is not None:
        close()
    out.put({"rank": rank, "steps": args["steps"], "seconds": total,
             "warmup_s": t_start - t_begin,
             "wait_ms": [1000 * w for w in waits], "take_ms": [1000 * w for w in takes],
             "take_cpu_ms": [1000 * w for w in take_cpu], "cpu_ms_per_step": cpu})


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_s(pid: int) -> float:
    """user + system CPU seconds of one process (all its threads), 0 when gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime (fields 14, 15)


def _children(pid: int) -> list[int]:
    """Every descendant of pid (children of each of its threads, recursively)."""
    out: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for t in tasks:
        try:
            kids = [int(k) for k in (t / "children").read_text().split()]
        except OSError:
            continue
        for k in kids:
            out += [k, *_children(k)]
    return out


def cpu_snapshot(ranks: list[int], servers: list[int]) -> dict[str, float]:
    """CPU seconds so far of the rank processes, their children, servers' fronts, workers."""
    return {"ranks": sum(_cpu_s(p) for p in ranks),
            "rank_children": sum(_cpu_s(c) for p in ranks for c in _children(p)),
            "server_front": sum(_cpu_s(p) for p in servers),
            "server_workers": sum(_cpu_s(c) for p in servers for c in _children(p))}


def _epochs(loader: Any) -> Any:
    """Batches without end: epoch after epoch (set_epoch where the loader has it)."""
    epoch = 0
    while True:
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        yield from loader
        epoch += 1


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_system(system: str, args: argparse.Namespace, addresses: list[str],
               server_pids: list[int] | None = None, seed: int = 0) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(args.ranks), ctx.Queue()
    # Rank 0 reads the CPU of every rank and server over its timed steps: it gets the pids.
    manager_pids = ctx.Queue()
    shared = {"steps": args.steps, "compute_ms": args.compute_ms, "ranks": args.ranks,
              "batch_size": args.batch_size, "sample_bytes": args.sample_bytes,
              "sample_ms": args.sample_ms, "samples": args.samples, "servers": args.servers,
              "sleep_quantum_ms": args.sleep_quantum_ms, "warmup_steps": args.warmup_steps,
              "workers": args.workers, "stoker_options": {"output": "torch"}, "seed": seed}
    procs = [ctx.Process(target=_rank_main, args=(system, r, shared, addresses, barrier, out),
                         kwargs={"pids": manager_pids} if r == 0 else {},
                         daemon=False) for r in range(args.ranks)]
    for p in procs:
        p.start()
    manager_pids.put(([p.pid for p in procs], list(server_pids or [])))
    ranks: list[dict[str, Any]] = []
    deadline = time.monotonic() + 600
    while len(ranks) < len(procs):
        try:
            ranks.append(out.get(timeout=1))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"{system}: a rank failed (exit codes {dead}) or timed "
                                   "out") from None
    for p in procs:
        p.join(60)
    ranks.sort(key=lambda r: r["rank"])
    r0 = ranks[0]
    rate = r0["steps"] / r0["seconds"]
    step_ms = 1000 / rate
    waits = [w for r in ranks for w in r["wait_ms"]]
    cpu = r0.get("cpu_ms_per_step") or {}
    if cpu:
        cpu = {**cpu, "total": sum(cpu.values())}
    return {"system": system, "steps_per_s": rate, "step_ms": step_ms,
            "stall": max(0.0, 1 - args.compute_ms / step_ms),
            "wait_p50_ms": statistics.median(waits), "wait_p99_ms": _p(waits, 0.99),
            "warmup_s": r0.get("warmup_s"), "cpu_ms_per_step": cpu, "ranks": ranks}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from stoker.server import ServerProcess, write_config

    res: dict[str, Any] = {"benchmark": "lockstep",
                           "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "machine": machine_info(torch=torch.__version__),
                           "parameters": dict(vars(args)), "systems": {},
                           "check_problems": [], "server_exit_code": 0}
    # Enough samples that the timed steps stay in one or two epochs of each rank.
    per_rank = (args.steps + args.warmup_steps + 8) * args.batch_size
    args.samples = per_rank * args.ranks
    res["parameters"]["samples"] = args.samples
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory(prefix="stoker-lockstep-") as tmp:
        config = write_config(Path(tmp) / "c.yaml", {"datasets": {"sim": {
            "format": "python", "factory": "_sim:Waiting",
            "options": {"n": args.samples, "sample_ms": args.sample_ms,
                        "quantum_ms": args.sleep_quantum_ms,
                        "sample_bytes": args.sample_bytes}}}})
        servers = [ServerProcess(config, workers=args.workers, env=env)
                   for _ in range(args.servers)]
        try:
            for s in servers:
                s.start()
            addresses = [s.address for s in servers]
            runs: dict[str, list[dict[str, Any]]] = {system: [] for system in args.systems}
            for repeat in range(args.repeats):
                for system in args.systems:
                    # Each repeat its own seed: other batches than the last one's (none of
                    # them kept by the servers for it).
                    runs[system].append(run_system(
                        system, args, addresses,
                        [s.proc.pid for s in servers if s.proc is not None], seed=repeat))
                    print(f"{system} ({repeat + 1}/{args.repeats}): "
                          f"{runs[system][-1]['steps_per_s']:.2f} steps/s",
                          file=sys.stderr, flush=True)
        finally:
            for s in servers:
                code = s.stop()
                res["server_exit_code"] = res["server_exit_code"] or code
    res["systems"] = {system: _median_run(done, runs.get("bound"))
                      for system, done in runs.items()}
    return res


def _median_run(done: list[dict[str, Any]], bound: list[dict[str, Any]] | None
                ) -> dict[str, Any]:
    """A system's figures over the repeats: each repeat's steps/s against the bound's in
    the same repeat (the runs alternate: bound, stoker, DataLoader, bound, ...); the repeat
    with the median ratio gives every figure, with each repeat's ratio and steps/s beside."""
    for i, r in enumerate(done):
        b = bound[i]["steps_per_s"] if bound else None
        r["of_bound"] = r["steps_per_s"] / b if b else None
    ranked = sorted(done, key=lambda r: r["of_bound"] or r["steps_per_s"])
    median = dict(ranked[(len(ranked) - 1) // 2])
    median["repeats"] = [{"steps_per_s": r["steps_per_s"], "of_bound": r["of_bound"],
                          "wait_p99_ms": r["wait_p99_ms"]} for r in done]
    return median


def main(argv: list[str] | None = None) -> int:
    ap = scenario_parser(__doc__)
    ap.add_argument("--ranks", type=int)
    ap.add_argument("--servers", type=int)
    ap.add_argument("--workers", type=int, help="per server")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--sample-ms", type=float, default=2.0)
    ap.add_argument("--sample-bytes", type=int, default=32 << 10)
    ap.add_argument("--compute-ms", type=float, default=40.0)
    ap.add_argument("--sleep-quantum-ms", type=float, default=8.0,
                    help="samples' waits slept this much at a time (_sim.Waiting), 0: one "
                         "sleep a sample")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--warmup-steps", type=int,
                    help=f"steps before the timed ones (the start: the first batches; {WARMUP})")
    ap.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    ap.add_argument("--repeats", type=int,
                    help="runs of each system, alternating; the median repeat is reported")
    args = ap.parse_args(argv)
    # --quick (the smoke test): each system runs, is measured and renders; every rank and
    # worker process is a torch import on a 2-core machine, so as few as still make a
    # lockstep of several ranks against several servers.
    settle(args, quick={"ranks": 2, "servers": 2, "workers": 2, "steps": 30,
                        "warmup_steps": 10, "repeats": 1},
           full={"ranks": 8, "servers": 2, "workers": 8, "steps": 200, "warmup_steps": WARMUP,
                 "repeats": 3})
    return run_scenario(args, run)


if __name__ == "__main__":
    sys.exit(main())
