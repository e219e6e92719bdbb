"""RemoteLoader against torch DataLoader on the same image-folder pipeline, on this machine.

    python benchmarks/loader_vs_dataloader.py                 # ~1024 images, 3 repeats
    python benchmarks/loader_vs_dataloader.py --quick         # smoke test, well under a minute
    python benchmarks/loader_vs_dataloader.py --json out.json

Both sides run the exact dataset class the server runs (stoker.server.formats.image_folder:
JPEG decode -> RGB -> bilinear resize -> uint8 CHW) with the same worker count W: a
DataLoader with num_workers=W, and a stoker server started with W worker processes.

What this measures: pipeline efficiency on one machine. The server, its workers, the
DataLoader workers and the "trainer" all share the same cores, so the offload benefit of
stoker (decode on other machines) cannot show here; a ratio near 1 is the goal.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import PIL
import torch
from _data import make_image_folder
from _measure import machine_busy_seconds, machine_info, summarise, write_results
from torch.utils.data import DataLoader

from stoker.client import RemoteLoader
from stoker.server import ServerProcess, write_config
from stoker.server.formats.image_folder import ImageFolder
from stoker.server.formats.image_folder_config import ImageFolderDataset
from stoker.server.sources.local import LocalStorage

DATASET = "imgs"
SYSTEMS = ("dataloader", "stoker")
LABELS = {"dataloader": "torch DataLoader", "stoker": "stoker RemoteLoader"}
MARKER = "stoker-bench.json"  # in a --data-dir: the parameters its images were made with

# Cores kept busy by processes outside this run above which the output warns of noise.
OTHER_LOAD_WARN = 0.2

FULL = {"images": 1024, "size": 224, "source_size": 256, "batch_size": 32, "repeats": 3}
QUICK = {"images": 384, "size": 160, "source_size": 192, "batch_size": 16, "repeats": 2}


# -- data ------------------------------------------------------------------------------------
def prepare_data(data_dir: Path, images: int, classes: int, source_size: int) -> float:
    """Make the dataset in `data_dir` unless the marker says it is already there.

    Returns the seconds spent generating (0.0 when reused).
    """
    wanted = {"images": images, "classes": classes, "source_size": source_size, "seed": 0}
    marker = data_dir / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == wanted:
        return 0.0
    if data_dir.exists() and any(data_dir.iterdir()) and not marker.is_file():
        # Never write into (or count as ours) a folder this script did not make.
        raise SystemExit(f"--data-dir {data_dir} is not empty and has no {MARKER}")
    for old in data_dir.glob("class_*/*.jpg"):
        old.unlink()
    t0 = time.perf_counter()
    make_image_folder(data_dir, images, classes, source_size)
    marker.write_text(json.dumps(wanted))
    return time.perf_counter() - t0


# -- timing ----------------------------------------------------------------------------------
def cpu_snapshot() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, user+system CPU seconds so far) for this process and all its live
    descendants.

    One rule covers both systems: DataLoader workers are our children, and so are the stoker
    server and its workers; the idle side's processes cost ~0 while the other side runs.
    Linux /proc only (empty elsewhere); resolution is one clock tick (10 ms).
    """
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}
    try:
        entries = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        return {}
    for name in entries:
        try:
            with open(f"/proc/{name}/stat") as f:
                # comm (field 2) may hold spaces and parentheses: split after the last ')'.
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue  # exited while we looked
        stats[int(name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    tree, todo = {}, [os.getpid()]
    while todo:
        pid = todo.pop()
        if pid in stats:
            tree[pid] = stats[pid]
        todo += children.get(pid, [])
    return tree


def cpu_by_role(before: dict[int, tuple[int, float]], after: dict[int, tuple[int, float]],
                server_pid: int) -> dict[str, float]:
    """CPU seconds spent between two snapshots, by role.

    trainer: this process (DataLoader main loop, or RemoteLoader and its receive thread);
    server front end: the `stoker serve` process (gRPC, framing); server workers: its
    children; loader workers: our other children (DataLoader workers).
    """
    roles = dict.fromkeys(ROLES, 0.0)
    me = os.getpid()
    for pid, (ppid, cpu) in after.items():
        delta = cpu - before.get(pid, (ppid, 0.0))[1]
        if pid == me:
            role = "trainer"
        elif pid == server_pid:
            role = "server front end"
        elif ppid == server_pid or _descends(pid, server_pid, after):
            role = "server workers"
        else:
            role = "loader workers"
        roles[role] += delta
    return roles


def _descends(pid: int, ancestor: int, tree: dict[int, tuple[int, float]]) -> bool:
    while pid in tree:
        pid = tree[pid][0]
        if pid == ancestor:
            return True
    return False


ROLES = ("trainer", "loader workers", "server front end", "server workers")




def time_epoch(batches: Iterable[dict[str, Any]], server_pid: int) -> dict[str, Any]:
    """Run one epoch; the first batch is the warm-up and is timed separately.

    The loop body only reads the shape: the consumer must cost nothing, or it would eat the
    same cores the pipelines need.
    """
    t0 = time.perf_counter()
    it: Iterator[dict[str, Any]] = iter(batches)
    first = next(it)
    c1, busy1 = cpu_snapshot(), machine_busy_seconds()
    t1 = time.perf_counter()
    n = 0
    for batch in it:
        _ = batch["image"].shape
        n += 1
    t2 = time.perf_counter()
    busy = machine_busy_seconds() - busy1
    roles = cpu_by_role(c1, cpu_snapshot(), server_pid)
    cpu_s = sum(roles.values())
    epoch_s = t2 - t1
    # Whatever the machine did beyond our process tree: other tenants, the measure of noise.
    other = max(busy - cpu_s, 0.0) / epoch_s if epoch_s > 0 else float("nan")
    return {"first_batch_s": t1 - t0, "timed_batches": n, "epoch_s": epoch_s,
            "batches_per_s": n / epoch_s if epoch_s > 0 else float("nan"),
            "cpu_s": cpu_s, "cpu_ms_per_batch": 1000 * cpu_s / n,
            "cpu_ms_per_batch_by_role": {k: 1000 * v / n for k, v in roles.items()},
            "cores_busy": cpu_s / epoch_s if epoch_s > 0 else float("nan"),
            "other_cores_busy": other, "first": first}




def check_first_batches(first: dict[str, dict[str, Any]], ds: ImageFolder,
                        batch_size: int) -> list[str]:
    """Both systems delivered the same kind of batch, and stoker's pixels are the dataset's.

    Runs after the timed epochs (it decodes images itself, on the same cores).
    """
    problems = []
    dl, st = first["dataloader"], first["stoker"]
    for key in ("image", "label"):
        if tuple(dl[key].shape) != tuple(st[key].shape) or dl[key].dtype != st[key].dtype:
            problems.append(f"{key}: DataLoader {dl[key].dtype}{list(dl[key].shape)} != "
                            f"stoker {st[key].dtype}{list(st[key].shape)}")
    if st["image"].shape[0] != batch_size:
        problems.append(f"stoker batch has {st['image'].shape[0]} samples, wanted {batch_size}")
    for j in (0, batch_size - 1):
        idx = int(st["sample_index"][j])
        want = ds[idx]
        if not np.array_equal(st["image"][j].numpy(), want["image"]):
            problems.append(f"stoker image for sample {idx} differs from ImageFolder[{idx}]")
        if int(st["label"][j]) != int(want["label"]):
            problems.append(f"stoker label for sample {idx} differs from ImageFolder[{idx}]")
    return problems




# -- the run ---------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"benchmark": "loader_vs_dataloader",
                               "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                               "machine": machine_info(
                                   torch=torch.__version__, numpy=np.__version__,
                                   pillow=PIL.__version__),
                               "parameters": dict(vars(args))}
    with ExitStack() as stack:
        if args.data_dir is None:
            data_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(
                prefix="stoker-bench-")))
        else:
            data_dir = Path(args.data_dir).resolve()
            data_dir.mkdir(parents=True, exist_ok=True)
        results["data_generation_s"] = prepare_data(data_dir, args.images, args.classes,
                                                     args.source_size)
        jpeg_bytes = sum(p.stat().st_size for p in data_dir.glob("class_*/*.jpg"))
        results["data"] = {"dir": str(data_dir), "jpeg_bytes": jpeg_bytes,
                           "mean_jpeg_bytes": jpeg_bytes / args.images}
        size = (args.size, args.size)
        ds = ImageFolder(ImageFolderDataset(format="image-folder", source=str(data_dir),
                                            size=size, layout="chw"), LocalStorage(data_dir))

        config = write_config(Path(stack.enter_context(tempfile.TemporaryDirectory(
            prefix="stoker-bench-cfg-"))) / "config.yaml", {
            "datasets": {DATASET: {"format": "image-folder", "source": str(data_dir),
                                   "size": args.size, "layout": "chw"}}})
        # Started once, outside every timed region: spawning W workers that import numpy and
        # PIL takes seconds that a long-running server pays once, not per epoch.
        t0 = time.perf_counter()
        server = ServerProcess(config, workers=args.workers).start()
        results["server_start_s"] = time.perf_counter() - t0
        loaders: dict[str, Any] = {}
        try:
            g = torch.Generator()
            g.manual_seed(args.seed)
            # persistent_workers: workers outlive an epoch, as in a real training loop.
            dataloader = DataLoader(ds, batch_size=args.batch_size, shuffle=True,
                                    drop_last=True, num_workers=args.workers,
                                    persistent_workers=args.workers > 0, generator=g)
            # Its workers are forked here, before the RemoteLoader's gRPC threads exist: a
            # fork while gRPC's threads run skips gRPC's fork handlers and a worker can die
            # of SIGSEGV (seen in CI). Outside every timed region, like the server's start.
            if args.workers > 0:
                iter(dataloader)
            loaders = {
                "dataloader": dataloader,
                "stoker": RemoteLoader(
                    server.address, DATASET, batch_size=args.batch_size, seed=args.seed,
                    shuffle=True, drop_last=True, prefetch=args.prefetch,
                    prefetch_next_epoch=False),  # epochs interleaved with the peer's
            }
            lengths = {name: len(loader) for name, loader in loaders.items()}
            if lengths["dataloader"] != lengths["stoker"]:
                raise SystemExit(f"batches per epoch differ: {lengths}")
            results["batches_per_epoch"] = lengths["stoker"]

            repeats: dict[str, list[dict[str, Any]]] = {name: [] for name in SYSTEMS}
            first: dict[str, dict[str, Any]] = {}
            for r in range(args.repeats):
                # Alternate who goes first: a shared machine drifts, and the second runner of
                # a pair may inherit the first one's page cache or CPU frequency.
                order = SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]
                for position, name in enumerate(order):
                    if name == "stoker":
                        loaders[name].set_epoch(r)
                    m = time_epoch(loaders[name], server.proc.pid)
                    first.setdefault(name, m.pop("first"))
                    m.update(repeat=r, position=position,
                             images_per_s=m["batches_per_s"] * args.batch_size)
                    repeats[name].append(m)
                    if not args.json_only:
                        print(f"  repeat {r} {LABELS[name]:<20} {m['batches_per_s']:8.2f} "
                              f"batches/s  {m['cpu_ms_per_batch']:7.1f} CPU ms/batch  "
                              f"first batch {m['first_batch_s']:6.3f} s", flush=True)
            results["check_problems"] = check_first_batches(first, ds, args.batch_size)
        finally:
            # DataLoader has no close(): its persistent workers shut down when the loader (and
            # so its iterator) is collected. Drop it now, before the server stops, so neither
            # side's processes outlive the measurement.
            loaders.pop("dataloader", None)
            if "stoker" in loaders:
                loaders.pop("stoker").close()  # before the server goes: no stream sees it leave
            results["server_exit_code"] = server.stop()
            # At log level WARNING anything here is worth seeing (leaked shared memory, errors).
            results["server_stderr"] = server.stderr[-4000:]

    systems: dict[str, Any] = {}
    for name in SYSTEMS:
        rs = repeats[name]
        systems[name] = {
            "repeats": rs,
            "batches_per_s": summarise([m["batches_per_s"] for m in rs]),
            "images_per_s": summarise([m["images_per_s"] for m in rs]),
            "epoch_s": summarise([m["epoch_s"] for m in rs]),
            "cpu_ms_per_batch": summarise([m["cpu_ms_per_batch"] for m in rs]),
            "cores_busy": summarise([m["cores_busy"] for m in rs]),
            "other_cores_busy": summarise([m["other_cores_busy"] for m in rs]),
            "cpu_ms_per_batch_by_role": {
                role: statistics.median(m["cpu_ms_per_batch_by_role"][role] for m in rs)
                for role in ROLES},
            # Repeat 0 pays process start-up (DataLoader workers; stoker channel + stream);
            # later repeats start a new epoch with everything already running.
            "first_batch_cold_s": rs[0]["first_batch_s"],
            "first_batch_warm_s": (summarise([m["first_batch_s"] for m in rs[1:]])
                                   if len(rs) > 1 else None),
        }
    results["systems"] = systems
    results["ratio_stoker_over_dataloader"] = {
        "batches_per_s_median": (systems["stoker"]["batches_per_s"]["median"]
                                 / systems["dataloader"]["batches_per_s"]["median"]),
        "cpu_ms_per_batch_median": (systems["stoker"]["cpu_ms_per_batch"]["median"]
                                    / systems["dataloader"]["cpu_ms_per_batch"]["median"]),
    }
    results["load_avg_at_end"] = list(os.getloadavg())
    results["notes"] = NOTES
    return results


NOTES = [
    "Each epoch's first batch is a warm-up: it is timed separately (first batch) and excluded "
    "from batches/s, so process start-up is not counted in throughput.",
    "The stoker server is started once before any timing; its start-up is reported on its own.",
    "Server, workers and trainer share this machine's cores: this measures pipeline efficiency "
    "(CPU per batch, transport overhead), not the benefit of offloading decode to other "
    "machines.",
    "Order of the two systems alternates per repeat; figures are medians with [min, max].",
    "CPU ms/batch: user+system CPU of this process and all its descendants (DataLoader "
    "workers, or stoker server + workers + client threads) over the timed batches; less "
    "sensitive than wall time to other load on a shared machine. cores busy = CPU s / wall s.",
]


# -- output ----------------------------------------------------------------------------------
def report(res: dict[str, Any]) -> str:
    p, m, s = res["parameters"], res["machine"], res["systems"]
    w = p["workers"]
    lines = [
        "",
        "stoker RemoteLoader vs torch DataLoader: image-folder pipeline on one machine",
        f"machine   {m['cpus_usable']} usable CPUs (cpu_count {m['cpu_count']}), "
        f"{m['platform']}, Python {m['python']}, torch {m['torch']}",
        f"data      {p['images']} JPEGs in {p['classes']} classes, ~{p['source_size']} px "
        f"(mean {res['data']['mean_jpeg_bytes'] / 1024:.1f} KiB) -> decode, resize to "
        f"{p['size']}x{p['size']}, uint8 CHW",
        f"loaders   batch {p['batch_size']}, shuffle, drop_last, {res['batches_per_epoch']} "
        f"batches/epoch ({res['batches_per_epoch'] - 1} timed), {p['repeats']} repeats",
        f"workers   W={w}: DataLoader(num_workers={w}, persistent_workers={w > 0}, "
        f"prefetch_factor=2) vs stoker server --workers {w} (RemoteLoader prefetch="
        f"{p['prefetch']})",
        "",
        f"{'throughput (timed batches)':<26}{'batches/s':>11}{'[min, max]':>18}"
        f"{'images/s':>10}{'CPU ms/batch':>14}{'cores busy':>12}",
    ]
    for name in SYSTEMS:
        b, i = s[name]["batches_per_s"], s[name]["images_per_s"]
        spread = f"[{b['min']:.2f}, {b['max']:.2f}]"
        lines.append(f"  {LABELS[name]:<24}{b['median']:>11.2f}{spread:>18}{i['median']:>10.0f}"
                     f"{s[name]['cpu_ms_per_batch']['median']:>14.1f}"
                     f"{s[name]['cores_busy']['median']:>12.2f}")
    lines.append("  other load (cores busy outside this run, median [max]): " + ", ".join(
        f"{LABELS[n]} {s[n]['other_cores_busy']['median']:.2f} "
        f"[{s[n]['other_cores_busy']['max']:.2f}]" for n in SYSTEMS))
    lines += ["", "CPU ms/batch by process role (medians):"]
    for name in SYSTEMS:
        by_role = s[name]["cpu_ms_per_batch_by_role"]
        lines.append(f"  {LABELS[name]:<24}" + ", ".join(
            f"{role} {by_role[role]:.1f}" for role in ROLES if by_role[role] >= 0.05))
    lines += ["", f"{'start-up (first batch, untimed)':<34}{'cold, repeat 0':>16}"
                  f"{'warm, median of later':>24}"]
    for name in SYSTEMS:
        warm = s[name]["first_batch_warm_s"]
        warm_txt = f"{warm['median']:.3f} s" if warm else "-"
        lines.append(f"  {LABELS[name]:<32}{s[name]['first_batch_cold_s']:>14.3f} s"
                     f"{warm_txt:>24}")
    ratio = res["ratio_stoker_over_dataloader"]["batches_per_s_median"]
    cpu_ratio = res["ratio_stoker_over_dataloader"]["cpu_ms_per_batch_median"]
    lines += [
        "",
        f"ratio stoker / DataLoader (median batches/s): {ratio:.3f}"
        f"  ({'stoker faster' if ratio > 1 else 'DataLoader faster'} by "
        f"{abs(ratio - 1) * 100:.1f}%)",
        f"ratio stoker / DataLoader (median CPU ms/batch): {cpu_ratio:.3f}"
        f"  (>1: stoker spends more CPU per batch)",
        f"server start-up (spawn, {w} workers ready): {res['server_start_s']:.2f} s, "
        f"not included above; server exit code {res['server_exit_code']}",
        "",
        "images/s, median, bars scaled to the faster system:",
    ]
    best = max(s[n]["images_per_s"]["median"] for n in SYSTEMS)
    for name in SYSTEMS:
        v = s[name]["images_per_s"]["median"]
        lines.append(f"  {LABELS[name]:<20} {'#' * max(1, round(40 * v / best)):<40} {v:.0f}")
    lines += ["", "notes:"] + [f"  - {n}" for n in res["notes"]]
    # Other tenants steal the cores both systems need; say so next to the figures.
    other = max(s[n]["other_cores_busy"]["max"] for n in SYSTEMS)
    if other > OTHER_LOAD_WARN:
        lines.append(f"  - WARNING: other processes kept up to {other:.2f} of "
                     f"{m['cpus_usable']} cores busy during timed epochs: wall-clock figures "
                     "are noisy; prefer CPU ms/batch and more --repeats.")
    if res["server_stderr"].strip():
        lines += ["", "server stderr (last 4000 characters):", res["server_stderr"].rstrip()]
    if res["check_problems"]:
        lines += ["", "CHECK FAILED:"] + [f"  - {x}" for x in res["check_problems"]]
    else:
        lines.append("  - check: batch shapes/dtypes agree; stoker pixels equal ImageFolder's.")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    cores = len(os.sched_getaffinity(0))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, help=f"images in the dataset ({FULL['images']}; "
                    f"--quick {QUICK['images']})")
    ap.add_argument("--size", type=int, help=f"output side in px ({FULL['size']})")
    ap.add_argument("--source-size", type=int,
                    help=f"typical JPEG side in px, +-25%% ({FULL['source_size']})")
    ap.add_argument("--batch-size", type=int, help=f"({FULL['batch_size']})")
    ap.add_argument("--workers", type=int, default=cores,
                    help=f"worker processes on each side (default: usable cores, {cores})")
    ap.add_argument("--repeats", type=int, help=f"epochs timed per system ({FULL['repeats']})")
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--prefetch", type=int, default=8, help="RemoteLoader batches in flight")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-dir", help="keep the generated JPEGs here and reuse them "
                    "(default: a temporary folder, removed at the end)")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--json-only", action="store_true", help="print nothing but errors")
    ap.add_argument("--quick", action="store_true", help="small smoke-test settings")
    args = ap.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    # The server always runs at least one worker process: W=0 has no stoker counterpart.
    if args.workers < 1:
        ap.error("--workers must be >= 1")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if args.images // args.batch_size < 2:
        ap.error("need at least 2 batches per epoch (one warm-up, one timed)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    res = run(args)
    res["total_s"] = time.perf_counter() - t0
    text = (report(res) + f"\n\ntotal wall time {res['total_s']:.1f} s "
            f"(data generation {res['data_generation_s']:.1f} s)")
    if not args.json_only:
        print(text)
    return write_results(res, args.json, args.json_only)


if __name__ == "__main__":
    sys.exit(main())
