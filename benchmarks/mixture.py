"""A mixture of 3 token datasets (`format: mixture`) against the plain `tokens` format.

    python benchmarks/mixture.py                  # 48M tokens in 3 files, seq_len 2048, 5 repeats
    python benchmarks/mixture.py --quick          # smoke test, well under a minute
    python benchmarks/mixture.py --json out.json

Three flat token files (uint16, generated: nothing is downloaded) of different sizes (1/2,
1/3 and 1/6 of the tokens) are served as three `tokens` datasets and a mixture of them with
weights 0.5/0.3/0.2 (so the smallest component wraps and the largest is partly read), and,
the peer, as one `tokens` dataset over the same three files: the same windows, the same
seq_len, batch size and server (one server serves both, with `--workers` workers). Per
repeat one shuffled epoch of each (the order alternates) through `RemoteLoader(output=
"numpy")`, the first batch timed apart: samples/s and M tokens/s, medians over repeats.
The goal (issue 16): the mixture at >= 0.9x the plain format's samples/s.

Checked every epoch: the plain format delivers every window once; the mixture's shares are
within 2 samples a batch of the weights, and no component sample repeats within its own epoch.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _measure import machine_info, run_scenario, scenario_parser, settle, summarise

from stoker.client import RemoteLoader
from stoker.server import ServerProcess, write_config

FULL = {"tokens": 48_000_000, "seq_len": 2048, "batch_size": 16, "repeats": 5}
QUICK = {"tokens": 1_500_000, "seq_len": 512, "batch_size": 16, "repeats": 2}
SHARES = {"web": 3, "code": 2, "math": 1}  # of the tokens, in sixths
WEIGHTS = {"web": 0.5, "code": 0.3, "math": 0.2}


def make_files(folder: Path, tokens: int) -> dict[str, int]:
    """One uint16 file per component; returns each one's token count."""
    rng = np.random.default_rng(0)
    sizes = {}
    for name, share in SHARES.items():
        n = tokens * share // sum(SHARES.values())
        rng.integers(0, 50_000, size=n, dtype=np.uint16).tofile(folder / f"{name}.bin")
        sizes[name] = n
    return sizes


def read_epoch(server: ServerProcess, dataset: str, p: dict[str, Any], epoch: int
               ) -> tuple[dict[str, Any], list[dict[str, np.ndarray]]]:
    with RemoteLoader(server.address, dataset, batch_size=p["batch_size"], shuffle=True,
                      seed=1, drop_last=False, output="numpy", timeout=300) as loader:
        loader.set_epoch(epoch)
        t0 = time.perf_counter()
        it = iter(loader)
        first = next(it)
        t1 = time.perf_counter()
        kept = [{k: first[k] for k in ("sample_index", "source") if k in first}]
        timed = 0
        for batch in it:
            kept.append({k: batch[k] for k in ("sample_index", "source") if k in batch})
            timed += len(batch["sample_index"])
        t2 = time.perf_counter()
    wall = t2 - t1
    return {"first_batch_s": t1 - t0, "epoch_s": t2 - t0, "samples": timed + len(first[
        "sample_index"]), "samples_per_s": timed / wall,
        "tokens_per_s": timed * p["seq_len"] / wall}, kept


def check_mixture(kept: list[dict[str, np.ndarray]], windows: dict[str, int], p: dict[str, Any],
                  problems: list[str], epoch: int) -> None:
    names = list(WEIGHTS)
    weights = np.array([WEIGHTS[n] for n in names])
    period = sum(windows.values())
    offsets = np.concatenate([[0], np.cumsum([windows[n] for n in names])[:-1]])
    for b in kept:
        counts = np.bincount(b["source"], minlength=len(names))
        if np.abs(counts - len(b["source"]) * weights).max() > 2:
            problems.append(f"mixture epoch {epoch}: a batch's shares {counts.tolist()} are off")
            break
    source = np.concatenate([b["source"] for b in kept])
    index = np.concatenate([b["sample_index"] for b in kept])
    for c, name in enumerate(names):
        own_epoch, rest = np.divmod(index[source == c], period)
        pairs = own_epoch * period + rest - offsets[c]
        if len(np.unique(pairs)) != len(pairs):
            problems.append(f"mixture epoch {epoch}: component {name} repeats a sample "
                            "within its own epoch")


def run(args: argparse.Namespace) -> dict[str, Any]:
    settle(args, QUICK, FULL)
    p = {k: getattr(args, k) for k in FULL}
    problems: list[str] = []
    res: dict[str, Any] = {"params": {**p, "workers": args.workers, "weights": WEIGHTS,
                                      "quick": args.quick},
                           "check_problems": problems, "server_exit_code": 0,
                           "machine": machine_info(numpy=np.__version__)}
    with tempfile.TemporaryDirectory(prefix="stoker-bench-") as tmp:
        work = Path(tmp)
        (work / "data").mkdir()
        sizes = make_files(work / "data", p["tokens"])
        windows = {n: (t - 1) // p["seq_len"] for n, t in sizes.items()}
        block = {"format": "tokens", "seq_len": p["seq_len"], "dtype": "uint16"}
        datasets: dict[str, Any] = {
            n: {**block, "source": str(work / "data" / f"{n}.bin")} for n in SHARES}
        datasets["plain"] = {**block, "source": str(work / "data" / "*.bin")}
        datasets["mix"] = {"format": "mixture", "components": WEIGHTS}
        config = write_config(work / "config.yaml", {"datasets": datasets})
        res["windows"] = {**windows, "plain": sum(windows.values())}
        runs: dict[str, list[dict[str, Any]]] = {"plain": [], "mix": []}
        server = ServerProcess(config, workers=args.workers).start(timeout=600)
        try:
            for rep in range(p["repeats"]):
                for what in (("plain", "mix") if rep % 2 == 0 else ("mix", "plain")):
                    figures, kept = read_epoch(server, what, p, rep)
                    runs[what].append(figures)
                    if what == "plain":
                        index = np.sort(np.concatenate([b["sample_index"] for b in kept]))
                        if not np.array_equal(index, np.arange(res["windows"]["plain"])):
                            problems.append(f"plain epoch {rep}: not every window once")
                    else:
                        check_mixture(kept, windows, p, problems, rep)
        finally:
            res["server_exit_code"] = server.stop()
    res["systems"] = {what: {"repeats": reps, **{k: summarise([x[k] for x in reps]) for k in (
        "samples_per_s", "tokens_per_s", "first_batch_s")}} for what, reps in runs.items()}
    mix, plain = res["systems"]["mix"], res["systems"]["plain"]
    res["ratio_mix_over_plain"] = mix["samples_per_s"]["median"] / plain[
        "samples_per_s"]["median"]
    return res


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = scenario_parser(__doc__)
    ap.add_argument("--tokens", type=int, help="tokens in all three files")
    ap.add_argument("--seq-len", dest="seq_len", type=int)
    ap.add_argument("--batch-size", dest="batch_size", type=int)
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--workers", type=int, default=2)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return run_scenario(parse_args(argv), run)


if __name__ == "__main__":
    sys.exit(main())
