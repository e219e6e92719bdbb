"""docs/benchmarks.md's section for the orders scenario (benchmarks/orders.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from _page import plt
from _page import save as _save
from _page import table as _table


def orders(r: dict[str, Any], plots: Path) -> list[str]:
    p, rows = r["params"], r["rows"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9.6, 3.2))
    for order, style in (("index", "o-"), ("legacy", "s--")):
        mine = [x for x in rows if x["order"] == order and not x["mixture"]]
        if not mine:
            continue
        n = [x["samples"] for x in mine]
        left.plot(n, [x["first_batch_s"]["median"] * 1e3 for x in mine], style, label=order)
        right.plot(n, [x["rss_growth_bytes"] / 2**20 for x in mine], style, label=order)
    left.set(xscale="log", yscale="log", xlabel="samples", ylabel="first batch, ms (median)")
    right.set(xscale="log", xlabel="samples", ylabel="server RSS growth, MiB")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    plot = _save(fig, plots, "orders.png")
    table = [[f"{x['samples']:,}" + (" x 3 (mixture)" if x["mixture"] else ""), x["order"],
              f"{x['first_batch_s']['median'] * 1e3:.1f}", f"{x['first_batch_s']['max'] * 1e3:.1f}",
              f"{x['elastic_first_batch_s'] * 1e3:.1f}", f"{x['rss_growth_bytes'] / 2**20:.1f}"]
             for x in rows]
    missed = r.get("goal_missed") or []
    return [f"`format: python` samples that cost nothing, global shuffle, batch {p['batch']}, "
            f"ranks {p['ranks']} of {p['world']}: the first batch of every new epoch (seeds "
            f"0..{p['seeds'] - 1} x epochs 0..{p['epochs'] - 1} x those ranks, "
            f"{rows[0]['first_batches']} first batches a row), then one after a state saved at "
            f"{p['world']} ranks is loaded at 5 (elastic). `index` is the keyed bijection "
            "evaluated per position (new runs); `legacy` the whole epoch's permutation that "
            "states saved before it resume. Memory: the server's RssAnon (front end and "
            "workers) after all of them, less after its first batch. Goals (index order): "
            "first batch <= 200 ms (a mixture 500 ms), memory <= 64 MiB: "
            + ("met on every row." if not missed else "missed: " + "; ".join(missed)), "",
            *_table(["samples", "order", "first batch ms (median)", "max ms",
                     "after an elastic resume, ms", "server RSS growth, MiB"], table),
            plot, "", *_tokens(r)]


def _tokens(r: dict[str, Any]) -> list[str]:
    """The token-budget rows: a Parquet dataset with length_column, batch_tokens 8192."""
    found = r.get("tokens") or []
    if not found:
        return []
    rows = [[t["order"], str(t["steps_per_epoch"]),
             " / ".join(f"{x:.2f}" for x in t["first_batch_s"]),
             f"{t['seek_s']:.2f} (epoch {t['seek_epoch']})" if "seek_s" in t else "not run",
             f"{max(t['rss_growth_epochs_bytes'], t.get('rss_growth_seek_bytes', 0)) / 2**20:.1f}"]
            for t in found]
    return [f"Token budgets: `format: parquet` of {r['params']['documents']:,} documents "
            "(log-normal lengths, 1..4096 tokens) with `length_column`, batch_tokens 8192, rank "
            f"7 of {r['params']['world']}: the first batch of epochs 0, 1 and 2, and on a fresh "
            "server `seek(1_000_000)` then its batch. Goals (index order): first batch <= 1 s, "
            "seek <= 2 s, memory <= 256 MiB. The legacy order plans each epoch whole (timed up "
            "to 1e6 documents; its seek walks every epoch's plan before the step).", "",
            *_table(["order", "steps an epoch", "first batch s (epochs 0 / 1 / 2)",
                     "seek to step 1,000,000, s", "server RSS growth, MiB"], rows)]
