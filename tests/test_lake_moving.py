"""A lake table that moves under a running job, with two servers: the run starts on snapshot
S; appends, deletes and a schema change are committed; the run goes on, a server is killed
(and restarted: it now sees the new snapshot, and serves S by time travel), the run is
stopped and resumes from its state_dict. Every row of S is delivered exactly once, and no row
outside S, per the ledger; a new job sees the new snapshot. Then the refusals: a snapshot that
is gone, a server whose config pins another snapshot, a column the snapshot lacks."""

from __future__ import annotations

import datetime
import signal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from lake_tables import iceberg_catalog, load_catalog, rows

from stoker.client import RemoteLoader
from stoker.client._errors import RemoteError
from stoker.server import ServerProcess, write_config

from conftest import TOY_DATASETS, StartServer, server_env

pytest.importorskip("pyiceberg")
pytest.importorskip("deltalake")
pytest.importorskip("lance")

pytestmark = pytest.mark.timeout(300)
N = 40  # rows of snapshot S


class Table:
    """One table of each format: made with N rows (snapshot S), then moved."""

    def __init__(self, fmt: str, tmp: Path) -> None:
        self.fmt, self.tmp = fmt, tmp
        if fmt == "iceberg":
            self.cat = iceberg_catalog(tmp, f"file://{tmp}/wh")
            catalog = load_catalog(self.cat)
            catalog.create_namespace("ns")
            catalog.create_table("ns.events", schema=rows(0).schema).append(rows(N))
            self.config = {"format": "iceberg", "catalog": self.cat, "table": "ns.events"}
        elif fmt == "delta":
            from deltalake import write_deltalake

            write_deltalake(str(tmp / "t"), rows(N))
            self.config = {"format": "delta", "source": str(tmp / "t")}
        else:
            import lance

            lance.write_dataset(rows(N), str(tmp / "t.lance"))
            self.config = {"format": "lance", "source": str(tmp / "t.lance")}
        self.config["columns"] = ["id", "label"]
        self.first = self.snapshot()

    def snapshot(self) -> str:
        if self.fmt == "iceberg":
            return str(load_catalog(self.cat).load_table("ns.events")
                       .current_snapshot().snapshot_id)
        if self.fmt == "delta":
            from deltalake import DeltaTable

            return str(DeltaTable(str(self.tmp / "t")).version())
        import lance

        return str(lance.dataset(str(self.tmp / "t.lance")).version)

    def move(self) -> None:
        """Append 10 rows (ids N..N+9), delete ids < 5, add a column."""
        if self.fmt == "iceberg":
            from pyiceberg.types import LongType

            table = load_catalog(self.cat).load_table("ns.events")
            table.append(rows(10, N))
            table.delete("id < 5")
            with table.update_schema() as update:
                update.add_column("extra", LongType())
            table.append(rows(1, N + 10).append_column("extra", pa.array([1], pa.int64())))
        elif self.fmt == "delta":
            from deltalake import DeltaTable, write_deltalake

            uri = str(self.tmp / "t")
            write_deltalake(uri, rows(10, N), mode="append")
            DeltaTable(uri).delete("id < 5")
            write_deltalake(uri, rows(1, N + 10).append_column("extra", pa.array([1], pa.int64())),
                            mode="append", schema_mode="merge")
        else:
            import lance

            ds = lance.write_dataset(rows(10, N), str(self.tmp / "t.lance"), mode="append")
            ds.delete("id < 5")
            ds.add_columns({"extra": "id * 2"})

    def scan_ids(self) -> list[int]:
        """The library's own scan of the current snapshot: its ids, in order."""
        if self.fmt == "iceberg":
            table = load_catalog(self.cat).load_table("ns.events")
            return table.scan().to_arrow().column("id").to_pylist()
        if self.fmt == "delta":
            from deltalake import DeltaTable

            return pa.table(DeltaTable(str(self.tmp / "t")).to_pyarrow_table()).column(
                "id").to_pylist()
        import lance

        return lance.dataset(str(self.tmp / "t.lance")).to_table().column("id").to_pylist()


def loader(addresses: list[str]) -> RemoteLoader:
    return RemoteLoader(addresses, "t", batch_size=4, seed=3, shuffle=True, drop_last=False,
                        output="numpy", timeout=60)


def _server(tmp: Path, name: str, datasets: dict[str, Any]) -> ServerProcess:
    return ServerProcess(write_config(tmp / f"{name}.yaml", {"datasets": datasets}),
                         workers=1, env=server_env()).start()


@pytest.mark.parametrize("fmt", ["iceberg", "delta", "lance"])
def test_a_run_reads_its_snapshot_exactly_once_while_the_table_moves(
        fmt: str, tmp_path: Path, start_server: StartServer, ledger: Any) -> None:
    table = Table(fmt, tmp_path)
    b = start_server({"t": table.config})
    a = _server(tmp_path, "a", {"t": table.config})
    ids: list[int] = []
    try:
        run = loader([a.address, b.address])
        it = iter(run)
        for _ in range(3):
            ids += next(it)["id"].tolist()
        assert run.state_dict()["coordinates"]["snapshot"] == table.first
        table.move()
        assert table.snapshot() != table.first
        for _ in range(2):
            ids += next(it)["id"].tolist()
        a.stop(signal.SIGKILL)  # a server dies; its replacement sees the moved table
        a = _server(tmp_path, "a2", {"t": table.config})
        for _ in range(2):
            ids += next(it)["id"].tolist()
        state = run.state_dict()
        run.close()  # the run is stopped: it resumes from its state_dict alone
        assert state["coordinates"]["snapshot"] == table.first
        assert state["fingerprint"]["snapshot"] == table.first
        resumed = loader([a.address, b.address])
        resumed.load_state_dict(state)
        for batch in resumed:
            ids += batch["id"].tolist()
        resumed.close()
        lost, duplicated = ledger.compare(ids, list(range(N)))
        ledger.record("storage", f"format {fmt}: the table moved under a run (append, delete, "
                      "schema change), a server killed, the run resumed", tried=N, lost=lost,
                      duplicated=duplicated)
        assert (lost, duplicated) == (0, 0), sorted(ids)
        assert max(ids) < N  # no row outside S: the appended ones start at N
        # A new job takes the snapshot current now.
        with RemoteLoader([a.address, b.address], "t", batch_size=4, shuffle=False,
                          drop_last=False, output="numpy", timeout=60) as fresh:
            assert fresh.describe().fingerprint.snapshot == table.snapshot()
            new = [i for batch in fresh for i in batch["id"].tolist()]
        assert new == table.scan_ids() and min(new) == 5 and max(new) >= N + 9
    finally:
        a.stop()


def test_a_snapshot_that_is_gone_is_refused_naming_it(tmp_path: Path,
                                                     start_server: StartServer) -> None:
    import lance

    table = Table("lance", tmp_path)
    server = start_server({"t": table.config})
    with loader([server.address]) as run:
        next(iter(run))
        state = run.state_dict()
    table.move()
    ds = lance.dataset(str(tmp_path / "t.lance"))
    ds.cleanup_old_versions(older_than=datetime.timedelta(0), delete_unverified=True)
    # A server that has it open serves on; one that must open it now cannot.
    fresh = start_server({"t": table.config})
    with pytest.raises(RemoteError) as e:
        resumed = loader([fresh.address])
        resumed.load_state_dict(state)
        next(iter(resumed))
    assert f"version {table.first}" in str(e.value), e.value
    assert e.value.code.name == "NOT_FOUND", e.value


def test_a_server_pinned_to_another_snapshot_refuses_to_join(
        tmp_path: Path, start_server: StartServer) -> None:
    table = Table("iceberg", tmp_path)
    first = int(table.first)
    table.move()
    now = table.snapshot()
    pinned = start_server({"t": {**table.config, "snapshot_id": first}})
    moving = start_server({"t": table.config})
    with loader([moving.address]) as run:
        assert run.describe().fingerprint.snapshot == now
        state = run.state_dict()
    with pytest.raises(RemoteError) as e:
        resumed = loader([pinned.address])
        resumed.load_state_dict(state)
        next(iter(resumed))
    assert e.value.code.name == "FAILED_PRECONDITION", e.value
    assert f"snapshot {first}" in str(e.value) and f"snapshot {now}" in str(e.value), e.value
    # The pinned server serves its own snapshot, after the table moved: N rows.
    with loader([pinned.address]) as own:
        assert own.describe().fingerprint.snapshot == str(first)
        assert sorted(i for b in own for i in b["id"].tolist()) == list(range(N))


def test_bad_input_is_named_and_the_server_serves_the_rest(
        tmp_path: Path, start_server: StartServer) -> None:
    table = Table("delta", tmp_path)
    server = start_server({
        "t": table.config,
        "nocolumn": {**table.config, "columns": ["id", "nope"]},
        "noversion": {**table.config, "version": 99},
        "notable": {"format": "iceberg", "catalog": iceberg_catalog(tmp_path / "x",
                                                                    f"file://{tmp_path}/x"),
                    "table": "ns.none", "columns": ["id"]},
        "nocatalog": {"format": "iceberg", "catalog": {"type": "rest", "uri": "http://127.0.0.1:9"},
                      "table": "ns.t", "columns": ["id"]},
    })
    with pytest.raises(RemoteError) as e, RemoteLoader(
            server.address, "nocatalog", batch_size=4, timeout=8, output="numpy") as bad:
        bad.describe()  # UNAVAILABLE: asked again until the timeout (the catalog may come up)
    assert e.value.code.name == "UNAVAILABLE", e.value
    assert "iceberg table ns.t: catalog http://127.0.0.1:9 did not answer" in str(e.value)
    for name, code, words in [("nocolumn", "FAILED_PRECONDITION", ["'nope'", "version 0"]),
                              ("noversion", "NOT_FOUND", ["version 99"]),
                              ("notable", None, ["ns.none"])]:
        with pytest.raises(RemoteError) as e, RemoteLoader(
                server.address, name, batch_size=4, timeout=20, output="numpy") as bad:
            bad.describe()
        assert all(w in str(e.value) for w in words), (name, e.value)
        if code:
            assert e.value.code.name == code, (name, e.value)
    with loader([server.address]) as good:
        assert sorted(i for b in good for i in b["id"].tolist()) == list(range(N))
    # A data file corrupt: the table, its version and the file are named; the rest served.
    from deltalake import DeltaTable

    part = DeltaTable(str(tmp_path / "t")).file_uris()[0]
    Path(part).write_bytes(b"not parquet")
    fresh = start_server({"t": table.config, "toy": TOY_DATASETS["toy"]})
    with pytest.raises(RemoteError) as e, RemoteLoader(fresh.address, "t", batch_size=4,
                                                       timeout=20, output="numpy") as bad:
        bad.describe()
    assert e.value.code.name == "FAILED_PRECONDITION", e.value
    assert all(w in str(e.value) for w in (str(tmp_path / "t"), "version 0",
                                           Path(part).name)), e.value
    with RemoteLoader(fresh.address, "toy", batch_size=4, timeout=20, output="numpy") as toy:
        assert len(next(iter(toy))["sample_index"]) == 4
