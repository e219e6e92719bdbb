"""The benchmark suite: every scenario, its JSON, and docs/benchmarks.md generated from them.

    python -m benchmarks                      # every scenario, full settings (~10 min, 2 cores)
    python -m benchmarks --quick              # every scenario, small settings (a few minutes)
    python -m benchmarks --only pipeline wire # some of them
    python -m benchmarks --report-only        # redraw docs/benchmarks.md from the JSON
    python -m benchmarks --stale              # the sections older than the code they measure
    python -m benchmarks --readme             # rewrite benchmarks/README.md's scenario list

The scenarios are declared once, in benchmarks/scenarios.py. Each is one script in this
folder, run as its own process (so one scenario's servers and caches never touch another's)
with `--json docs/benchmarks/results/NAME.json`; a scenario that fails stops the suite with its
output. The script stamps its JSON with the commit, the command, the machine and the peers'
versions (_measure.write_results). Then benchmarks/report.py writes docs/benchmarks.md and its
plots from whatever JSON that folder holds (the JSON is committed with the page, so
`--report-only` redraws it anywhere).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))  # the scenario scripts' folder: they import each other by name
from _stale import stale_lines  # noqa: E402
from scenarios import BY_NAME, READMES, readme_with_list  # noqa: E402


def run_scenario(name: str, quick: bool, results: Path, cores: int) -> float:
    scenario = BY_NAME[name]
    out = results / f"{name}.json"
    cmd = [sys.executable, str(HERE / scenario.script), *scenario.arguments(quick, cores),
           "--json", str(out)]
    print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
    env = {**os.environ, "STOKER_BENCH_SCENARIO": name,
           "STOKER_BENCH_COMMAND": scenario.command(quick)}
    t0 = time.perf_counter()
    # From a scratch folder: whatever a scenario leaves in its working folder goes with it.
    with tempfile.TemporaryDirectory(prefix=f"stoker-bench-{name}-") as scratch:
        done = subprocess.run(cmd, cwd=scratch, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"scenario {name} failed (exit code {done.returncode})")
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small settings for every scenario")
    ap.add_argument("--only", nargs="+", choices=sorted(BY_NAME), help="these scenarios")
    ap.add_argument("--results", default=str(ROOT / "docs" / "benchmarks" / "results"),
                    help="JSON folder (docs/benchmarks/results/, kept with the page)")
    ap.add_argument("--docs", default=str(ROOT / "docs" / "benchmarks.md"),
                    help="the page to write (docs/benchmarks.md)")
    ap.add_argument("--report-only", action="store_true", help="only regenerate the page")
    ap.add_argument("--stale", action="store_true",
                    help="list the sections measured before the last commit that changed the "
                    "code they exercise (nothing when none is); exits 0: it only lists")
    ap.add_argument("--readme", action="store_true",
                    help="rewrite the scenario lists of benchmarks/README.md and README.md from "
                    "scenarios.py")
    args = ap.parse_args(argv)
    results = Path(args.results).resolve()
    if args.stale:
        for line in stale_lines(results):
            print(line)
        return 0
    if args.readme:
        for readme in READMES:
            readme.write_text(readme_with_list(readme))
            print(f"wrote {readme}")
        return 0
    results.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        cores = len(os.sched_getaffinity(0))
        for name in args.only or BY_NAME:
            seconds = run_scenario(name, args.quick, results, cores)
            print(f"== {name}: {seconds:.0f} s", flush=True)
    from report import write_report  # matplotlib: only once there is something to draw

    page = write_report(results, Path(args.docs))
    print(f"wrote {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
