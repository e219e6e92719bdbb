"""A framework example's run stopped mid-epoch and resumed, as the Lightning and HF tests
read it (examples/lightning_train.py and examples/hf_trainer.py write the same JSON)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Resumed:
    """What a framework example wrote of a run stopped at step `--stop-at` and resumed:
    each rank's batches as read (`got`) and as an unstopped run reads them (`want`)."""

    out: subprocess.CompletedProcess
    ranks: dict[str, Any]

    def samples(self, key: str) -> list[int]:
        return [i for r in self.ranks.values() for b in r[key] for i in b]


def stopped_and_resumed(run_example: Callable[..., subprocess.CompletedProcess], example: str,
                        address: str, devices: int, tmp_path: Path, steps: int = 36,
                        stop_at: int = 12) -> Resumed:
    """Run examples/`example` (lightning_train.py, hf_trainer.py) with `run_example` (the
    fixture) on `devices` ranks, stopped by an exception after `stop_at` of `steps` steps and
    resumed; one entry a rank."""
    path = tmp_path / "r.json"
    out = run_example(example, "--address", address, "--devices", str(devices), "--steps",
                       str(steps), "--stop-at", str(stop_at), "--json", str(path))
    ranks = json.loads(path.read_text())["ranks"]
    assert sorted(ranks) == [str(r) for r in range(devices)]
    return Resumed(out, ranks)
