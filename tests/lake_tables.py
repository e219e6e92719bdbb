"""Lake tables written by each library's own writer (pyiceberg, deltalake's write_deltalake,
lance's write_dataset), on local disk or S3 (the moto server), and each library's own scan of
a snapshot: what tests/test_lake_tables.py holds stoker's rows against.

Every table has the same columns: id (int64), label (int64, `lab` after an Iceberg rename)
and text (string, served with decode: utf8). `rows(n, start)` makes n rows from id `start`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pyarrow as pa

MAX_BYTES = 16


def rows(n: int, start: int = 0, label: str = "label") -> pa.Table:
    ids = list(range(start, start + n))
    return pa.table({"id": pa.array(ids, pa.int64()),
                     label: pa.array([i * 7 % 10 for i in ids], pa.int64()),
                     "text": pa.array([f"row {i}" for i in ids], pa.string())})


# -- Iceberg ------------------------------------------------------------------------------
def iceberg_catalog(tmp: Path, warehouse: str, endpoint: str | None = None) -> dict[str, Any]:
    """The dataset config's `catalog:` block: a SQL catalog on SQLite in `tmp`."""
    cat = {"type": "sql", "uri": f"sqlite:///{tmp}/catalog.db", "warehouse": warehouse}
    if endpoint:
        cat["properties"] = {"s3.endpoint": endpoint, "s3.region": "us-east-1",
                             "s3.access-key-id": "testing", "s3.secret-access-key": "testing"}
    return cat


def load_catalog(cat: dict[str, Any]) -> Any:
    from pyiceberg.catalog import load_catalog as load

    return load("default", **{"type": cat["type"], "uri": cat["uri"],
                              "warehouse": cat["warehouse"], **cat.get("properties", {})})


def iceberg_table(cat: dict[str, Any], name: str = "ns.events") -> Any:
    """A table of two appends (20 rows), then rows with id < 3 deleted, then `label` renamed
    to `lab` and 2 rows appended: files written before the rename hold `label`."""
    catalog = load_catalog(cat)
    catalog.create_namespace_if_not_exists(name.split(".")[0])
    table = catalog.create_table(name, schema=rows(0).schema)
    table.append(rows(10, 0))
    table.append(rows(10, 10))
    table.delete("id < 3")
    with table.update_schema() as update:
        update.rename_column("label", "lab")
    table.append(rows(2, 20, "lab"))
    return catalog.load_table(name)


def iceberg_scan(table: Any, snapshot_id: int) -> pa.Table:
    return table.scan(snapshot_id=snapshot_id).to_arrow()


# -- Delta --------------------------------------------------------------------------------
def delta_options(endpoint: str | None) -> dict[str, str] | None:
    if not endpoint:
        return None
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ALLOW_HTTP": "true", "AWS_REGION": "us-east-1",
            "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_S3_ALLOW_UNSAFE_RENAME": "true"}


def delta_table(uri: str, endpoint: str | None = None) -> Any:
    """Two appends (20 rows), then rows with id < 3 deleted (delta-rs rewrites the file)."""
    from deltalake import DeltaTable, write_deltalake

    opts = delta_options(endpoint)
    write_deltalake(uri, rows(10, 0), storage_options=opts)
    write_deltalake(uri, rows(10, 10), mode="append", storage_options=opts)
    DeltaTable(uri, storage_options=opts).delete("id < 3")
    return DeltaTable(uri, storage_options=opts)


def delta_scan(uri: str, version: int, endpoint: str | None = None) -> pa.Table:
    from deltalake import DeltaTable

    return pa.table(DeltaTable(uri, version=version,
                               storage_options=delta_options(endpoint)).to_pyarrow_table())


# -- Lance --------------------------------------------------------------------------------
def lance_options(endpoint: str | None) -> dict[str, str] | None:
    if not endpoint:
        return None
    return {"aws_endpoint": endpoint, "aws_allow_http": "true", "aws_region": "us-east-1",
            "aws_access_key_id": "testing", "aws_secret_access_key": "testing"}


def lance_dataset(uri: str, endpoint: str | None = None) -> Any:
    """Two appends (20 rows), then rows with id < 3 deleted (a deletion file)."""
    import lance

    opts = lance_options(endpoint)
    lance.write_dataset(rows(10, 0), uri, storage_options=opts)
    ds = lance.write_dataset(rows(10, 10), uri, mode="append", storage_options=opts)
    ds.delete("id < 3")
    return lance.dataset(uri, storage_options=opts)


def lance_scan(uri: str, version: int, endpoint: str | None = None) -> pa.Table:
    import lance

    return lance.dataset(uri, version=version, storage_options=lance_options(endpoint)).to_table()


def env_for(endpoint: str | None) -> dict[str, str]:
    """What a server child needs beside server_env() to reach the moto server."""
    if not endpoint:
        return {}
    from s3_endpoint import s3_env

    return {**s3_env(endpoint), "PATH": os.environ.get("PATH", "")}
