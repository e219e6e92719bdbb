"""Soak: clients stream epoch after epoch from two servers for MINUTES, while one server at a
time is killed (SIGKILL) and restarted on its port every FAULT_EVERY seconds.

    python tests/soak.py --minutes 30 [--clients 8] [--step-ms 50] [--fault-every 30]
                         [--out results/soak.json]

Not part of the test run (pytest collects test_*.py only). Checks, and writes to --out:
- every epoch every client finished has exactly its failure-free sample sequence (lost and
  duplicated counted per sample, as in the reliability ledger);
- every client kept progressing (its slowest gap between two batches);
- the servers' anonymous memory (RssAnon of each server and its workers) over time: the
  growth from the first to the last quarter of the run is the leak figure;
- nothing left in /dev/shm of any server once all are stopped.
Exit status 0 when nothing was lost or duplicated, no client failed and /dev/shm is clean.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

from stoker.client import RemoteLoader  # noqa: E402
from stoker.server import ServerProcess, write_config  # noqa: E402

from conftest import rss_anon, server_env  # noqa: E402

N, BS, DIM = 2048, 16, 1024  # Toy samples: 4 KiB of float32 and 2 KiB of uint8 each
DATASETS = {"toy": {"format": "python", "factory": "toy_datasets:toy",
                    "options": {"n": N, "dim": DIM}}}


def expected(seed: int, epoch: int) -> list[int]:
    order = np.random.default_rng([seed, epoch]).permutation(N)
    return order[: (N // BS) * BS].tolist()


class Client(threading.Thread):
    def __init__(self, k: int, addresses: list[str], stop: threading.Event,
                 step: float) -> None:
        super().__init__(name=f"soak-client-{k}", daemon=True)
        self.k, self.addresses, self.stop, self.step = k, addresses, stop, step
        self.epochs = self.batches = self.lost = self.duplicated = 0
        self.waits: list[float] = []
        self.max_gap = 0.0
        self.error: str | None = None
        self.transport = ""  # what its last stream used: stats()["transport"]

    def run(self) -> None:
        try:
            # Clients 0, 4, ... read shared memory; 2, 6, ... take payloads in gRPC frames;
            # the odd ones (half) take the path between machines, the data connection.
            with RemoteLoader(self.addresses, "toy", batch_size=BS, seed=self.k, order="legacy",
                              output="numpy", prefetch=4, timeout=120,
                              shared_memory=self.k % 4 == 0,
                              data_socket=self.k % 4 != 2) as loader:
                while not self.stop.is_set():
                    epoch = loader.state_dict()["epoch"]
                    got: list[int] = []
                    last = time.perf_counter()
                    for batch in loader:
                        now = time.perf_counter()
                        self.waits.append(now - last)
                        self.max_gap = max(self.max_gap, now - last)
                        got += batch["sample_index"].tolist()
                        self.batches += 1
                        if self.stop.wait(self.step):  # the training step
                            break
                        last = time.perf_counter()
                    else:
                        want, have = Counter(expected(self.k, epoch)), Counter(got)
                        self.lost += sum((want - have).values())
                        self.duplicated += sum((have - want).values())
                        self.epochs += 1
                    self.transport = str(loader.stats().get("transport", ""))
        except Exception as e:  # reported, and the run fails
            self.error = f"{type(e).__name__}: {e}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--fault-every", type=float, default=30.0,
                    help="seconds between kill-and-restart faults; 0: none")
    ap.add_argument("--step-ms", type=float, default=50.0,
                    help="each client's training step per batch (not counted as waiting)")
    ap.add_argument("--sample-every", type=float, default=5.0)
    ap.add_argument("--out", default="results/soak.json")
    args = ap.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="stoker-soak-"))
    config = write_config(tmp / "config.yaml",
                          {"server": {"grace_seconds": 2}, "datasets": DATASETS})
    pids: list[int] = []

    def start(port: int = 0) -> ServerProcess:
        proc = ServerProcess(config, workers=args.workers, port=port, env=server_env()).start()
        assert proc.proc is not None
        pids.append(proc.proc.pid)
        return proc

    servers = [start(), start()]
    ports = [s.ready["grpc_port"] for s in servers]
    addresses = [s.address for s in servers]
    stop = threading.Event()
    clients = [Client(k, addresses, stop, args.step_ms / 1000) for k in range(args.clients)]
    started = time.monotonic()
    end = started + args.minutes * 60
    for c in clients:
        c.start()
    timeline: list[dict[str, Any]] = []
    faults = 0
    next_fault = started + args.fault_every if args.fault_every else float("inf")
    next_sample = started
    wake = threading.Event()
    try:
        while (now := time.monotonic()) < end:
            if now >= next_sample:
                next_sample += args.sample_every
                timeline.append({
                    "t": round(now - started, 1),
                    "rss_anon_mib": [round(rss_anon(s.proc.pid) / 2**20, 1)
                                     for s in servers if s.proc is not None],
                    "shm_segments": len(list(Path("/dev/shm").glob("stoker_*"))),
                    "batches": sum(c.batches for c in clients)})
            if now >= next_fault:
                next_fault += args.fault_every
                i = faults % len(servers)
                victim = servers[i]
                assert victim.proc is not None
                victim.proc.send_signal(signal.SIGKILL)
                victim.stop()
                servers[i] = start(port=ports[i])
                faults += 1
            if any(c.error for c in clients):
                break
            wake.wait(min(next_sample, next_fault, end) - time.monotonic())
    finally:
        stop.set()
        for c in clients:
            c.join(120)
        codes = [s.stop() for s in servers]
    elapsed = time.monotonic() - started
    leftover = sorted(p.name for pid in pids for p in Path("/dev/shm").glob(f"stoker_{pid}_*"))
    waits = np.array([w for c in clients for w in c.waits] or [0.0])
    quarter = max(1, len(timeline) // 4)
    first = np.mean([sum(t["rss_anon_mib"]) for t in timeline[:quarter]])
    last = np.mean([sum(t["rss_anon_mib"]) for t in timeline[-quarter:]])
    result = {
        "minutes": round(elapsed / 60, 2), "clients": args.clients, "servers": 2,
        "workers_per_server": args.workers, "step_ms": args.step_ms,
        "fault_every_s": args.fault_every,
        "faults_injected": faults, "epochs": sum(c.epochs for c in clients),
        "batches": sum(c.batches for c in clients),
        "samples_checked": sum(c.epochs for c in clients) * (N // BS) * BS,
        "lost": sum(c.lost for c in clients), "duplicated": sum(c.duplicated for c in clients),
        "client_errors": [c.error for c in clients if c.error],
        "transports": dict(Counter(c.transport for c in clients)),
        "batches_per_s": round(sum(c.batches for c in clients) / elapsed, 1),
        "wait_ms": {"p50": round(float(np.percentile(waits, 50)) * 1000, 2),
                    "p99": round(float(np.percentile(waits, 99)) * 1000, 2),
                    "max": round(float(waits.max()) * 1000, 1)},
        "slowest_client_gap_s": round(max(c.max_gap for c in clients), 2),
        "rss_anon_mib_first_quarter": round(float(first), 1),
        "rss_anon_mib_last_quarter": round(float(last), 1),
        "server_exit_codes": codes, "shm_left_after_stop": leftover,
        "timeline": timeline,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
    }
    ok = (result["lost"] == result["duplicated"] == 0 and not result["client_errors"]
          and not leftover and result["epochs"] > 0)
    result["ok"] = ok
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    summary = {k: v for k, v in result.items() if k not in ("timeline", "machine")}
    print(json.dumps(summary))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
