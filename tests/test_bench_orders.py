"""The orders scenario (benchmarks/orders.py) runs and writes sane output; it asserts no
speed (that is the benchmark's business)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(240)
def test_orders_scenario_times_first_batches_of_both_orders(tmp_path: Path) -> None:
    out = tmp_path / "orders.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "orders.py"), "--sizes", "1e4,1e9",
         "--legacy-max", "1e4", "--seeds", "1", "--epochs", "2", "--documents", "2e4",
         "--json", str(out)],
        capture_output=True, text=True, timeout=220, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    res = json.loads(out.read_text())
    assert res["check_problems"] == [] and res["server_exit_code"] == 0
    rows = {(r["samples"], r["order"], r["mixture"]): r for r in res["rows"]}
    assert set(rows) == {(10**4, "index", False), (10**4, "legacy", False),
                         (10**9, "index", False), (10**9, "index", True)}
    for r in rows.values():
        assert r["first_batches"] == 4  # 1 seed x 2 epochs x ranks 0 and 7
        assert 0 < r["first_batch_s"]["min"] <= r["first_batch_s"]["median"] \
            <= r["first_batch_s"]["max"]
        assert r["elastic_first_batch_s"] > 0
    tokens, legacy = res["tokens"]  # the legacy order's plan up to 1e6 documents
    assert tokens["order"] == "index" and tokens["steps_per_epoch"] > 0
    assert len(tokens["first_batch_s"]) == 3 and tokens["seek_s"] > 0
    assert legacy["order"] == "legacy" and "seek_s" not in legacy  # its seek is not run
