"""The examples train for real: each exits 0 only if its loss fell and its server stopped
cleanly (the checks are in the examples themselves)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(240)
def test_small_gpt_learns_from_packed_text(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "gpt.py"), "--steps", "100",
                          "--log-every", "50"], capture_output=True, text=True, timeout=230,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "server exit 0" in out.stdout and "loss: first 20 steps" in out.stdout


@pytest.mark.timeout(240)
def test_a_mixture_run_stopped_at_2_trainers_resumes_at_3(tmp_path: Path) -> None:
    """docs/mixtures.md's worked example: every slot of the epoch read once across the two
    jobs, as the unstopped run reads it, but for the tail; the shares hold; the loss falls."""
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "elastic.py"), "--stop-at",
                          "30", "--more-epochs", "0"], capture_output=True, text=True, timeout=230,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 differ from the unstopped run" in out.stdout, out.stdout
    assert "3 trainers: the rest of epoch 0 from slot 480" in out.stdout, out.stdout


@pytest.mark.timeout(240)
def test_sft_learns_from_conversations_rendered_and_masked_by_the_server(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "sft.py"), "--steps", "100",
                          "--log-every", "50"], capture_output=True, text=True, timeout=230,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "server exit 0" in out.stdout and "trained on)" in out.stdout


@pytest.mark.timeout(300)
def test_a_tiny_video_classifier_learns_from_served_clips(tmp_path: Path) -> None:
    pytest.importorskip("av")
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "video.py")],
                         capture_output=True, text=True, timeout=290, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "(fell); server exit code 0" in out.stdout, out.stdout
