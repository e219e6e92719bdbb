"""The benchmark harness runs and writes sane output. It asserts no speed: speed is a
benchmark's business (benchmarks/), not a test's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_quick_benchmark_writes_both_systems(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "loader_vs_dataloader.py"), "--quick",
         "--repeats", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=280, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    res = json.loads(out.read_text())
    assert res["check_problems"] == [] and res["server_exit_code"] == 0
    for name in ("dataloader", "stoker"):
        system = res["systems"][name]
        assert len(system["repeats"]) == 1
        assert system["batches_per_s"]["min"] <= system["batches_per_s"]["median"]
        assert system["batches_per_s"]["median"] > 0
    assert res["ratio_stoker_over_dataloader"]["batches_per_s_median"] > 0
    assert "ratio stoker / DataLoader" in result.stdout
