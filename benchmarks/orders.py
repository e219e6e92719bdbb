"""Orders that cost a batch: the first batch of a new shuffled epoch against the dataset's size.

    python benchmarks/orders.py            # 1e5 .. 1e9 samples, index order; legacy to 1e7
    python benchmarks/orders.py --quick    # 1e5 .. 1e9 samples, index order; legacy to 1e6
    python benchmarks/orders.py --json out.json

A `format: python` dataset whose samples cost nothing (`_sim:Free`), global shuffle, batch
256, one server with one worker. For each size N, a fresh server; then for every seed in
0..3, epoch in 0..4 and rank in {0, 7} of 8, the time from asking for a new epoch's first
batch (`set_epoch`, then `next(iter(loader))`) until it is in hand; and a state saved at rank
0 of 8 after 3 batches, loaded at world_size 5 (an elastic resume) and its first batch timed
the same way. The server's resident memory (RssAnon, front end and workers together) is read
after the server's first batch and after all of them: its growth is what the epochs held.
The legacy order (the whole epoch's permutation) is timed the same way up to `--legacy-max`
samples, and a mixture of three components of N samples each at the largest size.

Token budgets: a Parquet file of `--documents` rows with a `length` column (log-normal
lengths, 1..4096 tokens) in row groups of 65,536 rows (reading a sample decodes its row group:
with row groups of a million rows a batch's reads, not its order, take about a second),
`format: parquet` with `length_column`, batch_tokens 8192 over 8
ranks: the first batch of epochs 0..2, and on a fresh server `seek(1_000_000)` then its batch,
for the index order (windows) and, up to 1e6 documents, the legacy one (the whole epoch's
plan); the server's memory growth over them.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _measure import machine_info, run_scenario, scenario_parser, settle
from memory import group

from stoker.client import RemoteLoader
from stoker.server import ServerProcess, write_config

HERE = Path(__file__).resolve().parent
FULL = {"sizes": [10**5, 10**6, 10**7, 10**8, 10**9], "legacy_max": 10**7, "seeds": 4,
        "epochs": 5, "documents": 10**7}
QUICK = {"sizes": [10**5, 10**6, 10**7, 10**8, 10**9], "legacy_max": 10**6, "seeds": 2,
         "epochs": 3, "documents": 10**6}
TOKENS, FAR = 8192, 1_000_000
# The legacy order's token plan is the whole epoch's, about 2 us a document on an idle core
# (minutes a new epoch on a loaded one): timed beside the index order up to this many.
TOKENS_LEGACY_MAX = 10**6
BATCH, WORLD, RANKS, RESUMED_WORLD = 256, 8, (0, 7), 5


def first_batch(loader: RemoteLoader, epoch: int | None = None) -> float:
    """Seconds from asking for `epoch` (None: where the loader is) to holding its first
    batch."""
    if epoch is not None:
        loader.set_epoch(epoch)
    t0 = time.perf_counter()
    it = iter(loader)
    next(it)
    took = time.perf_counter() - t0
    it.close()
    return took


def measure(n: int, order: str, mixture: bool, p: dict[str, Any], work: Path,
            problems: list[str]) -> dict[str, Any]:
    free = {"format": "python", "factory": "_sim:Free", "options": {"n": n}}
    datasets: dict[str, Any] = {"free": free}
    if mixture:
        datasets = {"a": free, "b": free, "c": free,
                    "free": {"format": "mixture", "components": {"a": 0.5, "b": 0.3, "c": 0.2}}}
    config = write_config(work / f"config-{n}-{order}-{mixture}.yaml", {"datasets": datasets})
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    server = ServerProcess(config, workers=1, env=env).start(timeout=300)
    try:
        kw = {"batch_size": BATCH, "world_size": WORLD, "order": order, "output": "numpy",
              "prefetch": 2, "timeout": 600, "prefetch_next_epoch": False}
        with RemoteLoader(server.address, "free", rank=0, seed=99, **kw) as warm:
            first_batch(warm, 0)  # the server's imports and pools, before the baseline
        assert server.proc is not None
        base = group(server.proc.pid, children=True)["RssAnon"]
        times: list[float] = []
        for seed in range(p["seeds"]):
            for rank in RANKS:
                with RemoteLoader(server.address, "free", rank=rank, seed=seed, **kw) as ld:
                    times += [first_batch(ld, e) for e in range(p["epochs"])]
        with RemoteLoader(server.address, "free", rank=0, seed=5, **kw) as ld:
            it = iter(ld)
            for _ in range(3):
                next(it)
            state = ld.state_dict()
            it.close()
        resumed = {**kw, "world_size": RESUMED_WORLD}
        with RemoteLoader(server.address, "free", rank=1, seed=5, **resumed) as ld:
            ld.load_state_dict(state)
            elastic = first_batch(ld)
        grown = group(server.proc.pid, children=True)["RssAnon"] - base
    finally:
        code = server.stop()
    if code:
        problems.append(f"N={n} {order}: server exit code {code}")
    return {"samples": n, "order": order, "mixture": mixture, "first_batches": len(times),
            "first_batch_s": {"median": statistics.median(times), "max": max(times),
                              "min": min(times)},
            "elastic_first_batch_s": elastic, "rss_growth_bytes": grown}


def documents(work: Path, n: int) -> Path:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    lengths = np.clip(np.random.default_rng(0).lognormal(5.0, 1.0, n), 1, 4096).astype(np.int32)
    path = work / f"docs-{n}.parquet"
    pq.write_table(pa.table({"length": lengths, "label": np.arange(n, dtype=np.int64)}), path,
                   row_group_size=1 << 16)
    return path


def measure_tokens(path: Path, order: str, work: Path, problems: list[str]) -> dict[str, Any]:
    config = write_config(work / f"tokens-{order}.yaml", {"datasets": {"docs": {
        "format": "parquet", "source": str(path), "length_column": "length",
        "fields": {"label": {}}}}})
    kw = {"batch_tokens": TOKENS, "world_size": WORLD, "rank": 7, "order": order, "seed": 1,
          "output": "numpy", "prefetch": 2, "timeout": 1200, "connect_timeout": 600,
          "prefetch_next_epoch": False}
    out: dict[str, Any] = {"order": order}
    # A fresh server each: the seek's is cold. The legacy order's seek plans every epoch before
    # the step, whole (minutes at these sizes): not run.
    for part in ("epochs", "seek") if order == "index" else ("epochs",):
        server = ServerProcess(config, workers=1).start(timeout=600)
        try:
            assert server.proc is not None
            with RemoteLoader(server.address, "docs", **kw) as ld:
                ld.describe()
                base = group(server.proc.pid, children=True)["RssAnon"]
                if part == "epochs":
                    out["first_batch_s"] = [first_batch(ld, e) for e in range(3)]
                    out["steps_per_epoch"] = len(ld)
                else:
                    t0 = time.perf_counter()
                    ld.seek(FAR)
                    it = iter(ld)
                    next(it)
                    out["seek_s"] = time.perf_counter() - t0
                    out["seek_epoch"] = ld.state_dict()["epoch"]
                    it.close()
                out[f"rss_growth_{part}_bytes"] = (group(server.proc.pid, children=True)
                                                   ["RssAnon"] - base)
        finally:
            if (code := server.stop()):
                problems.append(f"tokens {order} {part}: server exit code {code}")
    return out


def run(args: Any) -> dict[str, Any]:
    settle(args, QUICK, FULL)
    p = {k: getattr(args, k) for k in FULL} | {"quick": args.quick, "batch": BATCH,
                                                "world": WORLD, "ranks": list(RANKS)}
    res: dict[str, Any] = {"machine": machine_info(), "params": p, "check_problems": [],
                           "server_exit_code": 0, "started": time.strftime("%Y-%m-%d %H:%M"),
                           "rows": []}
    with tempfile.TemporaryDirectory(prefix="stoker-bench-orders-") as tmp:
        work = Path(tmp)
        for n in p["sizes"]:
            res["rows"].append(measure(n, "index", False, p, work, res["check_problems"]))
            if n <= p["legacy_max"]:
                res["rows"].append(measure(n, "legacy", False, p, work, res["check_problems"]))
        res["rows"].append(measure(max(p["sizes"]), "index", True, p, work,
                                   res["check_problems"]))
        path = documents(work, p["documents"])
        res["tokens"] = [measure_tokens(path, order, work, res["check_problems"])
                         for order in ("index", "legacy")
                         if order == "index" or p["documents"] <= TOKENS_LEGACY_MAX]
    for r in res["rows"]:
        goal = 0.5 if r["mixture"] else 0.2
        if r["order"] == "index" and (r["first_batch_s"]["max"] > goal
                                      or r["rss_growth_bytes"] > 64 << 20):
            res.setdefault("goal_missed", []).append(
                f"N={r['samples']}{' mixture' if r['mixture'] else ''}: first batch max "
                f"{r['first_batch_s']['max']:.3f} s (goal {goal}), memory "
                f"+{r['rss_growth_bytes'] / 2**20:.1f} MiB (goal 64)")
    for t in res["tokens"]:
        if t["order"] == "index" and (max(t["first_batch_s"]) > 1.0 or t["seek_s"] > 2.0 or max(
                t["rss_growth_epochs_bytes"], t["rss_growth_seek_bytes"]) > 256 << 20):
            res.setdefault("goal_missed", []).append(
                f"tokens: first batch max {max(t['first_batch_s']):.2f} s (goal 1), seek "
                f"{t['seek_s']:.2f} s (goal 2), memory goal 256 MiB")
    return res


def main() -> int:
    ap = scenario_parser(__doc__ or "")
    ap.add_argument("--sizes", type=lambda s: [int(float(x)) for x in s.split(",")],
                    default=None, help="comma-separated sample counts, e.g. 1e5,1e9")
    for key in ("legacy_max", "seeds", "epochs", "documents"):
        ap.add_argument(f"--{key.replace('_', '-')}", dest=key, type=lambda s: int(float(s)),
                        default=None)
    return run_scenario(ap.parse_args(), run)


if __name__ == "__main__":
    sys.exit(main())
