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
            plot, ""]
