"""Which sections of docs/benchmarks.md speak for older code: measured at a commit before the
last commit that changed what their scenario exercises (Scenario.paths), or at no recorded
commit at all. `python -m benchmarks --stale` prints them; only the standard library and git.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from scenarios import ROOT, SCENARIOS, Scenario


def _git(*args: str) -> tuple[int, str]:
    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    return done.returncode, done.stdout.strip()


def cuda_here() -> bool:
    """Whether this machine has an NVIDIA device (its driver's device files)."""
    return Path("/dev/nvidiactl").exists() or any(Path("/dev").glob("nvidia[0-9]*"))


def why_stale(scenario: Scenario, results: Path) -> str | None:
    """Why `scenario`'s figures may not speak for the checked-out code; None if they do."""
    path = results / f"{scenario.name}.json"
    if not path.exists():
        return f"not measured (no {path.name})"
    r = json.loads(path.read_text())
    prov = r.get("provenance") or {}
    commit = prov.get("commit")
    if not commit:
        return f"no commit recorded (run started {r.get('started', 'at an unrecorded time')})"
    if _git("cat-file", "-e", f"{commit}^{{commit}}")[0] != 0:
        return f"measured at {commit[:10]}, which is not in this clone's history"
    paths = scenario.paths()
    code, log = _git("log", "--format=%h %cs %s", f"{commit}..HEAD", "--", *paths)
    if code != 0:
        return f"measured at {commit[:10]}, which git cannot compare with HEAD"
    dirty = [f for f in prov.get("uncommitted", [])
             if any(f == p or f.startswith(p.rstrip("/") + "/") for p in paths)]
    if log:
        changes = log.splitlines()
        return (f"measured at {commit[:10]} ({prov.get('commit_date', '')[:10]}); "
                f"{len(changes)} later commit(s) changed what it exercises, the last: "
                f"{changes[0][:100]}")
    if dirty:
        return (f"measured at {commit[:10]} with uncommitted changes to what it exercises: "
                + ", ".join(dirty[:5]))
    if scenario.needs_cuda and r.get("skipped"):  # current, but its main part did not run
        return f"measured at {commit[:10]} without its GPU part ({r['skipped']})"
    return None


def stale_lines(results: Path) -> list[str]:
    """One line per stale scenario, naming its sections; those whose figures need a device
    this machine lacks are marked so."""
    out = []
    for s in SCENARIOS:
        why = why_stale(s, results)
        if why is None:
            continue
        mark = (" [needs a CUDA device, which this machine does not have]"
                if s.needs_cuda and not cuda_here() else "")
        titles = "; ".join(t for t, _ in s.sections)
        out.append(f"{s.name} ({titles}): {why}{mark}")
    return out
