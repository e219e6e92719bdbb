"""Token-budget batches (`batch_tokens`) against fixed-size batches on the same variable-length
samples: padding waste, rank imbalance, throughput.

    python benchmarks/token_budgets.py                  # 20k samples, 2 ranks, 3 repeats
    python benchmarks/token_budgets.py --quick          # smoke test, well under a minute
    python benchmarks/token_budgets.py --json out.json

The data is generated (nothing is downloaded): JSON lines of token lists whose lengths are
log-normal (median 256, sigma 0.8, cut at the budget), served as `format: jsonl` with
`length_column`. Both systems read the same server, world_size ranks one after the other
(each rank's epoch, seed = repeat), output numpy:

- `tokens`: `batch_tokens=B` (each rank's batch at most B real tokens, balanced by tokens);
- `fixed`: `batch_size=n`, n = B / the mean length, so a batch holds B tokens on average.

Per batch: real tokens (the attention mask's sum) and padded slots (rows x the batch's
longest, which is what the padded tensor costs the GPU). Reported per system: padding waste
(1 - real / padded slots over the epoch), the rank imbalance of each global step ((max - min)
/ max real tokens across ranks; median, p95 and max over steps), the largest padded batch
(slots: what GPU memory must hold), batches and real tokens per second (medians over repeats).
Checked: every sample at most once per epoch, each token-budget batch within B tokens.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _measure import machine_info, run_scenario, scenario_parser, settle, summarise

from stoker.client import RemoteLoader
from stoker.server import ServerProcess, write_config

FULL = {"samples": 20000, "budget": 8192, "world": 2, "repeats": 3}
QUICK = {"samples": 2000, "budget": 4096, "world": 2, "repeats": 1}
MEDIAN, SIGMA = 256, 0.8


def make_data(folder: Path, samples: int, budget: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(MEDIAN), SIGMA, samples), 8, budget).astype(np.int64)
    with open(folder / "data.jsonl", "w") as f:
        for i, n in enumerate(lengths.tolist()):
            f.write(json.dumps({"ids": [i % 50000] * n}) + "\n")
    return lengths


def read(address: str, system: str, p: dict[str, Any], seed: int, lengths: np.ndarray,
         problems: list[str]) -> dict[str, Any]:
    size = ({"batch_tokens": p["budget"]} if system == "tokens"
            else {"batch_size": max(1, round(p["budget"] / float(lengths.mean())))})
    per_rank, seconds = [], 0.0
    for rank in range(p["world"]):
        with RemoteLoader(address, "docs", seed=seed, rank=rank, world_size=p["world"],
                          output="numpy", timeout=120, **size) as loader:
            t0 = time.perf_counter()
            got = [(b["sample_index"].copy(), int(b["attention_mask"].sum()),
                    int(b["attention_mask"].size)) for b in loader]
            seconds += time.perf_counter() - t0
        per_rank.append(got)
    seen = np.concatenate([idx for got in per_rank for idx, _, _ in got])
    if len(np.unique(seen)) != len(seen):
        problems.append(f"{system}: a sample twice in one epoch")
    real = sum(r for got in per_rank for _, r, _ in got)
    slots = sum(s for got in per_rank for _, _, s in got)
    if system == "tokens" and max(r for got in per_rank for _, r, _ in got) > p["budget"]:
        problems.append("tokens: a batch over batch_tokens")
    steps = min(len(g) for g in per_rank)
    gaps = []
    for k in range(steps):
        tok = [per_rank[r][k][1] for r in range(p["world"])]
        gaps.append((max(tok) - min(tok)) / max(tok))
    return {"batches": sum(len(g) for g in per_rank), "steps": steps, "real_tokens": real,
            "padded_slots": slots, "padding_waste": 1 - real / slots,
            "imbalance_median": float(np.median(gaps)),
            "imbalance_p95": float(np.percentile(gaps, 95)), "imbalance_max": float(max(gaps)),
            "largest_padded_batch": max(s for got in per_rank for _, _, s in got),
            "samples": len(seen), "batches_per_s": sum(len(g) for g in per_rank) / seconds,
            "real_tokens_per_s": real / seconds, **size}


def run(args: Any) -> dict[str, Any]:
    settle(args, QUICK, FULL)
    p = {k: getattr(args, k) for k in FULL} | {"quick": args.quick, "workers": args.workers}
    res: dict[str, Any] = {"machine": machine_info(), "params": p, "check_problems": [],
                           "server_exit_code": 0, "started": time.strftime("%Y-%m-%d %H:%M")}
    with tempfile.TemporaryDirectory(prefix="stoker-bench-tokens-") as tmp:
        work = Path(tmp)
        lengths = make_data(work, p["samples"], p["budget"])
        res["data"] = {"samples": len(lengths), "tokens": int(lengths.sum()),
                       "median_length": float(np.median(lengths)),
                       "mean_length": float(lengths.mean()), "max_length": int(lengths.max())}
        config = write_config(work / "config.yaml", {"datasets": {"docs": {
            "format": "jsonl", "source": str(work / "data.jsonl"), "length_column": "ids",
            "fields": {"ids": {"dtype": "int32", "shape": [-1]}}}}})
        server = ServerProcess(config, workers=args.workers).start()
        runs: dict[str, list[dict[str, Any]]] = {"tokens": [], "fixed": []}
        try:
            for rep in range(p["repeats"]):
                for system in (("tokens", "fixed") if rep % 2 == 0 else ("fixed", "tokens")):
                    runs[system].append(read(server.address, system, p, rep, lengths,
                                             res["check_problems"]))
        finally:
            res["server_exit_code"] = server.stop()
    res["systems"] = {name: {**reps[0], "repeats": reps, **{k: summarise([x[k] for x in reps])
                                                          for k in ("batches_per_s",
                                                                    "real_tokens_per_s")}}
                      for name, reps in runs.items()}
    t, f = res["systems"]["tokens"], res["systems"]["fixed"]
    res["ratio_tokens_over_fixed"] = {
        "real_tokens_per_s": t["real_tokens_per_s"]["median"] / f["real_tokens_per_s"]["median"],
        "padding_waste": t["padding_waste"] / f["padding_waste"] if f["padding_waste"] else 0.0}
    return res


def main(argv: list[str] | None = None) -> int:
    ap = scenario_parser(__doc__)
    for name in FULL:
        ap.add_argument(f"--{name}", type=int, default=None)
    ap.add_argument("--workers", type=int, default=2)
    return run_scenario(ap.parse_args(argv), run)


if __name__ == "__main__":
    sys.exit(main())
