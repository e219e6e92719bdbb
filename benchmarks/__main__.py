"""The benchmark suite: every scenario, its JSON, and docs/benchmarks.md generated from them.

    python -m benchmarks                      # every scenario, full settings (~10 min, 2 cores)
    python -m benchmarks --quick              # every scenario, small settings (a few minutes)
    python -m benchmarks --only pipeline wire # some of them
    python -m benchmarks --report-only        # redraw docs/benchmarks.md from the JSON

Each scenario is one script in this folder, run as its own process (so one scenario's servers
and caches never touch another's) with `--json docs/benchmarks/results/NAME.json`; a scenario
that fails stops the suite with its output. Then benchmarks/report.py writes
docs/benchmarks.md and its plots from whatever JSON that folder holds (the JSON is committed
with the page, so `--report-only` redraws it anywhere).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# name -> (script, full-mode arguments, quick-mode arguments)
SCENARIOS: dict[str, tuple[str, list[str], list[str]]] = {
    "pipeline": ("pipeline.py", ["--workers", "0", "1", "2"],
                 ["--quick", "--workers", "0", "1", "2"]),
    # The same pipeline with batches on the data socket, as between machines (W >= 1 only).
    "pipeline_socket": ("pipeline.py", ["--transport", "socket"],
                        ["--quick", "--transport", "socket"]),
    "wire": ("wire.py", [], ["--quick", "--sizes", "64K,1M,16M"]),
    "stall": ("stall.py", [], ["--quick"]),
    "startup": ("startup.py", [], ["--quick"]),
    "memory": ("memory.py", [], ["--quick"]),
    # The same server's memory with the prefix cache filled by an image dataset (issue 17).
    "memory_prefix_cache": ("memory.py", ["--prefix-cache"], ["--quick", "--prefix-cache"]),
    # The held-out pipeline's epoch 0 (cold) against epoch 1 (prefix cache warm).
    "prefix_cache": ("prefix_cache.py", [], ["--quick"]),
    "scale": ("scale.py", [], ["--quick"]),
    "s3": ("storage.py", [], ["--quick"]),
    "packing": ("packing.py", [], ["--quick"]),
    # Conversations rendered, masked and packed by the server against transformers'
    # apply_chat_template in a DataLoader (issue 43).
    "chat": ("chat.py", [], ["--quick"]),
    "mixture": ("mixture.py", [], ["--quick"]),
    "token_budgets": ("token_budgets.py", [], ["--quick"]),
    "elastic": ("elastic.py", [], ["--quick"]),
    # Four identical jobs at once against one server, against one job (issue 17).
    "sweep": ("sweep.py", [], ["--quick"]),
    # One rank against 4..16 workers and two servers; first batch; epoch boundaries (issue 31).
    "fleet": ("fleet.py", [], ["--quick"]),
    # The image pipeline at batch 256 against batch 32, same server (issue 31).
    "pipeline_batch": ("pipeline_batch.py", [], ["--quick"]),
    # ResNet-50 and a GPT-2 small where CUDA is (skips without), and a CPU stand-in (issue 31).
    "gpu": ("gpu.py", [], ["--quick"]),
    # The first batch of a new shuffled epoch and the server's memory, 1e5 to 1e9 samples
    # (issue 38: orders that cost a batch, not a dataset).
    "orders": ("orders.py", [], ["--quick"]),
    # tf.data service (dispatcher + W workers) and plain tf.data against stoker, the image
    # pipeline from TFRecord files; TensorFlow from .venv-tf (make install-tf) (issue 42).
    "tfdata": ("tfdata_service.py", [], ["--quick"]),
    # R rank processes stepping together against S servers, the bound and DataLoader (issue 41).
    "lockstep": ("lockstep.py", [], ["--quick"]),
    # Video clips: format: video against a PyAV clip Dataset in DataLoader (issue 40).
    "video": ("video.py", [], ["--quick"]),
    # The same rows as loose parquet, Iceberg, Delta and Lance: global shuffle against
    # shuffle: block, local disk and S3 (issue 52).
    "tables": ("tables.py", [], ["--quick"]),
}


def run_scenario(name: str, quick: bool, results: Path, cores: int) -> float:
    script, full, fast = SCENARIOS[name]
    args = fast if quick else full
    if name == "pipeline":  # W over 0..cores
        args = [a for a in args if not a.isdigit() and a != "--workers"]
        args += ["--workers", *map(str, range(cores + 1))]
    elif name == "pipeline_socket":
        args += ["--workers", *map(str, range(1, cores + 1))]
    out = results / f"{name}.json"
    cmd = [sys.executable, str(HERE / script), *args, "--json", str(out)]
    print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    # From a scratch folder: whatever a scenario leaves in its working folder goes with it.
    with tempfile.TemporaryDirectory(prefix=f"stoker-bench-{name}-") as scratch:
        done = subprocess.run(cmd, cwd=scratch, text=True)
    if done.returncode != 0:
        raise SystemExit(f"scenario {name} failed (exit code {done.returncode})")
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    import os

    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small settings for every scenario")
    ap.add_argument("--only", nargs="+", choices=sorted(SCENARIOS), help="these scenarios")
    ap.add_argument("--results", default=str(ROOT / "docs" / "benchmarks" / "results"),
                    help="JSON folder (docs/benchmarks/results/, kept with the page)")
    ap.add_argument("--docs", default=str(ROOT / "docs" / "benchmarks.md"),
                    help="the page to write (docs/benchmarks.md)")
    ap.add_argument("--report-only", action="store_true", help="only regenerate the page")
    args = ap.parse_args(argv)
    results = Path(args.results).resolve()
    results.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        cores = len(os.sched_getaffinity(0))
        for name in args.only or SCENARIOS:
            seconds = run_scenario(name, args.quick, results, cores)
            print(f"== {name}: {seconds:.0f} s", flush=True)
    sys.path.insert(0, str(HERE))
    from report import write_report

    page = write_report(results, Path(args.docs))
    print(f"wrote {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
