"""`RemoteLoader.seek` far against near: one request, not a replay (issue 33's measure).

    python benchmarks/seek.py                  # 20k samples, step 100,000 vs 10, 5 repeats
    python benchmarks/seek.py --quick          # 2k samples, step 10,000 vs 10
    python benchmarks/seek.py --json out.json

The data is token_budgets.py's (JSON lines whose lengths are log-normal), served as `format:
jsonl` with `length_column`, read at world_size 2 cut two ways: `fixed` (`batch_size`) and
`tokens` (`batch_tokens`, where each epoch's plan has its own steps). For each: the first
seek to the far step on a fresh server (under batch_tokens it makes the plans of every epoch
before it, once), then the medians over repeats of seek(near), seek(far) and seek(far) after
an elastic change (`world_sizes=[(0, 2), (far // 2, 3)]`, a 3-rank loader; its first, cold,
timed apart). Checked: the batch after a seek equals batch_at of the position seek found
(tests/test_determinism.py checks that a seek is one request).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _measure import machine_info, run_scenario, scenario_parser, settle
from token_budgets import make_data

from stoker.client import RemoteLoader
from stoker.server import ServerProcess, write_config

FULL = {"samples": 20000, "budget": 8192, "far": 100_000, "repeats": 5}
QUICK = {"samples": 2000, "budget": 4096, "far": 10_000, "repeats": 3}
NEAR, WORLD = 10, 2


def timed(loader: RemoteLoader, step: int, **kw: Any) -> float:
    t0 = time.perf_counter()
    loader.seek(step, **kw)
    return time.perf_counter() - t0


def measure(address: str, size: dict[str, int], p: dict[str, Any], problems: list[str]
            ) -> dict[str, Any]:
    far = p["far"]
    history = [(0, WORLD), (far // 2, WORLD + 1)]
    make = {"seed": 0, "output": "numpy", "timeout": 600, "connect_timeout": 600, **size}
    with RemoteLoader(address, "docs", rank=0, world_size=WORLD, **make) as loader, \
            RemoteLoader(address, "docs", rank=0, world_size=WORLD + 1, **make) as grown:
        loader.describe()
        grown.describe()
        first = timed(loader, far)
        first_elastic = timed(grown, far, world_sizes=history)
        near, farther, elastic = [], [], []
        for _ in range(p["repeats"]):
            near.append(timed(loader, NEAR))
            farther.append(timed(loader, far))
            elastic.append(timed(grown, far, world_sizes=history))
        state = loader.state_dict()
        batch = next(iter(loader))
        again = loader.batch_at(state["epoch"], state["next_batch"])
        if batch["sample_index"].tolist() != again["sample_index"].tolist():
            problems.append(f"{size}: the batch after seek({far}) is not batch_at there")
    med = {k: statistics.median(v) for k, v in
           (("near", near), ("far", farther), ("elastic", elastic))}
    return {**size, "first_far_s": first, "first_elastic_s": first_elastic,
            "near_s": med["near"], "far_s": med["far"], "elastic_far_s": med["elastic"],
            "far_over_near": med["far"] / med["near"],
            "epoch_of_far": state["epoch"]}


def run(args: Any) -> dict[str, Any]:
    settle(args, QUICK, FULL)
    p = {k: getattr(args, k) for k in FULL} | {"quick": args.quick}
    res: dict[str, Any] = {"machine": machine_info(), "params": p, "check_problems": [],
                           "server_exit_code": 0, "started": time.strftime("%Y-%m-%d %H:%M")}
    with tempfile.TemporaryDirectory(prefix="stoker-bench-seek-") as tmp:
        work = Path(tmp)
        lengths = make_data(work, p["samples"], p["budget"])
        config = write_config(work / "config.yaml", {"datasets": {"docs": {
            "format": "jsonl", "source": str(work / "data.jsonl"), "length_column": "ids",
            "fields": {"ids": {"dtype": "int32", "shape": [-1]}}}}})
        sizes = {"fixed": {"batch_size": max(1, round(p["budget"] / float(lengths.mean())))},
                 "tokens": {"batch_tokens": p["budget"]}}
        res["systems"] = {}
        for name, size in sizes.items():  # a fresh server each: the first seek is cold
            server = ServerProcess(config, workers=1).start()
            try:
                res["systems"][name] = measure(server.address, size, p, res["check_problems"])
            finally:
                res["server_exit_code"] |= server.stop()
    return res


def main() -> int:
    ap = scenario_parser(__doc__ or "")
    for key in FULL:
        ap.add_argument(f"--{key}", type=int, default=None)
    return run_scenario(ap.parse_args(), run)


if __name__ == "__main__":
    sys.exit(main())
