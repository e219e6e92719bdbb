"""Pieces of docs/benchmarks.md that every section's renderer uses: markdown tables, median
[min, max] cells, plots saved beside the page."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def table(head: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return [*out, ""]


def spread(s: dict[str, float], fmt: str = ".0f") -> str:
    return f"{s['median']:{fmt}} [{s['min']:{fmt}}, {s['max']:{fmt}}]"


def save(fig: Any, plots: Path, name: str) -> str:
    plots.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(plots / name, dpi=110)
    plt.close(fig)
    return f"![{name}]({plots.name}/{name})"
