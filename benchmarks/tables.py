"""Tables in lakes: the same rows as loose parquet, an Iceberg table, a Delta table and a Lance
dataset, served under a global shuffle and under `shuffle: block`, from local disk and from S3.

    python benchmarks/tables.py                 # full sizes, 3 repeats (about 10 min here)
    python benchmarks/tables.py --quick         # small sizes, 1 repeat (a couple of minutes)
    python -m benchmarks --only tables          # the same, into docs/benchmarks.md

Two row sets, each written once per format by that format's own writer (pyarrow's
write_table, pyiceberg's append, deltalake's write_deltalake, lance's write_dataset), with the
same row groups (`row_group` rows; Lance: rows per group and file alike):

- images: JPEG bytes (about 96x96, noisy gradients) and a label; served decoded and resized
  to 64x64 (decode: image, size 64);
- tokens: int32 token ids, `seq` per row, and a label; served as numbers.

Per (location, format, row set, shuffle): one server (2 workers) serves every format's
datasets; per dataset a first epoch (the snapshot opens: its first batch's seconds are
reported), then `repeats` epochs, batch 32, seed 0: samples/s after each one's first batch,
and CPU per sample: the server's process tree (front end and workers, from /proc) plus this
client process; medians over repeats. S3 is
moto's server on loopback (a Python web server, not a remote store): compare formats with
each other, not with local disk.

What a random row costs: parquet, Iceberg and Delta files are read a row group at a time (a
worker keeps one decoded), so a global shuffle decodes a row group per sample; `shuffle:
block` reads each row group once per window. Lance reads the rows themselves, a batch's in
one `take`.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _measure import machine_info, run_scenario, scenario_parser, settle

FULL = {"images": 1024, "tokens": 4096, "seq": 256, "repeats": 3, "row_group": 128}
QUICK = {"images": 512, "tokens": 2048, "seq": 128, "repeats": 1, "row_group": 64}
FORMATS = ("parquet", "iceberg", "delta", "lance")
SETS = ("images", "tokens")
SHUFFLES = ("global", "block")
BATCH = 32
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}


def rows(args: Any, scratch: Path) -> dict[str, Any]:
    """The two row sets as Arrow tables."""
    import numpy as np
    import pyarrow as pa
    from _data import make_image_folder

    make_image_folder(scratch / "jpegs", args.images, 10, 96)
    files = sorted((scratch / "jpegs").rglob("*.jpg"))
    images = pa.table({"image": pa.array([f.read_bytes() for f in files], pa.binary()),
                       "label": pa.array([int(f.parent.name[-3:]) for f in files], pa.int64())})
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 50_000, size=(args.tokens, args.seq), dtype=np.int32)
    tokens = pa.table({"ids": pa.FixedSizeListArray.from_arrays(pa.array(ids.ravel()), args.seq),
                       "label": pa.array(np.arange(args.tokens) % 7, pa.int64())})
    return {"images": images, "tokens": tokens}


def write_all(tables: dict[str, Any], root: str, scratch: Path, rg: int,
              endpoint: str | None) -> dict[str, dict[str, Any]]:
    """Every format's copy of every row set under `root`; name -> its dataset config (but
    fields and shuffle)."""
    import deltalake
    import lance
    import pyarrow.parquet as pq
    from pyiceberg.catalog.sql import SqlCatalog

    s3 = {"s3": {"endpoint_url": endpoint, "region": "us-east-1"}} if endpoint else {}
    props = ({"s3.endpoint": endpoint, "s3.region": "us-east-1",
              "s3.access-key-id": "bench", "s3.secret-access-key": "bench"} if endpoint else {})
    warehouse = f"{root}/wh" if endpoint else f"file://{root}/wh"
    catalog_uri = f"sqlite:///{scratch}/catalog-{abs(hash(root))}.db"
    catalog = SqlCatalog("default", uri=catalog_uri, warehouse=warehouse, **props)
    catalog.create_namespace("bench")
    delta_opts = ({"AWS_ENDPOINT_URL": endpoint, "AWS_ALLOW_HTTP": "true",
                   "AWS_REGION": "us-east-1", "AWS_S3_ALLOW_UNSAFE_RENAME": "true",
                   **CREDENTIALS} if endpoint else None)
    lance_opts = ({"aws_endpoint": endpoint, "aws_allow_http": "true", "aws_region": "us-east-1",
                   "aws_access_key_id": "bench", "aws_secret_access_key": "bench"}
                  if endpoint else None)
    out: dict[str, dict[str, Any]] = {}
    for name, table in tables.items():
        local = scratch / f"parquet-{name}.parquet"
        pq.write_table(table, local, row_group_size=rg)
        if endpoint:
            import boto3

            boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").upload_file(
                str(local), root.removeprefix("s3://").split("/")[0],
                "/".join([*root.removeprefix("s3://").split("/")[1:], "parquet", name,
                          "part-0.parquet"]).lstrip("/"))
        else:
            (Path(root) / "parquet" / name).mkdir(parents=True)
            os.replace(local, Path(root) / "parquet" / name / "part-0.parquet")
        out[f"parquet_{name}"] = {"format": "parquet", "source": f"{root}/parquet/{name}", **s3}
        ice = catalog.create_table(f"bench.{name}", schema=table.schema,
                                   properties={"write.parquet.row-group-limit": str(rg)})
        ice.append(table)
        out[f"iceberg_{name}"] = {"format": "iceberg", "table": f"bench.{name}", **s3,
                                  "catalog": {"uri": catalog_uri, "warehouse": warehouse,
                                              "properties": props}}
        deltalake.write_deltalake(f"{root}/delta/{name}", table, storage_options=delta_opts,
                                  writer_properties=deltalake.WriterProperties(
                                      max_row_group_size=rg))
        out[f"delta_{name}"] = {"format": "delta", "source": f"{root}/delta/{name}", **s3}
        lance.write_dataset(table, f"{root}/lance/{name}.lance", max_rows_per_group=rg,
                            storage_options=lance_opts)
        out[f"lance_{name}"] = {"format": "lance", "source": f"{root}/lance/{name}.lance", **s3}
    return out


def fields(name: str) -> dict[str, Any]:
    image = {"image": {"decode": "image", "size": 64}, "label": {}}
    tokens = {"ids": {}, "label": {}}
    kind = name.rsplit("_", 1)[1]
    if name.startswith("parquet"):
        return {"fields": image if kind == "images" else tokens}
    return {"columns": list(image if kind == "images" else tokens),
            "decode": {"image": {"decode": "image", "size": 64}} if kind == "images" else {}}


def epoch(address: str, dataset: str, server_pid: int, number: int) -> dict[str, float]:
    """Shuffled epoch `number` (each its own order: no batch is built twice): samples/s after
    the first batch, the first batch's seconds, CPU seconds per sample of the server's tree
    and this process."""
    from wire import proc_table, self_cpu, tree_cpu

    from stoker.client import RemoteLoader

    cpu0 = sum(tree_cpu(proc_table(), server_pid).values()) + self_cpu()
    t0 = time.perf_counter()
    n = first = 0
    with RemoteLoader(address, dataset, batch_size=BATCH, seed=0, shuffle=True,
                      drop_last=False, output="numpy", timeout=300) as loader:
        loader.set_epoch(number)
        t1 = t0
        for batch in loader:
            if not n:
                t1, first = time.perf_counter(), len(batch["label"])
            n += len(batch["label"])
    t2 = time.perf_counter()
    cpu = sum(tree_cpu(proc_table(), server_pid).values()) + self_cpu() - cpu0
    return {"samples": n, "first_batch_s": t1 - t0,
            "samples_per_s": (n - first) / max(t2 - t1, 1e-9), "cpu_ms_per_sample": 1e3 * cpu / n}


def run(args: Any) -> dict[str, Any]:
    settle(args, QUICK, FULL)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from storage import moto_endpoint

    from stoker.server import ServerProcess, write_config

    results: dict[str, Any] = {}
    problems: list[str] = []
    exit_code = 0
    with tempfile.TemporaryDirectory(prefix="stoker-tables-") as tmp, moto_endpoint() as url:
        scratch = Path(tmp)
        os.environ.update(CREDENTIALS)
        tables = rows(args, scratch)
        import boto3

        boto3.client("s3", endpoint_url=url, region_name="us-east-1").create_bucket(
            Bucket="tables")
        for where, root, endpoint in (("local", str(scratch / "local"), None),
                                      ("s3", "s3://tables/bench", url)):
            configs = write_all(tables, root, scratch, args.row_group, endpoint)
            datasets = {f"{name}_{sh}": {**cfg, **fields(name), "shuffle": sh}
                        for name, cfg in configs.items() for sh in SHUFFLES}
            env = {"PYTHONPATH": os.pathsep.join(sys.path), **CREDENTIALS}
            if endpoint:
                env["AWS_ENDPOINT_URL_S3"] = endpoint
            config = write_config(scratch / f"{where}.yaml",
                                  {"datasets": datasets,
                                   # every batch built, none served from another job's
                                   "cache": {"dir": str(scratch / f"cache-{where}"),
                                             "shared_batches": 0}})
            with ServerProcess(config, workers=2, env=env) as server:
                assert server.proc is not None
                for name in datasets:
                    # The first epoch opens the snapshot (in each worker: a library's import
                    # and the table's metadata): its first batch is reported, its rate not.
                    cold = epoch(server.address, name, server.proc.pid, 0)
                    runs = [epoch(server.address, name, server.proc.pid, r + 1)
                            for r in range(args.repeats)]
                    n = len(tables[name.split("_")[1]])
                    if any(r["samples"] != n for r in runs):
                        problems.append(f"{where} {name}: {[r['samples'] for r in runs]} "
                                        f"samples, expected {n}")
                    fmt, kind, sh = name.split("_")
                    results.setdefault(where, {}).setdefault(fmt, {}).setdefault(kind, {})[sh] = {
                        **{k: statistics.median(r[k] for r in runs)
                           for k in ("samples_per_s", "cpu_ms_per_sample")},
                        "first_batch_s": cold["first_batch_s"]}
            exit_code = exit_code or (server.proc.returncode or 0)
    import deltalake
    import lance
    import pyiceberg

    return {"parameters": {**{k: getattr(args, k) for k in FULL}, "quick": args.quick,
                           "batch": BATCH},
            "machine": machine_info(pyiceberg=pyiceberg.__version__,
                                    deltalake=deltalake.__version__, lance=lance.__version__),
            "results": results, "check_problems": problems, "server_exit_code": exit_code}


def section(r: dict[str, Any], plots: Any = None) -> list[str]:
    """The benchmark page's section (benchmarks/report.py)."""
    p = r["parameters"]
    lines = [f"{p['images']} image rows (JPEG bytes + label, decoded and resized to 64x64) and "
             f"{p['tokens']} token rows ({p['seq']} int32 ids + label), each as loose parquet, "
             "an Iceberg table, a Delta table and a Lance dataset written by its own library, "
             f"row groups of {p['row_group']} rows; one server, 2 workers, batch {p['batch']}, "
             "a first epoch (the snapshot opens: its first batch is the last column), then "
             f"{p['repeats']} more: samples/s after the first batch, and CPU ms per sample of "
             "the server tree and the client (medians). Wall-clock rates at these sizes swing "
             "with the machine's other load; CPU per sample is the steadier figure. A random "
             "row costs a row group's read and "
             "decode for parquet, Iceberg and Delta under `shuffle: global` (a worker keeps "
             "one row group decoded), once per row group under `shuffle: block`; Lance reads "
             "the rows themselves, a batch's in one `take`.", ""]
    for where, by_format in r["results"].items():
        lines += [f"**{where}**", "",
                  "| format | rows | global samples/s | block samples/s | global CPU ms | "
                  "block CPU ms | first batch s |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for fmt, kinds in by_format.items():
            for kind, s in kinds.items():
                g, b = s.get("global", {}), s.get("block", {})
                lines.append(f"| {fmt} | {kind} | {g.get('samples_per_s', 0):.0f} | "
                             f"{b.get('samples_per_s', 0):.0f} | "
                             f"{g.get('cpu_ms_per_sample', 0):.2f} | "
                             f"{b.get('cpu_ms_per_sample', 0):.2f} | "
                             f"{g.get('first_batch_s', 0):.2f} |")
        lance_g = by_format.get("lance", {})
        parq_b = by_format.get("parquet", {})
        for kind in SETS:
            if kind in lance_g and kind in parq_b:
                lg, pb = lance_g[kind]["global"], parq_b[kind]["block"]
                ratio = lg["samples_per_s"] / max(pb["samples_per_s"], 1e-9)
                lines.append(f"\n{where}, {kind}: Lance under a global shuffle: "
                             f"{lg['samples_per_s']:.0f} samples/s and "
                             f"{lg['cpu_ms_per_sample']:.2f} ms CPU a sample; parquet under "
                             f"`shuffle: block` on the same rows: {pb['samples_per_s']:.0f} "
                             f"and {pb['cpu_ms_per_sample']:.2f} ({ratio:.2f}x the samples/s).")
        lines.append("")
    return lines


if __name__ == "__main__":
    ap = scenario_parser(__doc__)
    for k in FULL:
        ap.add_argument(f"--{k.replace('_', '-')}", dest=k, type=int, default=None)
    sys.exit(run_scenario(ap.parse_args(), run))
