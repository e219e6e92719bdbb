"""What the server holds in memory, for /v1/stats: the processes' resident memory and the
caches that hold orders and plans, each with its cap (docs/operations.md, "Memory").

Index orders (server/order/permute.py) hold nothing per epoch: neither figure grows with the
dataset's size or with the seeds and epochs clients ask for. Legacy orders are held in ORDERS
up to max_order_cache_bytes; token plans in PLANS, by bytes too.

Threading: any thread (reads /proc and the caches' counters).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from ..order import token_batches
from ..order.sampling import ORDERS


def rss_anon(pid: int) -> int:
    """Anonymous resident memory of process `pid` in bytes (RssAnon); 0 if it is gone or
    /proc does not say."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def memory_stats(worker_pids: Iterable[int]) -> dict[str, int]:
    return {"front_end_rss_anon_bytes": rss_anon(os.getpid()),
            "workers_rss_anon_bytes": sum(rss_anon(p) for p in worker_pids),
            "legacy_order_cache_bytes": ORDERS.nbytes,
            "legacy_order_cache_max_bytes": ORDERS.max_bytes,
            "token_plan_cache_bytes": token_batches.PLANS.nbytes,
            "token_plan_cache_max_bytes": token_batches.PLANS.max_bytes}
