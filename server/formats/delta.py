"""`format: delta`: a Delta Lake table at one version, through deltalake (delta-rs; the
`lake` extra).

delta-rs reads the log at the config's `version` (or `as_of`, or the latest) and lists its
add actions: the data files, in its order, read by format parquet's reader through the
server's storage (s3:// through its disk cache). delta-rs does not give stoker the rows a
deletion vector removes, nor the physical names under column mapping: a table that uses
either refuses to open, naming the feature, rather than serve rows the table has deleted.
"""

from __future__ import annotations

from typing import Any

from ._lake import (
    Access,
    Files,
    LakeError,
    check_columns,
    library,
    object_store_options,
    pinned_gone,
)

# Reader features whose tables read right without anything of stoker's own.
PLAIN = {"timestampNtz", "vacuumProtocolCheck", "v2Checkpoint", "typeWidening",
         "checkpointProtection"}


def _open(cfg: Any, s3: Any) -> Any:
    deltalake = library(cfg, "deltalake")
    opts = object_store_options(s3, upper=True) if cfg.source.startswith("s3://") else None
    pin = f"version {cfg.version}" if cfg.version is not None else (
        f"as_of {cfg.as_of.isoformat()}" if cfg.as_of is not None else "latest version")
    try:
        table = deltalake.DeltaTable(cfg.source, version=cfg.version, storage_options=opts)
        if cfg.as_of is not None:
            table.load_as_version(cfg.as_of)
    except Exception as e:
        gone = pinned_gone(lambda: deltalake.DeltaTable(cfg.source, storage_options=opts),
                           cfg.version is not None or cfg.as_of is not None)
        raise LakeError(f"delta table {cfg.source} {pin}: cannot open"
                        f"{' (removed by vacuum, or never made)' if gone else ''}: "
                        f"{type(e).__name__}: {e}", "NOT_FOUND" if gone else "UNAVAILABLE"
                        ) from None
    return table


def current(cfg: Any, s3: Any) -> str:
    """The version the config's pin, else the table's latest, resolves to."""
    return str(_open(cfg, s3).version())


class Delta(Files):
    def __init__(self, cfg: Any, access: Access) -> None:
        import pyarrow as pa

        table = _open(cfg, access.s3)
        version = table.version()
        what = f"delta table {cfg.source} version {version}"
        protocol = table.protocol()
        features = set(protocol.reader_features or ())
        mapping = table.metadata().configuration.get("delta.columnMapping.mode", "none")
        if mapping != "none" or "columnMapping" in features:
            raise LakeError(f"{what}: uses column mapping (mode {mapping}), which delta-rs does "
                            "not map for stoker's reader; the table is refused")
        adds = pa.table(table.get_add_actions(flatten=True))
        dv = [c for c in adds.column_names if c.startswith("deletionVector")]
        if dv and any(adds.column(c).null_count < len(adds) for c in dv):
            raise LakeError(f"{what}: deletion vectors in use, which delta-rs does not expose to "
                            "stoker's reader: the table is refused rather than serve deleted "
                            "rows (purge them: OPTIMIZE ... or REORG TABLE ... APPLY (PURGE))")
        unknown = features - PLAIN - {"deletionVectors"}
        if unknown:
            raise LakeError(f"{what}: reader feature(s) {sorted(unknown)} not read by stoker")
        check_columns(cfg, list(table.schema().to_arrow().names), what)
        keys = [str(p) for p in adds.column("path").to_pylist()]
        if not keys:
            raise LakeError(f"{what}: no data files")
        from urllib.parse import unquote

        storage = access.open_storage(cfg.source.rstrip("/"))
        super().__init__(cfg, storage, [unquote(k) for k in keys], what, str(version))
        self._own = f"delta {table.metadata().id} version {version}"

    def fingerprint(self) -> str:
        return self._own
