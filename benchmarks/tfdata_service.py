"""tf.data service against stoker: the same image pipeline from the same TFRecord files, W
workers each, on the same cores; and plain tf.data in the trainer process.

    python benchmarks/tfdata_service.py            # 1024 photos 500x375, W = 1..cores, 3 repeats
    python benchmarks/tfdata_service.py --quick    # 256 JPEGs, 1 repeat
    python benchmarks/tfdata_service.py --json out.json

Data: real photographs as 500x375 JPEGs, q90 (benchmarks/_data.py: views of the sample
photos scikit-image, scikit-learn and matplotlib ship), and a large set (--large: 1600x1200
and 2048x1536 mosaics of the same sources, measured at the smallest W), each written as
`tf.train.Example`s (`image/encoded`, `image/class/label`) into 8 TFRecord files.
Pipeline: random resized crop 224 (area 0.08-1, ratio 3/4-4/3) -> horizontal flip -> uint8
HWC, batches of 32. Systems, alternating within each repeat, medians over repeats:

- stoker: a server with W worker processes, `format: tfrecord` with those `transforms:`,
  read by one RemoteLoader (numpy), batches through --transport (default: the data socket,
  the path between machines, as tf.data service's batches travel over gRPC);
- tf.data service: a dispatcher and W worker processes on loopback, the pipeline written the
  TensorFlow way (benchmarks/tfdata_peer.py), one thread each (`private_threadpool_size=1`:
  a core's worth, like a stoker worker), `processing_mode="parallel_epochs"`, one consumer;
- tf.data: the same pipeline in the consumer process itself, on W threads.

Measured over each pass after its first batch: images/s, and CPU per image on the serving
side (stoker's server and workers; the dispatcher and tf.data workers) and on the trainer
side (RemoteLoader's process; the consumer). TensorFlow runs from its own venv
(--tf-python, default .venv-tf/bin/python: `make install-tf`); without it the scenario writes
its JSON saying so and measures stoker alone.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
from _data import TRANSPORTS, make_large_photos, make_photo_folder, transport_ran
from _measure import (
    machine_busy_seconds,
    machine_info,
    run_scenario,
    scenario_parser,
    settle,
    summarise,
)
from loader_vs_dataloader import cpu_snapshot

from stoker.client import RemoteLoader
from stoker.server import ServerProcess, write_config
from stoker.server.formats._example import messages
from stoker.server.formats.tfrecord import masked_crc

HERE = Path(__file__).resolve().parent
FULL = {"images": 1024, "repeats": 3}
QUICK = {"images": 256, "repeats": 1}
SYSTEMS = ("stoker", "tf_service", "tf_local")
LABELS = {"stoker": "stoker, W worker processes",
          "tf_service": "tf.data service, W workers (parallel_epochs)",
          "tf_local": "tf.data in the trainer, W threads"}
TRANSFORMS = [{"random_resized_crop": {"size": 224}}, {"horizontal_flip": {"p": 0.5}}]
SHARDS = 8


def write_tfrecords(images: Path, out: Path, shards: int = SHARDS) -> int:
    """The JPEG folder as Examples in `shards` TFRecord files; the number of records."""
    example = messages()["Example"]
    files = sorted(images.glob("class_*/*.jpg"))
    out.mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        with open(out / f"train.tfrecord-{s:05d}-of-{shards:05d}", "wb") as f:
            for path in files[s::shards]:
                ex = example()
                entry = ex.features.feature.add(key="image/encoded")
                entry.value.bytes_list.value.append(path.read_bytes())
                entry = ex.features.feature.add(key="image/class/label")
                entry.value.int64_list.value.append(int(path.parent.name.split("_")[1]))
                data = ex.SerializeToString()
                length = len(data).to_bytes(8, "little")
                f.write(length + masked_crc(length).to_bytes(4, "little") + data
                        + masked_crc(data).to_bytes(4, "little"))
    return len(files)


def cpu_delta(before: dict[int, tuple[int, float]], after: dict[int, tuple[int, float]],
              pids: set[int], descendants: bool = True) -> float:
    """CPU seconds the processes `pids` (and their descendants) spent between snapshots."""
    total = 0.0
    for pid, (_, cpu) in after.items():
        p, seen = pid, 0
        while descendants and p in after and p not in pids and seen < 64:
            p, seen = after[p][0], seen + 1
        if p in pids:
            total += cpu - before.get(pid, (0, 0.0))[1]
    return total


def measure(window: dict[str, Any], trainer: set[int], servers: set[int], batch: int
            ) -> dict[str, Any]:
    """One pass's figures from the snapshots at its timed window's ends."""
    b, a = window["before"], window["after"]
    n, s = window["images"], window["seconds"]
    trainer_cpu = cpu_delta(b, a, trainer, descendants=False)  # the process alone
    server_cpu = cpu_delta(b, a, servers)
    busy = window["busy"]
    # This run's other processes (the idle systems' servers and consumers) over the window:
    # they must be near 0, or they took cores from the system being measured.
    ours = cpu_delta(b, a, {os.getpid()})
    bystanders = ours - server_cpu - trainer_cpu
    return {"images": n, "seconds": s, "images_per_s": n / s,
            "bystanders_cores_busy": bystanders / s,
            "server_cpu_ms_per_image": 1000 * server_cpu / n,
            "trainer_cpu_ms_per_image": 1000 * trainer_cpu / n,
            "other_cores_busy": max(busy - ours, 0.0) / s,
            "batch_size": batch}


class TfPeer:
    """The TensorFlow side: a consumer process, and for the service a dispatcher and W
    workers. Processes it started, ended by close()."""

    def __init__(self, python: Path, files: str, batch_size: int, batches: int, w: int,
                 service: bool) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        self.servers: set[int] = set()
        script = str(HERE / "tfdata_peer.py")
        address = None
        if service:
            dispatcher = self._start([str(python), script, "dispatcher"])
            address = self._ready(dispatcher)
            for _ in range(w):
                self._ready(self._start([str(python), script, "worker", "--dispatcher",
                                         address]))
            self.servers = {p.pid for p in self.procs}
        cmd = [str(python), script, "consume", "--files", files, "--batch-size",
               str(batch_size), "--batches", str(batches), "--threads",
               "1" if service else str(w)]
        if address:
            cmd += ["--service", address]
        self.consumer = self._start(cmd, stdin=True)

    def _start(self, cmd: list[str], stdin: bool = False) -> subprocess.Popen[str]:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, text=True, bufsize=1)
        self.procs.append(proc)
        return proc

    @staticmethod
    def _ready(proc: subprocess.Popen[str]) -> str:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("READY"):
            raise RuntimeError(f"tf.data peer did not start (exit {proc.poll()}): {line!r}")
        return line.split()[1]

    def epoch(self, seed: int) -> dict[str, Any]:
        proc = self.consumer
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(f"epoch {seed}\n")
        proc.stdin.flush()
        window: dict[str, Any] = {}
        for line in proc.stdout:
            if line.startswith("timing"):
                window["before"], busy = cpu_snapshot(), machine_busy_seconds()
            elif line.startswith("done"):
                window["after"] = cpu_snapshot()
                window["busy"] = machine_busy_seconds() - busy
                window.update(json.loads(line[5:]))
                return window
        raise RuntimeError(f"tf.data consumer ended (exit {proc.wait()})")

    def close(self) -> None:
        if self.consumer.stdin is not None and self.consumer.poll() is None:
            self.consumer.stdin.write("quit\n")
            self.consumer.stdin.close()
        for proc in reversed(self.procs):
            if proc is not self.consumer:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def stoker_epoch(loader: RemoteLoader, epoch: int) -> dict[str, Any]:
    loader.set_epoch(epoch)
    it = iter(loader)
    first = next(it)
    before, busy = cpu_snapshot(), machine_busy_seconds()
    t0 = time.perf_counter()
    n = 0
    for batch in it:
        n += len(batch["image"])
    seconds = time.perf_counter() - t0
    return {"before": before, "after": cpu_snapshot(), "busy": machine_busy_seconds() - busy,
            "images": n, "seconds": seconds, "shape": list(first["image"].shape),
            "dtype": str(first["image"].dtype)}


def measure_w(args: argparse.Namespace, records: Path, tmp: Path, w: int) -> dict[str, Any]:
    config = write_config(tmp / f"config-w{w}.yaml", {
        "cache": {"dir": str(tmp / "cache")},
        "datasets": {"imgs": {"format": "tfrecord", "source": str(records), "features": {
            "label": {"kind": "int64", "key": "image/class/label"},
            "image": {"kind": "bytes", "key": "image/encoded", "decode": "image",
                      "layout": "hwc", "transforms": TRANSFORMS}}}}})
    batches = args.images // args.batch_size
    problems: list[str] = []
    runs: dict[str, list[dict[str, Any]]] = {}
    with ExitStack() as stack:
        server = ServerProcess(config, workers=w).start()

        def stop() -> None:
            if (code := server.stop()) != 0:
                problems.append(f"W={w}: server exit code {code}: {server.stderr[-2000:]}")

        stack.callback(stop)
        loader = stack.enter_context(RemoteLoader(
            server.address, "imgs", batch_size=args.batch_size, seed=args.seed, shuffle=True,
            drop_last=True, output="numpy", prefetch=args.prefetch,
            prefetch_next_epoch=False, **TRANSPORTS[args.transport]))
        systems: dict[str, Any] = {"stoker": (lambda r: stoker_epoch(loader, r),
                                              {os.getpid()}, {server.proc.pid})}
        if args.tf_python_ok:
            files = str(records / "train.tfrecord-*")
            for name, service in (("tf_service", True), ("tf_local", False)):
                peer = TfPeer(args.tf_python, files, args.batch_size, batches, w, service)
                stack.callback(peer.close)
                systems[name] = (peer.epoch, {peer.consumer.pid}, peer.servers)
        names = list(systems)
        for r in range(-1, args.repeats):  # -1: a warm-up pass of each, not counted
            for name in names if r % 2 == 0 else names[::-1]:
                run, trainer, servers = systems[name]
                window = run(r + 1)
                if window["shape"][1:] != [224, 224, 3] or window["dtype"] != "uint8":
                    problems.append(f"{name}: batch image {window['dtype']}{window['shape']}")
                if r < 0:
                    continue
                m = measure(window, trainer, servers, args.batch_size)
                runs.setdefault(name, []).append(m)
                if not args.json_only:
                    print(f"  W={w} repeat {r} {LABELS[name]:<45} {m['images_per_s']:7.1f} "
                          f"images/s  server {m['server_cpu_ms_per_image']:5.1f}  trainer "
                          f"{m['trainer_cpu_ms_per_image']:5.1f} CPU ms/image, idle peers "
                          f"{m['bystanders_cores_busy']:.2f} cores", flush=True)
        ran = transport_ran(args.transport, {"stoker": loader}, problems)
    out: dict[str, Any] = {"workers": w, "problems": problems, "transport_ran": ran}
    for name, rs in runs.items():
        out[name] = {"repeats": rs, **{k: summarise([m[k] for m in rs]) for k in (
            "images_per_s", "server_cpu_ms_per_image", "trainer_cpu_ms_per_image",
            "other_cores_busy", "bystanders_cores_busy")}}
    stoker = out["stoker"]["images_per_s"]["median"]
    out["stoker_over"] = {n: stoker / out[n]["images_per_s"]["median"]
                          for n in runs if n != "stoker"}
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    args.tf_python = Path(args.tf_python)
    args.tf_python_ok = args.tf_python.exists()
    tf_version = "not installed"
    if args.tf_python_ok:
        tf_version = subprocess.run(
            [str(args.tf_python), "-c", "import tensorflow as tf; print(tf.__version__)"],
            capture_output=True, text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
            timeout=300).stdout.strip() or "failed to import"
        args.tf_python_ok = tf_version[0].isdigit()
    res: dict[str, Any] = {
        "benchmark": "tfdata", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(numpy=np.__version__, tensorflow=tf_version),
        "parameters": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "transforms": TRANSFORMS}
    if not args.tf_python_ok:
        res["skipped_peers"] = (f"TensorFlow not usable at {args.tf_python} ({tf_version}): "
                                "make install-tf")
        print(res["skipped_peers"], file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="stoker-tfdata-") as scratch:
        tmp = Path(scratch)
        make_photo_folder(tmp / "images", args.images)
        n = write_tfrecords(tmp / "images", tmp / "records")
        jpegs = list((tmp / "images").glob("class_*/*.jpg"))
        res["data"] = {"images": n, "files": SHARDS,
                       "mean_jpeg_bytes": sum(p.stat().st_size for p in jpegs) / len(jpegs)}
        res["sweep"] = [measure_w(args, tmp / "records", tmp, w) for w in args.workers]
        if args.large:  # the large set, one worker (thread) each: CPU per image
            make_large_photos(tmp / "large", args.large)
            n = write_tfrecords(tmp / "large", tmp / "large-records")
            jpegs = list((tmp / "large").glob("class_*/*.jpg"))
            res["large"] = {"data": {"images": n, "files": SHARDS, "megapixels": "1.92, 3.15",
                                     "mean_jpeg_bytes": sum(p.stat().st_size for p in jpegs)
                                     / len(jpegs)},
                            "sweep": [measure_w(argparse.Namespace(**{**vars(args), "images": n}),
                                                tmp / "large-records", tmp / "large",
                                                min(args.workers))]}
    res["check_problems"] = [p for s in res["sweep"] + res.get("large", {}).get("sweep", [])
                             for p in s["problems"]]
    res["server_exit_code"] = 0  # each W's is checked into check_problems
    return res


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    cores = len(os.sched_getaffinity(0))
    ap = scenario_parser(__doc__)
    ap.add_argument("--images", type=int)
    ap.add_argument("--large", type=int, help="JPEGs in the large set (0: none; default a "
                    "quarter of --images, at least 2 batches)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--workers", type=int, nargs="+", default=list(range(1, cores + 1)))
    ap.add_argument("--prefetch", type=int, default=8, help="RemoteLoader batches in flight")
    ap.add_argument("--transport", choices=sorted(TRANSPORTS), default="socket")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tf-python", default=str(HERE.parent / ".venv-tf" / "bin" / "python"))
    args = ap.parse_args(argv)
    settle(args, QUICK, FULL)
    if args.large is None:
        args.large = max(args.images // 4, 2 * args.batch_size)
    if min(args.workers) < 1:
        ap.error("--workers values must be >= 1")
    if args.images // args.batch_size < 2:
        ap.error("need at least 2 batches per pass (one warm-up, one timed)")
    return args


def main(argv: list[str] | None = None) -> int:
    return run_scenario(parse_args(argv), run)


if __name__ == "__main__":
    sys.exit(main())
