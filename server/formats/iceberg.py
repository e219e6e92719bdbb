"""`format: iceberg`: an Iceberg table at one snapshot, through pyiceberg (the `lake` extra).

The catalog (SQL, SQLite by default, or REST) gives the table's metadata; the snapshot is the
config's pin (`snapshot_id`, `ref`, `as_of`) or the current one. pyiceberg plans the
snapshot's scan (its manifests: the data files, in the order it lists them, and the delete
files that apply to each); the data files are read by format parquet's reader through the
server's storage (s3:// through its disk cache), columns found by field id, so a file written
before a rename is read under the new name. Positional deletes leave their rows out.
Equality deletes: pyiceberg's planner refuses them, and so does this (naming the file):
stoker never serves rows the library itself would not.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._lake import (
    Access,
    Files,
    LakeError,
    check_columns,
    endpoint_and_region,
    library,
    relative_key,
)


def _catalog(cfg: Any, s3: Any) -> Any:
    library(cfg, "pyiceberg")
    from pyiceberg.catalog import load_catalog

    props: dict[str, str] = {"type": cfg.catalog.type, "uri": cfg.catalog.uri}
    if cfg.catalog.warehouse:
        props["warehouse"] = cfg.catalog.warehouse
    endpoint, region = endpoint_and_region(s3)
    if endpoint:
        props["s3.endpoint"] = endpoint
    if region:
        props["s3.region"] = region
    props.update(cfg.catalog.properties)
    try:
        return load_catalog(cfg.catalog.name, **props)
    except Exception as e:
        raise LakeError(f"iceberg table {cfg.table}: catalog {cfg.catalog.uri} did not "
                        f"answer: {type(e).__name__}: {e}", "UNAVAILABLE") from None


def _table(cfg: Any, s3: Any) -> Any:
    from pyiceberg.exceptions import NoSuchNamespaceError, NoSuchTableError

    catalog = _catalog(cfg, s3)
    try:
        return catalog.load_table(cfg.table)
    except (NoSuchTableError, NoSuchNamespaceError):
        raise LakeError(f"iceberg table {cfg.table}: no such table in catalog "
                        f"{cfg.catalog.uri}", "NOT_FOUND") from None
    except Exception as e:
        raise LakeError(f"iceberg table {cfg.table}: catalog {cfg.catalog.uri} did not "
                        f"answer: {type(e).__name__}: {e}", "UNAVAILABLE") from None


def _snapshot(cfg: Any, table: Any) -> Any:
    """The snapshot the config pins, or the current one; LakeError naming what is missing."""
    known = [s.snapshot_id for s in table.snapshots()]
    if cfg.snapshot_id is not None:
        snap = table.snapshot_by_id(cfg.snapshot_id)
        what = f"snapshot {cfg.snapshot_id}"
    elif cfg.ref is not None:
        snap = table.snapshot_by_name(cfg.ref)
        what = f"ref {cfg.ref!r} (branches and tags: {sorted(table.metadata.refs)})"
    elif cfg.as_of is not None:
        snap = table.snapshot_as_of_timestamp(int(cfg.as_of.timestamp() * 1000))
        what = f"a snapshot as of {cfg.as_of.isoformat()}"
    else:
        snap = table.current_snapshot()
        what = "a current snapshot (the table is empty)"
    if snap is None:
        raise LakeError(f"iceberg table {cfg.table}: {what} not found (expired by "
                        f"expire_snapshots, or never made); its snapshots: {known[-8:]}",
                        "NOT_FOUND")
    return snap


def current(cfg: Any, s3: Any) -> str:
    """The snapshot id the config's pin, else the table's current snapshot, resolves to."""
    return str(_snapshot(cfg, _table(cfg, s3)).snapshot_id)


class Iceberg(Files):
    def __init__(self, cfg: Any, access: Access) -> None:
        table = _table(cfg, access.s3)
        snap = _snapshot(cfg, table)
        what = f"iceberg table {cfg.table} snapshot {snap.snapshot_id}"
        schema = table.schemas().get(snap.schema_id, table.schema())
        names = [f.name for f in schema.fields]
        check_columns(cfg, names, what)
        field_ids = {f.name: f.field_id for f in schema.fields}
        try:
            tasks = list(table.scan(snapshot_id=snap.snapshot_id).plan_files())
        except (ValueError, NotImplementedError) as e:  # equality deletes
            raise LakeError(f"{what}: {e}", "FAILED_PRECONDITION") from None
        except OSError as e:  # a manifest missing: files removed by expire_snapshots
            raise LakeError(f"{what}: cannot read its manifests (expired?): {e}",
                            "NOT_FOUND") from None
        if not tasks:
            raise LakeError(f"{what}: no data files", "FAILED_PRECONDITION")
        root = table.metadata.location
        keys = [relative_key(root, t.file.file_path) for t in tasks]
        deleted = self._positional_deletes(table, tasks, keys, what)
        storage = access.open_storage(root.removeprefix("file://"))
        super().__init__(cfg, storage, keys, what, str(snap.snapshot_id), deleted, field_ids)
        self._own = f"iceberg {table.metadata.table_uuid} snapshot {snap.snapshot_id}"

    @staticmethod
    def _positional_deletes(table: Any, tasks: list[Any], keys: list[str], what: str
                            ) -> dict[str, np.ndarray]:
        from pyiceberg.io.pyarrow import _read_deletes
        from pyiceberg.manifest import DataFileContent

        deleted: dict[str, np.ndarray] = {}
        for task, key in zip(tasks, keys, strict=True):
            positions = []
            for d in task.delete_files:
                if d.content != DataFileContent.POSITION_DELETES:
                    raise LakeError(f"{what}: delete file {d.file_path}: equality deletes are "
                                    "not read (pyiceberg does not read them either)")
                try:
                    found = _read_deletes(table.io, d)
                except Exception as e:
                    raise LakeError(f"{what}: delete file {d.file_path}: cannot read: "
                                    f"{type(e).__name__}: {e}", "DATA_LOSS") from None
                if task.file.file_path in found:
                    positions.append(found[task.file.file_path].to_numpy())
            if positions:
                deleted[key] = np.unique(np.concatenate(positions)).astype(np.int64)
        return deleted

    def fingerprint(self) -> str:
        return self._own
