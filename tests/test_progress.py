"""The training loop's view of its data: stats()["stall"], the tqdm bar, the log line."""

from __future__ import annotations

import logging
import re

import pytest

from stoker.client import RemoteLoader

pytestmark = pytest.mark.timeout(60)


def test_stall_is_the_share_of_loop_time_spent_waiting(toy_server) -> None:
    with RemoteLoader(toy_server.address, "toy", batch_size=4, output="numpy",
                      timeout=60) as loader:
        assert loader.stats()["stall"] == 0.0  # no iteration yet
        n = sum(1 for _ in loader)
        stats = loader.stats()
    assert n == len(loader)
    assert 0 < stats["wait_seconds"] <= stats["loop_seconds"]
    assert stats["stall"] == pytest.approx(stats["wait_seconds"] / stats["loop_seconds"])
    assert stats["bytes"] > 0


def test_progress_bar_and_log_line(toy_server, caplog, capsys) -> None:
    pytest.importorskip("tqdm")
    caplog.set_level(logging.INFO, logger="stoker.client")
    with RemoteLoader(toy_server.address, "toy", batch_size=4, output="numpy", timeout=60,
                      progress=True, log_every=1e-9) as loader:
        total = len(loader)
        for _ in loader:
            pass
    bar = capsys.readouterr().err
    assert f"{total}/{total}" in bar and "toy epoch 0" in bar
    lines = [r.getMessage() for r in caplog.records if r.name == "stoker.client"]
    assert len(lines) == total  # log_every tiny: one line per batch
    last = re.fullmatch(r"toy epoch 0: batch (\d+)/(\d+), [\d.]+ batches/s, [\d.]+ MB/s, "
                        r"data stall [\d.]+% \([\d.]+% since the start\)", lines[-1])
    assert last and last.group(1) == last.group(2) == str(total)


def test_bad_log_every_is_refused() -> None:
    with pytest.raises(ValueError, match="log_every must be > 0"):
        RemoteLoader("127.0.0.1:1", "toy", batch_size=4, log_every=0)
