"""format: iceberg, delta and lance: tables written by each library's own writer, served by
real servers and read back row for row against the library's own scan of the pinned
snapshot (deletes applied, Iceberg's renamed column followed by field id), on local disk and
on S3 (moto); a table that moves under a running job (tests/test_lake_moving.py has the
two-server run). Snapshots that are gone, pins that disagree and bad input refused, naming
table and snapshot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from lake_tables import (
    MAX_BYTES,
    delta_scan,
    delta_table,
    env_for,
    iceberg_catalog,
    iceberg_scan,
    iceberg_table,
    lance_dataset,
    lance_scan,
    rows,
)

from stoker.client import RemoteLoader

from conftest import StartServer, server_env
from s3_endpoint import (
    MotoServer,
    moto_endpoint_fixture,  # noqa: F401  (the moto_endpoint fixture)
    new_bucket,
    s3_client,
)

pytest.importorskip("pyiceberg")
pytest.importorskip("deltalake")
pytest.importorskip("lance")

pytestmark = pytest.mark.timeout(240)

def served(address: str, dataset: str, **options: Any) -> dict[str, list]:
    """Every row of one unshuffled epoch: id, label and text, in sample order."""
    out: dict[str, list] = {"id": [], "label": [], "text": []}
    options = {"shuffle": False, "drop_last": False, **options}
    with RemoteLoader(address, dataset, batch_size=4, output="numpy", timeout=60,
                      **options) as loader:
        for batch in loader:
            out["id"] += batch["id"].tolist()
            out["label"] += batch["label"].tolist()
            for b, n in zip(batch["text"], batch["text_length"], strict=True):
                out["text"].append(bytes(b[:n]).decode())
    return out


def expected(table: pa.Table, label: str = "label") -> dict[str, list]:
    return {"id": table.column("id").to_pylist(), "label": table.column(label).to_pylist(),
            "text": table.column("text").to_pylist()}


def fields(label: str) -> dict[str, Any]:
    return {"columns": ["id", label, "text"],
            "decode": {"text": {"decode": "utf8", "max_bytes": MAX_BYTES}}}


@pytest.fixture(params=["local", "s3"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str | None]:
    """(a location prefix for the tables, the S3 endpoint or None)."""
    if request.param == "local":
        return str(tmp_path), None
    moto: MotoServer = request.getfixturevalue("moto_endpoint")
    bucket = new_bucket(s3_client(moto.url))
    return f"s3://{bucket}", moto.url


def _s3(endpoint: str | None) -> dict[str, Any]:
    return {"endpoint_url": endpoint, "region": "us-east-1"} if endpoint else {}


def test_each_format_serves_the_librarys_own_scan_row_for_row(
        tmp_path: Path, start_server: StartServer, where: tuple[str, str | None]) -> None:
    root, endpoint = where
    warehouse = f"{root}/wh" if endpoint else f"file://{root}/wh"
    cat = iceberg_catalog(tmp_path, warehouse, endpoint)
    ice = iceberg_table(cat)
    dt = delta_table(f"{root}/clips", endpoint)
    ln = lance_dataset(f"{root}/pairs.lance", endpoint)
    label = {"events": "lab", "clips": "label", "pairs": "label"}
    config = {
        "events": {"format": "iceberg", "catalog": cat, "table": "ns.events",
                   "fields": {"id": {}, "label": {"column": "lab"},
                              "text": {"decode": "utf8", "max_bytes": MAX_BYTES}}},
        "clips": {"format": "delta", "source": f"{root}/clips", **fields("label"),
                  **({"s3": _s3(endpoint)} if endpoint else {})},
        "pairs": {"format": "lance", "source": f"{root}/pairs.lance", **fields("label"),
                  **({"s3": _s3(endpoint)} if endpoint else {})},
    }
    if endpoint:
        config["events"]["s3"] = _s3(endpoint)
    server = start_server(config, env={**server_env(), **env_for(endpoint)})
    scans = {"events": iceberg_scan(ice, ice.current_snapshot().snapshot_id),
             "clips": delta_scan(f"{root}/clips", dt.version(), endpoint),
             "pairs": lance_scan(f"{root}/pairs.lance", ln.version, endpoint)}
    for name, scan in scans.items():
        got = served(server.address, name)
        want = expected(scan, label[name])
        assert got == want, name
        assert min(got["id"]) == 3 and len(got["id"]) == scan.num_rows, name  # 0..2 deleted
    # Iceberg: the renamed column was read from files that wrote it as `label`.
    assert sorted(scans["events"].column("id").to_pylist()) == list(range(3, 22))


def _open(config: dict[str, Any], tmp: Path) -> Any:
    """The dataset `t` of `config`, opened in this process (as a worker opens it)."""
    from stoker.server import load_config, write_config
    from stoker.server.formats import DatasetParts, open_dataset

    cfg = load_config(write_config(tmp / "c.yaml", {"datasets": {"t": config}}))
    return DatasetParts.of(open_dataset("t", cfg))


def test_every_pin_resolves_to_its_snapshot(tmp_path: Path) -> None:
    import datetime
    import time

    import lance
    from deltalake import DeltaTable

    cat = iceberg_catalog(tmp_path, f"file://{tmp_path}/wh")
    table = iceberg_table(cat)
    snaps = [s.snapshot_id for s in table.snapshots()]
    table.manage_snapshots().create_tag(snaps[1], "two").commit()
    ice = {"format": "iceberg", "catalog": cat, "table": "ns.events", "columns": ["id"]}
    second = datetime.datetime.fromtimestamp(table.snapshot_by_id(snaps[1]).timestamp_ms / 1000
                                             + 0.0005, datetime.UTC)
    for pin, want in (({"snapshot_id": snaps[0]}, snaps[0]), ({"ref": "two"}, snaps[1]),
                      ({"ref": "main"}, snaps[-1]), ({"as_of": second.isoformat()}, snaps[1]),
                      ({}, snaps[-1])):
        ds = _open({**ice, **pin}, tmp_path)
        assert ds.snapshot == str(want), pin
        assert len(ds.dataset) == iceberg_scan(table, want).num_rows, pin
    dt = delta_table(str(tmp_path / "d"))
    time.sleep(0.01)
    for pin, want in (({"version": 0}, 0), ({}, dt.version())):
        ds = _open({"format": "delta", "source": str(tmp_path / "d"), "columns": ["id"], **pin},
                   tmp_path)
        assert ds.snapshot == str(want) and len(ds.dataset) == len(
            DeltaTable(str(tmp_path / "d"), version=want).to_pyarrow_table()), pin
    ln = lance_dataset(str(tmp_path / "l.lance"))
    ln.tags.create("first", 1)
    for pin, want in (({"version": 2}, 2), ({"tag": "first"}, 1), ({}, ln.version)):
        ds = _open({"format": "lance", "source": str(tmp_path / "l.lance"), "columns": ["id"],
                    **pin}, tmp_path)
        assert ds.snapshot == str(want), pin
        assert len(ds.dataset) == lance.dataset(str(tmp_path / "l.lance"),
                                                version=want).count_rows(), pin


def test_a_column_the_snapshot_lacks_and_two_pins_are_refused(tmp_path: Path) -> None:
    from stoker.server import ConfigError, load_config, write_config

    cat = iceberg_catalog(tmp_path, f"file://{tmp_path}/wh")
    table = iceberg_table(cat)
    first = table.snapshots()[0].snapshot_id
    ice = {"format": "iceberg", "catalog": cat, "table": "ns.events"}
    # `lab` is the rename's: the first snapshot's schema has `label`.
    with pytest.raises(ValueError, match=rf"ns.events snapshot {first}: column\(s\) \['lab'\]"):
        _open({**ice, "snapshot_id": first, "columns": ["id", "lab"]}, tmp_path)
    with pytest.raises(ConfigError, match="snapshot_id and ref: give at most one"):
        load_config(write_config(tmp_path / "two.yaml", {"datasets": {"t": {
            **ice, "columns": ["id"], "snapshot_id": first, "ref": "main"}}}))


def test_positional_deletes_leave_their_rows_out_and_blocks_follow(tmp_path: Path) -> None:
    """What iceberg.py makes of a scan task's positional deletes (pyiceberg 0.12 writes none
    itself: its deletes rewrite files): rows left out by position in each data file, sample i
    the i-th row left, and block shuffle's shards the row groups that keep a row."""
    import pyarrow.parquet as pq

    from stoker.server import load_config, write_config
    from stoker.server.formats._lake import Files
    from stoker.server.sources import open_storage

    for i, start in enumerate((0, 10)):
        pq.write_table(rows(10, start), tmp_path / f"{i}.parquet", row_group_size=4)
    cfg = load_config(write_config(tmp_path / "c.yaml", {"datasets": {"t": {
        "format": "delta", "source": str(tmp_path), "columns": ["id"]}}})).datasets["t"]
    gone = {"0.parquet": np.array([0, 1, 2, 3]), "1.parquet": np.array([1, 9])}
    files = Files(cfg, open_storage(str(tmp_path)), ["0.parquet", "1.parquet"], "table t",
                  "7", gone)
    kept = [4, 5, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16, 17, 18]
    assert [int(files[i]["id"]) for i in range(len(files))] == kept
    # row groups: [0-3] all gone, [4-7], [8-9], [10-13], [14-17], [18-19]
    assert files.shard_starts.tolist() == [0, 4, 6, 9, 13]
    assert "table t: " in files.source_of(6) and "1.parquet row group 0 row 0" in \
        files.source_of(6)
