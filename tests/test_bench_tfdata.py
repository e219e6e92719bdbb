"""The tf.data service scenario (benchmarks/tfdata_service.py) runs every system and writes
a JSON the page's section renders. It asserts no speed: speed is the benchmark's business.
TensorFlow comes from .venv-tf (make install-tf); without it the scenario measures stoker
alone and says why, which is checked instead."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TF_PYTHON = ROOT / ".venv-tf" / "bin" / "python"


@pytest.mark.timeout(420)
def test_quick_tfdata_scenario_measures_every_system_and_renders(tmp_path: Path) -> None:
    out = tmp_path / "tfdata.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "tfdata_service.py"), "--images", "64",
         "--batch-size", "16", "--workers", "1", "--repeats", "1", "--large", "0", "--json",
         str(out)],
        capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["check_problems"] == []
    (block,) = res["sweep"]
    systems = {"stoker", "tf_service", "tf_local"} if TF_PYTHON.exists() else {"stoker"}
    assert systems <= set(block) and set(block["stoker_over"]) == systems - {"stoker"}
    if not TF_PYTHON.exists():
        assert "make install-tf" in res["skipped_peers"]
    for name in systems:
        (m,) = block[name]["repeats"]
        assert m["images"] == 3 * 16 and m["images_per_s"] > 0  # 4 batches, the first untimed
        # /proc counts CPU in 10 ms ticks: a quick pass's trainer may spend under one tick,
        # so the figure is only checked to be a measurement (not negative, not missing).
        assert m["trainer_cpu_ms_per_image"] >= 0
    assert block["stoker"]["repeats"][0]["server_cpu_ms_per_image"] > 0
    assert "large" not in res  # --large 0: the large set is measure_w again on other photos,
    # 4 more TensorFlow processes (~20 CPU s); its part of the page is rendered from the sweep
    res["large"] = {"data": {**res["data"], "images": 5}, "sweep": res["sweep"]}
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from report_tfdata import tfdata

        text = "\n".join(tfdata(res, tmp_path / "plots"))
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert "| 1 | stoker, W worker processes |" in text
    assert "**The large set**: 5 photos" in text and text.count("| 1 | stoker, W worker") == 2
    assert (tmp_path / "plots" / "tfdata.png").is_file()
