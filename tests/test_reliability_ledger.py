"""The ledger that docs/reliability.md is generated from counts losses and duplicates right."""

from __future__ import annotations

import pytest
from reliability import Ledger, render


def test_compare_counts_lost_and_duplicated_per_element() -> None:
    assert Ledger.compare([0, 1, 2], [0, 1, 2]) == (0, 0)
    assert Ledger.compare([0, 2, 2, 3], [0, 1, 2, 3]) == (1, 1)
    assert Ledger.compare([], [5, 5]) == (2, 0)


def test_rows_render_by_area_and_failed_rows_show() -> None:
    book = Ledger("tests/test_x.py::test_y")
    book.record("servers", "kill -9", lost=0)
    book.record("load", "32 streams", tried=32, detail="p99 12 ms")
    rows = [vars(r) for r in book.rows]
    rows[0]["passed"] = False
    page = render(rows)
    assert page.index("## Servers") < page.index("## Load")
    assert "| kill -9 | 1 | 0 | 0 | **FAILED** |" in page
    assert "| 32 streams | 32 | 0 | 0 | p99 12 ms |" in page
    assert "1 rows failed" in page


def test_an_unknown_area_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown ledger area"):
        Ledger("t").record("weather", "rain")


def test_the_soak_section_shows_the_last_run() -> None:
    soak = {"minutes": 30.0, "clients": 8, "servers": 2, "workers_per_server": 2,
            "fault_every_s": 30.0, "faults_injected": 59, "epochs": 2000,
            "samples_checked": 4_000_000, "lost": 0, "duplicated": 0, "client_errors": [],
            "batches_per_s": 150.0, "wait_ms": {"p50": 0.1, "p99": 4.0},
            "rss_anon_mib_first_quarter": 96.3, "rss_anon_mib_last_quarter": 96.5,
            "shm_left_after_stop": [], "ok": True}
    page = render([], soak)
    assert "## Soak" in page and "30 minutes" in page and "(59 faults)" in page
    assert ("| 2000 | 4000000 | 0 | 0 | 0 | 150 | 0.1 / 4.0 | 96.3 → 96.5 MiB | 0 left | True |"
            in page)
