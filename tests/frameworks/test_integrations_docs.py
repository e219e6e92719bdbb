"""docs/integrations.md runs as written (tools/docwalk.py, from this venv: its `python` is this
venv's, which has the frameworks): each section's example trains and checks its resume."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import docwalk  # tools/docwalk.py
from docwalk import Kind, Outcome

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(240)


def test_the_integrations_page_runs_as_written() -> None:
    results = docwalk.walk(ROOT / "docs" / "integrations.md", run=True, fast=True)
    failed = [f"{r.block.where}: {r.detail}" for r in results if r.outcome is Outcome.FAILED]
    assert failed == []
    ran = " ".join(r.block.text for r in results
                   if r.outcome is Outcome.OK and r.block.kind is Kind.BASH)
    for example in ("lightning_train.py", "hf_trainer.py", "dcp_resume.py"):
        assert f"examples/{example}" in ran
