"""The same dataset from local disk and from a loopback S3 endpoint, cold and with a warm cache.

    python benchmarks/storage.py                   # image-folder and tokens, 3 repeats
    python benchmarks/storage.py --quick           # smoke test, well under a minute
    python benchmarks/storage.py --json out.json

The S3 endpoint is moto's server mode in a separate process on 127.0.0.1, spoken to over
HTTP by boto3: a real S3 protocol endpoint, but one whose per-request latency is that of a
Python web server on this machine, not of a remote store. Per format and repeat, three runs
of one epoch each, every run with a freshly started `stoker serve` (2 workers):

- local: `source:` a local folder;
- s3 cold: `source: s3://...` with an empty disk cache: every object crosses HTTP once;
- s3 warm: the same cache folder, a new server (so the cache outlived a restart).

Reported per run: server start (ready line; for formats that memory-map whole files, such as
tokens, the download happens here, while the worker opens the dataset), the first batch, and
samples/s and bytes/s (payload bytes of the batches received) over the epoch; medians over
repeats. The ratio to local is the figure to read: S3 warm should be within 10% of local.
For scale, the endpoint's own limit is measured too: plain boto3 GETs of every object from 16
threads in this process, objects/s and bytes/s (the best a cold epoch could do).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import boto3
import botocore.config
import numpy as np
from _data import make_image_folder
from _measure import machine_info, run_scenario, scenario_parser, summarise

from stoker.client import RemoteLoader
from stoker.server import ServerProcess, write_config

BUCKET = "stoker-bench"
RUNS = ("local", "s3_cold", "s3_warm")
FULL = {"images": 1024, "token_files": 4, "tokens_per_file": 8 << 20, "repeats": 3}
QUICK = {"images": 128, "token_files": 2, "tokens_per_file": 1 << 20, "repeats": 1}
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
               "AWS_EC2_METADATA_DISABLED": "true"}


# -- the endpoint ----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def moto_endpoint() -> Any:
    """moto in server mode as a child process; yields its URL once it answers HTTP."""
    port = free_port()
    # moto logs every request: to a file, not a pipe nobody reads (a full pipe blocks it).
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(url, timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise RuntimeError(f"moto server did not start: {log.read()[-2000:]!r}"
                                       ) from None
                time.sleep(0.1)  # polling a readiness probe, bounded by the deadline
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def upload(endpoint: str, root: Path, prefix: str) -> int:
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    with contextlib.suppress(s3.exceptions.BucketAlreadyOwnedByYou):
        s3.create_bucket(Bucket=BUCKET)
    total = 0
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.name.startswith("."):
            s3.upload_file(str(path), BUCKET, f"{prefix}/{path.relative_to(root).as_posix()}")
            total += path.stat().st_size
    return total


def endpoint_limit(endpoint: str, prefix: str, threads: int = 16) -> dict[str, float]:
    """Objects/s and bytes/s that plain boto3 GETs of every object get from the endpoint, from
    `threads` threads in this process: what a cold read could reach at best."""
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                      config=botocore.config.Config(max_pool_connections=threads))
    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(
        Bucket=BUCKET, Prefix=f"{prefix}/") for o in page.get("Contents", ())]
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        nbytes = sum(pool.map(
            lambda k: len(s3.get_object(Bucket=BUCKET, Key=k)["Body"].read()), keys))
    wall = time.perf_counter() - t0
    return {"objects_per_s": len(keys) / wall, "bytes_per_s": nbytes / wall,
            "objects": len(keys), "threads": threads}


# -- the datasets ----------------------------------------------------------------------------
def make_tokens(root: Path, files: int, tokens: int) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        rng = np.random.default_rng(f)
        rng.integers(0, 50257, size=tokens, dtype=np.uint16).tofile(root / f"shard_{f:03d}.bin")


def datasets(data: Path, p: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """format name -> (folder, dataset block without `source`, source suffix, batch size)."""
    make_image_folder(data / "images", p["images"], classes=8, source_size=160)
    make_tokens(data / "tokens", p["token_files"], p["tokens_per_file"])
    return {
        "image-folder": {"dir": data / "images", "suffix": "", "batch_size": 32,
                         "block": {"format": "image-folder", "size": 128}},
        "tokens": {"dir": data / "tokens", "suffix": "/*.bin", "batch_size": 16,
                   "block": {"format": "tokens", "seq_len": 1024}},
    }


# -- one run ---------------------------------------------------------------------------------
def run_once(name: str, block: dict[str, Any], source: str, batch_size: int, workdir: Path,
             top: dict[str, Any], workers: int) -> dict[str, Any]:
    config = write_config(workdir / f"{name}.yaml", {**top, "datasets": {
        "d": {**block, "source": source}}})
    t0 = time.perf_counter()
    server = ServerProcess(config, workers=workers, env=CREDENTIALS).start()
    start_s = time.perf_counter() - t0
    try:
        with RemoteLoader(server.address, "d", batch_size=batch_size, output="numpy",
                          shuffle=True, timeout=300) as loader:
            t1 = time.perf_counter()
            it = iter(loader)
            first = next(it)
            t2 = time.perf_counter()
            samples = len(first["sample_index"])
            nbytes = sum(a.nbytes for a in first.values())
            for batch in it:
                samples += len(batch["sample_index"])
                nbytes += sum(a.nbytes for a in batch.values())
            t3 = time.perf_counter()
            batches = len(loader)
    finally:
        code = server.stop()
    return {"start_s": start_s, "first_batch_s": t2 - t1, "epoch_s": t3 - t1,
            "samples": samples, "batches": batches, "payload_bytes": nbytes,
            "samples_per_s": samples / (t3 - t1), "bytes_per_s": nbytes / (t3 - t1),
            "server_exit_code": code}


def run(args: argparse.Namespace) -> dict[str, Any]:
    p = dict(QUICK if args.quick else FULL)
    if args.repeats:
        p["repeats"] = args.repeats
    res: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "params": p,
                           "workers": args.workers, "check_problems": [],
                           "server_exit_code": 0, "formats": {},
                           "machine": machine_info(numpy=np.__version__,
                                                   boto3=boto3.__version__)}
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="stoker-bench-")))
        endpoint = stack.enter_context(moto_endpoint())
        os.environ.update(CREDENTIALS)
        for fmt, d in datasets(work / "data", p).items():
            if args.formats and fmt not in args.formats:
                continue
            stored = upload(endpoint, d["dir"], fmt)
            limit = endpoint_limit(endpoint, fmt)
            runs: dict[str, list[dict[str, Any]]] = {r: [] for r in RUNS}
            for rep in range(p["repeats"]):
                cache = work / f"cache-{fmt}-{rep}"
                top = {"s3": {"endpoint_url": endpoint, "region": "us-east-1"},
                       "cache": {"dir": str(cache), "max_bytes": 8 << 30}}
                sources = {"local": str(d["dir"]) + d["suffix"],
                           "s3_cold": f"s3://{BUCKET}/{fmt}{d['suffix']}",
                           "s3_warm": f"s3://{BUCKET}/{fmt}{d['suffix']}"}
                # Alternate which comes first; warm always follows cold (it needs its cache).
                order = ["local", "s3_cold", "s3_warm"] if rep % 2 == 0 else [
                    "s3_cold", "s3_warm", "local"]
                for r in order:
                    out = run_once(f"{fmt}-{r}-{rep}", d["block"], sources[r], d["batch_size"],
                                   work, top, args.workers)
                    runs[r].append(out)
                    if out["server_exit_code"] != 0:
                        res["server_exit_code"] = out["server_exit_code"]
                shutil.rmtree(cache, ignore_errors=True)
            res["formats"][fmt] = summarise_format(fmt, runs, stored, res["check_problems"])
            res["formats"][fmt]["endpoint_get_limit"] = limit
    return res


def summarise_format(fmt: str, runs: dict[str, list[dict[str, Any]]], stored: int,
                     problems: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"stored_bytes": stored, "runs": {}}
    for r, reps in runs.items():
        out["runs"][r] = {"repeats": reps, **{k: summarise([x[k] for x in reps]) for k in (
            "start_s", "first_batch_s", "samples_per_s", "bytes_per_s")}}
        counts = {(x["samples"], x["payload_bytes"]) for x in reps}
        if counts != {(runs["local"][0]["samples"], runs["local"][0]["payload_bytes"])}:
            problems.append(f"{fmt} {r}: samples/bytes per epoch {sorted(counts)} differ "
                            "from local's")
    local = out["runs"]["local"]["samples_per_s"]["median"]
    out["ratio_over_local"] = {r: out["runs"][r]["samples_per_s"]["median"] / local
                               for r in RUNS}
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = scenario_parser(__doc__)
    ap.add_argument("--repeats", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--formats", nargs="*", choices=["image-folder", "tokens"])
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return run_scenario(parse_args(argv), run)


if __name__ == "__main__":
    sys.exit(main())
