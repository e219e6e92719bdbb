"""format: jsonl on what pandas writes (`to_json(orient="records", lines=True)`): fields
without a dtype get the one their values have (integer labels stay int64, not float32), and
a NaN (written as null) fails unless the field has a fill."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from stoker.client import RemoteError, RemoteLoader

from conftest import StartServer

pytestmark = pytest.mark.timeout(60)


def test_pandas_json_lines_keep_their_types(tmp_path: Path, start_server: StartServer,
                                            ledger) -> None:
    frame = pd.DataFrame({"label": [3, 2**40, -1, 0], "score": [0.5, 1.0, np.nan, 2.25],
                          "flag": [True, False, True, True]})
    frame.to_json(tmp_path / "a.jsonl", orient="records", lines=True)
    server = start_server({
        "inferred": {"format": "jsonl", "source": str(tmp_path),
                     "fields": {"label": {}, "score": {"fill": -1}, "flag": {}}},
        "unfilled": {"format": "jsonl", "source": str(tmp_path), "fields": {"score": {}}},
    })
    with RemoteLoader(server.address, "inferred", batch_size=4, shuffle=False,
                      output="numpy", timeout=60) as loader:
        (batch,) = list(loader)
    assert batch["label"].dtype == np.int64 and batch["label"].tolist() == [3, 2**40, -1, 0]
    assert batch["score"].dtype == np.float32
    assert batch["score"].tolist() == [0.5, 1.0, -1.0, 2.25]
    assert batch["flag"].dtype == np.bool_ and batch["flag"].tolist() == [True, False, True,
                                                                           True]
    with pytest.raises(RemoteError) as info, RemoteLoader(
            server.address, "unfilled", batch_size=1, shuffle=False, output="numpy",
            timeout=60) as loader:
        list(loader)
    assert "a.jsonl line 3: field 'score': a null (set the field's fill" in info.value.details
    ledger.record("corrupt input", "a pandas NaN (null) in JSON lines: DATA_LOSS naming the "
                  "line and field, or the fill", tried=2)


@pytest.mark.parametrize(("lines", "dtype"), [
    (['{"x": 1}', '{"x": 2.5}'], np.float32),  # one float among ints: float32
    (['{"x": [3, null]}', '{"x": [1, 2]}'], np.int64),  # nulls are passed over
    (['{"x": true}', '{"x": 0}'], np.int64),
    (['{"y": 1.5}', '{"x": 0}'], np.int64),  # records without the field are passed over
])
def test_an_inferred_dtype(tmp_path: Path, lines: list[str], dtype: type) -> None:
    from stoker.server import Config
    from stoker.server.formats import open_dataset

    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
    shape = [2] if "[" in lines[0] else []
    config = Config.model_validate({"datasets": {"d": {
        "format": "jsonl", "source": str(tmp_path), "fields": {"x": {"shape": shape}}}}})
    ds = open_dataset("d", config)
    assert ds[len(ds) - 1]["x"].dtype == dtype


def test_strings_without_a_dtype_stop_the_open(tmp_path: Path) -> None:
    from stoker.server import Config
    from stoker.server.formats import open_dataset

    (tmp_path / "a.jsonl").write_text('{"x": "cat"}\n')
    config = Config.model_validate({"datasets": {"d": {
        "format": "jsonl", "source": str(tmp_path), "fields": {"x": {}}}}})
    with pytest.raises(ValueError, match="field 'x': holds str values, not numbers: set its "
                                         "dtype"):
        open_dataset("d", config)
