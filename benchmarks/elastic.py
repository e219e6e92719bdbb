"""Elastic: servers join and leave a running trainer, and a control loop sizes them on the stall.

    python benchmarks/elastic.py [--quick] [--json out.json]

The trainer is the stall scenario's loop (take a batch, then 'compute': a sleep of
--compute-ms) over a dataset whose batches cost --data-ms each to make, more than the compute:
one server (one worker) cannot keep up. The trainer finds its servers as under a Kubernetes
headless Service: a `dns:///` target, re-resolved every --dns-refresh s, here by a resolver
that reads an address file (RemoteLoader(resolver=...)) that this script or the control
loop writes. Two runs, each checking that every sample came exactly once, in order:

- scripted: 1 server; a 2nd and a 3rd join (listed) a phase apart; then the first leaves
  (off the list and SIGTERM: it drains). Stall, step time and throughput per phase.
- control: `stoker autoscale` (the real command, a child process) starts from one server and
  adds and drains servers on the stall the trainer reports, until it holds the fewest that
  keep the stall under its target (5%). Its trace: time, servers, stall, decision.

The data cost is a wait (default --work sleep): on one machine, servers that each spin a core
would measure how many cores the machine has, not how servers scale; each server stands for a
CPU node of its own. --work spin makes it CPU work.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from _measure import machine_info, run_scenario, scenario_parser, settle

from stoker.client import RemoteLoader
from stoker.server import ServerProcess, write_config
from stoker.server.tools.autoscale import write_addresses

SETTLE = 2.0  # seconds after a change left out of a phase's figures (finding, opening)
N = 10_000_000  # samples: the trainer never reaches the end of the epoch


class Trainer:
    """The simulated training loop on a thread: per step (start, wait, step seconds), and
    the sample indices it got."""

    def __init__(self, listing: Path, args: argparse.Namespace) -> None:
        self.listing, self.args = listing, args
        self.steps: list[tuple[float, float, float]] = []
        self.indices: list[np.ndarray] = []
        self.error: BaseException | None = None
        self.servers: dict[str, Any] = {}  # the loader's view of each server at the end
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.started = 0.0

    def start(self, t0: float) -> Trainer:
        self.started = t0
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)

    def _run(self) -> None:
        a = self.args
        try:
            with RemoteLoader("dns:///elastic:0", "sim", batch_size=a.batch_size,
                              shuffle=False, output="numpy", prefetch=a.prefetch,
                              timeout=60, dns_refresh=a.dns_refresh,
                              resolver=lambda target: self.listing.read_text().split()
                              ) as loader:
                it = iter(loader)
                while not self._stop.is_set():
                    t0 = time.perf_counter()
                    batch = next(it)
                    t1 = time.perf_counter()
                    self.indices.append(batch["sample_index"].copy())
                    time.sleep(a.compute_ms / 1000)
                    self.steps.append((t0 - self.started, t1 - t0, time.perf_counter() - t0))
                self.servers = loader.stats()["servers"]
        except BaseException as e:  # reported by the run, not lost on a thread
            self.error = e

    def exactly_once(self) -> dict[str, int]:
        """Lost and repeated samples against the epoch's order (shuffle=False: 0, 1, ...)."""
        got = np.concatenate(self.indices) if self.indices else np.zeros(0, np.int64)
        counts = np.bincount(got, minlength=len(got))[: len(got)]
        return {"samples": len(got), "lost": int((counts == 0).sum()),
                "duplicated": int(np.clip(counts - 1, 0, None).sum()),
                "in_order": bool(np.array_equal(got, np.arange(len(got))))}


def bins(steps: list[tuple[float, float, float]], servers_at: Any, width: float = 1.0
         ) -> list[dict[str, Any]]:
    """Per `width` s of the run: stall (wait / step time), median step ms, batches/s."""
    out: dict[int, list[tuple[float, float]]] = {}
    for t, wait, step in steps:
        out.setdefault(int(t // width), []).append((wait, step))
    rows = []
    for k in sorted(out):
        waits, times = zip(*out[k], strict=True)
        rows.append({"t": (k + 0.5) * width, "servers": servers_at((k + 0.5) * width),
                     "stall": sum(waits) / sum(times),
                     "step_ms": 1000 * statistics.median(times),
                     "batches_per_s": len(times) / width})
    return rows


def phase_figures(steps: list[tuple[float, float, float]], start: float, end: float,
                  batch_size: int) -> dict[str, Any]:
    inside = [(w, s) for t, w, s in steps if start + SETTLE <= t < end]
    if not inside:
        return {"batches": 0}
    waits, times = zip(*inside, strict=True)
    span = end - start - SETTLE
    return {"from_s": start, "to_s": end, "batches": len(inside),
            "stall": sum(waits) / sum(times), "step_ms": 1000 * statistics.median(times),
            "batches_per_s": len(inside) / span, "samples_per_s": len(inside) * batch_size / span}


def scripted(config: Path, tmp: Path, args: argparse.Namespace, env: dict[str, str]
             ) -> dict[str, Any]:
    listing = tmp / "scripted.txt"
    procs = [ServerProcess(config, workers=1, env=env).start() for _ in range(3)]
    listed = [procs[0]]
    write_addresses(listing, [procs[0].address])
    events = [(0.0, 1, "start: 1 server")]
    codes = []
    t0 = time.perf_counter()
    trainer = Trainer(listing, args).start(t0)
    plan = [(args.phase_s, "join", procs[1]), (2 * args.phase_s, "join", procs[2]),
            (3 * args.phase_s, "drain", procs[0])]
    try:
        for at, what, proc in plan:
            time.sleep(max(0.0, t0 + at - time.perf_counter()))
            if what == "join":
                listed.append(proc)
                write_addresses(listing, [p.address for p in listed])
            else:  # off the name, then SIGTERM: it refuses new credits and drains
                listed.remove(proc)
                write_addresses(listing, [p.address for p in listed])
                proc.proc.send_signal(signal.SIGTERM)
            events.append((time.perf_counter() - t0, len(listed), f"{what}: {proc.address}"))
            if not args.json_only:
                print(f"  {events[-1][0]:5.1f} s  {what}: {len(listed)} servers", flush=True)
        time.sleep(max(0.0, t0 + 4 * args.phase_s - time.perf_counter()))
    finally:
        trainer.stop()
        codes = [p.stop() for p in procs]
    end = 4 * args.phase_s
    if trainer.error is not None:
        raise trainer.error

    def servers_at(t: float) -> int:
        return [n for at, n, _ in events if at <= t][-1]

    bounds = [e[0] for e in events] + [end]
    labels = ["1 server", "2 servers", "3 servers", "2 servers, after one drained"]
    phases = [{"phase": label, "servers": events[k][1],
               **phase_figures(trainer.steps, bounds[k], bounds[k + 1], args.batch_size)}
              for k, label in enumerate(labels)]
    one = phases[0]["batches_per_s"]
    for k, ph in enumerate(phases[:3]):
        ph["efficiency"] = ph["batches_per_s"] / (one * ph["servers"])
        if k:
            ph["added_server_efficiency"] = (ph["batches_per_s"]
                                             - phases[k - 1]["batches_per_s"]) / one
    return {"events": events, "phases": phases, "bins": bins(trainer.steps, servers_at),
            "check": trainer.exactly_once(), "server_exit_codes": codes,
            "servers_seen": trainer.servers}


def controlled(config: Path, tmp: Path, args: argparse.Namespace, env: dict[str, str]
               ) -> dict[str, Any]:
    listing = tmp / "control.txt"
    cmd = [sys.executable, "-m", "stoker.server.cli", "autoscale", "--config", str(config),
           "--addresses", str(listing), "--target-stall", str(args.target),
           "--min-servers", "1", "--max-servers", str(args.max_servers),
           "--cooldown", str(args.cooldown), "--window", str(args.window), "--interval", "1",
           "--workers", "1"]
    scaler = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, **env})
    trace: list[dict[str, Any]] = []
    first = threading.Event()

    def read() -> None:
        assert scaler.stdout is not None
        for line in scaler.stdout:
            trace.append(json.loads(line))
            first.set()
            if not args.json_only and trace[-1]["action"] != "hold":
                r = trace[-1]
                print(f"  {r['t']:5.1f} s  {r['servers']} servers, stall {r['stall']}: "
                      f"{r['action']} ({r['reason']})", flush=True)
        first.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    if not first.wait(120) or not trace:
        scaler.kill()
        raise RuntimeError(f"stoker autoscale did not start: {scaler.stderr.read()}")
    t0 = time.perf_counter()
    offset = trace[0]["t"]  # the control loop's clock at our t0, near enough
    trainer = Trainer(listing, args).start(t0)
    try:
        time.sleep(args.control_s)
    finally:
        trainer.stop()
        scaler.send_signal(signal.SIGTERM)
        scaler.wait(120)
        reader.join(10)
        err = scaler.stderr.read()
        scaler.stdout.close()
        scaler.stderr.close()
    if trainer.error is not None:
        raise trainer.error
    rows = [{**r, "t": r["t"] - offset} for r in trace if r["t"] - offset <= args.control_s]
    changes = [(r["t"], r["servers"] + {"add": 1, "remove": -1}.get(r["action"], 0))
               for r in rows if r["action"] != "hold"]

    def servers_at(t: float) -> int:
        return [n for at, n in [(-1e9, 1), *changes] if at <= t][-1]

    final = rows[-1]["servers"] if rows else 0
    last_change = changes[-1][0] if changes else 0.0
    tail = [b for b in bins(trainer.steps, servers_at) if b["t"] >= last_change + args.cooldown]
    return {"trace": rows, "bins": bins(trainer.steps, servers_at), "final_servers": final,
            "settled_stall": (sum(b["stall"] for b in tail) / len(tail)) if tail else None,
            "converged_at_s": last_change, "check": trainer.exactly_once(),
            "servers_seen": trainer.servers,
            "exit_code": scaler.returncode, "stderr_tail": err[-2000:]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {"benchmark": "elastic",
                           "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "machine": machine_info(numpy=np.__version__),
                           "parameters": dict(vars(args)), "settle_s": SETTLE}
    demand = 1000 / args.compute_ms  # batches/s the trainer takes with no stall
    per_server = 1000 / args.data_ms  # batches/s one server of one worker makes
    res["model"] = {"demand_batches_per_s": demand, "server_batches_per_s": per_server,
                    "fewest_servers": math.ceil(demand * (1 - args.target) / per_server)}
    env = {"PYTHONPATH": os.pathsep.join([str(Path(__file__).parent),
                                         os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory(prefix="stoker-elastic-") as tmp:
        config = write_config(Path(tmp) / "c.yaml", {
            "server": {"grace_seconds": 10},
            "datasets": {"sim": {"format": "python", "factory": "_sim:Costly", "options": {
                "n": N, "sample_ms": args.data_ms / args.batch_size,
                "busy": args.work == "spin"}}}})
        if not args.json_only:
            print("scripted: 1 -> 2 -> 3 servers, then one drains", flush=True)
        res["scripted"] = scripted(config, Path(tmp), args, env)
        if not args.json_only:
            print(f"control loop: stoker autoscale, target stall {args.target:.0%}", flush=True)
        res["control"] = controlled(config, Path(tmp), args, env)
    problems = []
    for part in ("scripted", "control"):
        c = res[part]["check"]
        if c["lost"] or c["duplicated"] or not c["in_order"]:
            problems.append(f"{part}: {c}")
    if any(res["scripted"]["server_exit_codes"]):
        problems.append(f"scripted: server exit codes {res['scripted']['server_exit_codes']}")
    if res["control"]["exit_code"] != 0:
        problems.append(f"control: stoker autoscale exit code {res['control']['exit_code']}: "
                        f"{res['control']['stderr_tail']}")
    res["check_problems"], res["server_exit_code"] = problems, 0
    return res


def main(argv: list[str] | None = None) -> int:
    ap = scenario_parser(__doc__)
    ap.add_argument("--compute-ms", type=float, default=25.0, help="the step's compute")
    ap.add_argument("--data-ms", type=float, default=60.0, help="one batch's cost on a server")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--prefetch", type=int, default=16)
    ap.add_argument("--dns-refresh", type=float, default=0.5)
    ap.add_argument("--work", choices=["sleep", "spin"], default="sleep")
    ap.add_argument("--target", type=float, default=0.05, help="the control loop's stall")
    ap.add_argument("--max-servers", type=int, default=4)
    ap.add_argument("--cooldown", type=float, default=20.0)
    ap.add_argument("--window", type=float, default=8.0)
    ap.add_argument("--phase-s", type=float, help="seconds between scripted changes")
    ap.add_argument("--control-s", type=float, help="seconds the control run lasts")
    args = ap.parse_args(argv)
    settle(args, quick={"phase_s": 10.0, "control_s": 110.0},
           full={"phase_s": 15.0, "control_s": 140.0})
    return run_scenario(args, run)


if __name__ == "__main__":
    sys.exit(main())
