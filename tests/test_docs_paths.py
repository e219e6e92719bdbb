"""Every code path and `stoker.*` name the docs give still exists (tools/docwalk.py --paths):
a module moved or renamed fails here until the pages that name it follow."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import docwalk  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def test_every_code_path_the_docs_name_exists() -> None:
    missing = [m for page in [*docwalk.pages(), *docwalk.PATH_PAGES]
               for m in docwalk.missing_paths(page)]
    assert missing == [], "\n".join(missing)


def test_the_check_finds_what_is_gone_and_passes_what_is_there(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "Here: `server/front/handshake.py`, `fleet/hold.py`, stoker.server.ServerProcess,\n"
        "stoker.client.transport.stream, stoker.v1.StreamRequest, docs/design.md and\n"
        "`docs/benchmarks/results/NAME.json` (a placeholder).\n"
        "Gone: `server/front/gone.py`, `fleet/hedging.py`, stoker.client.NoSuchThing,\n"
        "stoker.server.front.nothing_here.\n")
    found = [m.split(": ", 1)[1] for m in docwalk.missing_paths(page)]
    assert found == ["server/front/gone.py", "fleet/hedging.py", "stoker.client.NoSuchThing",
                     "stoker.server.front.nothing_here"]
