"""The image training pipeline: stoker's server against torch DataLoader, W workers each.

    python benchmarks/pipeline.py                  # 1024 photos 500x375, W = 1..cores, 3 repeats
    python benchmarks/pipeline.py --quick          # smoke test, about a minute
    python benchmarks/pipeline.py --json out.json

Data: real photographs as 500x375 JPEGs, q90 (benchmarks/_data.py: views of the sample photos
scikit-image, scikit-learn and matplotlib ship). Pipeline: random resized crop 224 (scale
0.08-1, ratio 3/4-4/3) -> horizontal flip (p 0.5) -> normalize (ImageNet mean/std) -> float32
CHW, batches of 32.

- DataLoader(num_workers=W, persistent workers) runs what a careful user writes with Pillow
  and torch (`PillowPipeline`): torchvision's RandomResizedCrop / RandomHorizontalFlip /
  ToTensor / Normalize step by step (torchvision itself has no build for this torch on the
  package registry here), the crop box drawn from the file's header, `Image.draft` for a
  DCT-scaled decode where the box is at least twice the output on both sides (never at
  500x375: its height is under 2 x 224), and the resize reading the box straight from the
  decoded image.
- torchdata's StatefulDataLoader(num_workers=W): the resumable DataLoader, same pipeline.
- stoker: a server with W worker processes and the same steps as `transforms:`, read by
  RemoteLoader (torch tensors).
- stoker uint8: the same without `normalize` on the server: uint8 images on the wire (4x
  fewer bytes), normalised by RemoteLoader(normalize=...) after they arrive (on a GPU that
  runs on the device; here, on the trainer's CPU, and counted).
- SPDL (Meta's thread pipeline, benchmarks/spdl_peer.py): FFmpeg decode + crop/scale/flip
  filter graph on T threads of the training process, one conversion per batch. Threads are
  not worker processes, so it runs in the largest-W block only (all cores, as every system
  there), once per T in --spdl-threads; all T are reported and the best is its figure.

Both run on the same cores, alternating, medians over repeats. The offload itself (decode on
other machines) cannot show on one machine: this is images/s per CPU, side by side.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import PIL
import simplejpeg
import torch
from _data import MEAN, STD, TRANSFORMS, TRANSPORTS, make_photo_folder, transport_ran
from _measure import (
    machine_info,
    run_scenario,
    scenario_parser,
    settle,
    summarise,
)
from loader_vs_dataloader import ROLES, time_epoch
from PIL import Image
from spdl_peer import SpdlImageLoader, spdl_version, unavailable
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from stoker.client import RemoteLoader
from stoker.server import ServerProcess, write_config

FULL = {"images": 1024, "batch_size": 32, "repeats": 3}
QUICK = {"images": 192, "batch_size": 16, "repeats": 1}
SYSTEMS = ("dataloader", "stateful", "stoker", "stoker_uint8")
# --transport: TRANSPORTS (_data.py), the RemoteLoader arguments for each way batches
# can reach the trainer.

LABELS = {"dataloader": "torch DataLoader", "stateful": "torchdata StatefulDataLoader",
          "stoker": "stoker RemoteLoader", "stoker_uint8": "stoker, uint8 + client normalize"}


def spdl_name(threads: int) -> str:
    return f"spdl_t{threads}"


def _label(name: str) -> str:
    if name.startswith("spdl_t"):
        t = int(name.removeprefix("spdl_t"))
        return f"SPDL, {t} thread{'s' * (t > 1)}"
    return LABELS[name]


class PillowPipeline(Dataset):
    """An ImageFolder with torchvision's RandomResizedCrop / RandomHorizontalFlip / ToTensor /
    Normalize on Pillow, written out as a careful user writes it for speed: open the file
    (the header only), draw the crop box from its size (torch's RNG, as torchvision), then
    `Image.draft` asks libjpeg for a DCT-scaled decode (1/2, 1/4 or 1/8) whenever the box is
    still at least 224 on both sides at that scale, i.e. at least twice the output, and
    `resize(box=...)` resamples the box (bilinear, antialiased as Pillow's downscale is)
    from the smaller image without a cropped copy; flip; contiguous CHW float / 255;
    normalize. `Image.reduce` (resize's `reducing_gap`, 2 or more) would change nothing:
    after the draft one side of the box is under twice the output (short of 1/8 scale),
    so with the ratio bound of 4/3 the other is under 2.7 times it."""

    def __init__(self, root: Path, size: int = 224) -> None:
        classes = sorted(p.name for p in root.iterdir() if p.is_dir())
        self.items = [(str(f), c) for c, name in enumerate(classes)
                      for f in sorted((root / name).glob("*.jpg"))]
        self.size = size
        self.mean = torch.tensor(MEAN).view(3, 1, 1)
        self.std = torch.tensor(STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.items)

    def _crop(self, width: int, height: int) -> tuple[int, int, int, int]:
        area = width * height
        log_ratio = torch.log(torch.tensor((3 / 4, 4 / 3)))
        for _ in range(10):
            target = area * torch.empty(1).uniform_(0.08, 1.0).item()
            aspect = math.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1]).item())
            w = round(math.sqrt(target * aspect))
            h = round(math.sqrt(target / aspect))
            if 0 < w <= width and 0 < h <= height:
                top = int(torch.randint(0, height - h + 1, size=(1,)).item())
                left = int(torch.randint(0, width - w + 1, size=(1,)).item())
                return left, top, w, h
        side = min(width, height)
        return (width - side) // 2, (height - side) // 2, side, side

    def load(self, path: str) -> Image.Image:
        """The image's random resized crop at size x size, RGB (before the flip)."""
        with Image.open(path) as img:
            width, height = img.size
            left, top, w, h = self._crop(width, height)
            # Pillow picks the largest scale 1/s with width // s >= the asked width (and so
            # for height): asking for the image's size times size / box makes w / s >= size.
            drafted = img.draft("RGB", (-(-width * self.size // w),
                                        -(-height * self.size // h)))
            s = width / drafted[1][2] if drafted else 1  # the decode's scale denominator
            if img.mode != "RGB":  # grey or CMYK JPEGs (draft keeps those modes)
                img = img.convert("RGB")
            return img.resize((self.size, self.size), Image.Resampling.BILINEAR,
                              box=(left / s, top / s, (left + w) / s, (top + h) / s))

    def __getitem__(self, i: int) -> dict[str, Any]:
        path, label = self.items[i]
        img = self.load(path)
        if torch.rand(1).item() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        t = torch.from_numpy(np.array(img, copy=True)).permute(2, 0, 1).contiguous()
        t = t.float().div(255)
        return {"image": t.sub_(self.mean).div_(self.std), "label": label}


def _summary(rs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"repeats": rs,
            "images_per_s": summarise([m["images_per_s"] for m in rs]),
            "cpu_ms_per_batch": summarise([m["cpu_ms_per_batch"] for m in rs]),
            "cpu_ms_per_batch_by_role": {
                role: float(np.median([m["cpu_ms_per_batch_by_role"][role] for m in rs]))
                for role in ROLES}}


def measure_w0(args: argparse.Namespace, data_dir: Path) -> dict[str, Any]:
    """W = 0: DataLoader loads in the training process itself; stoker has no such mode (a
    server has at least one worker)."""
    g = torch.Generator()
    g.manual_seed(args.seed)
    dl = DataLoader(PillowPipeline(data_dir), batch_size=args.batch_size, shuffle=True,
                    drop_last=True, num_workers=0, generator=g)
    runs = []
    for r in range(args.repeats):
        m = time_epoch(dl, -1)
        m.pop("first")
        m["images_per_s"] = m["batches_per_s"] * args.batch_size
        runs.append(m)
        if not args.json_only:
            print(f"  W=0 repeat {r} {LABELS['dataloader']:<20} {m['images_per_s']:8.1f} "
                  f"images/s  {m['cpu_ms_per_batch']:7.1f} CPU ms/batch", flush=True)
    return {"workers": 0, "problems": [], "dataloader": _summary(runs),
            "ratio_images_per_s": {}, "trainer_cpu_vs_dataloader_node": {}}


def measure_w(args: argparse.Namespace, data_dir: Path, cfg_dir: Path, w: int,
              spdl_threads: list[int]) -> dict[str, Any]:
    """Every system at W workers (and SPDL at each of `spdl_threads`): alternating
    epochs, `repeats` each."""
    config = write_config(cfg_dir / f"config-w{w}.yaml", {"datasets": {
        "imgs": {"format": "image-folder", "source": str(data_dir), "transforms": TRANSFORMS},
        "imgs_uint8": {"format": "image-folder", "source": str(data_dir),
                       "transforms": TRANSFORMS[:-1]}}})
    t0 = time.perf_counter()
    server = ServerProcess(config, workers=w).start()
    start_s = time.perf_counter() - t0
    g = torch.Generator()
    g.manual_seed(args.seed)
    # The systems' epochs are interleaved: a stoker loader must not build its next epoch's
    # first batches while a peer's epoch is being measured (prefetch_next_epoch=False).
    # The DataLoaders' workers come from a fork server (their CPU is still this process tree's):
    # a fork here, once gRPC's threads run, skips gRPC's fork handlers (SIGSEGV in a worker).
    loaders: dict[str, Any] = {
        "dataloader": DataLoader(PillowPipeline(data_dir), batch_size=args.batch_size,
                                 shuffle=True, drop_last=True, num_workers=w,
                                 persistent_workers=True, generator=g,
                                 multiprocessing_context="forkserver"),
        # The resumable DataLoader (torchdata): same workers, plus state_dict bookkeeping.
        "stateful": StatefulDataLoader(PillowPipeline(data_dir), batch_size=args.batch_size,
                                       shuffle=True, drop_last=True, num_workers=w,
                                       persistent_workers=True, generator=g,
                                       multiprocessing_context="forkserver"),
        "stoker": RemoteLoader(server.address, "imgs", batch_size=args.batch_size,
                               seed=args.seed, shuffle=True, drop_last=True,
                               prefetch=args.prefetch, prefetch_next_epoch=False,
                               **TRANSPORTS[args.transport]),
        "stoker_uint8": RemoteLoader(server.address, "imgs_uint8", batch_size=args.batch_size,
                                     seed=args.seed, shuffle=True, drop_last=True,
                                     prefetch=args.prefetch, normalize={"image": (MEAN, STD)},
                                     prefetch_next_epoch=False, **TRANSPORTS[args.transport])}
    spdl = [spdl_name(t) for t in spdl_threads]
    for t, name in zip(spdl_threads, spdl, strict=True):
        loaders[name] = SpdlImageLoader(data_dir, args.batch_size, t, seed=args.seed)
    systems = SYSTEMS + tuple(spdl)
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in systems}
    problems: list[str] = []
    firsts: dict[str, Any] = {}
    try:
        for r in range(args.repeats):
            order = systems if r % 2 == 0 else systems[::-1]
            for name in order:
                if name.startswith(("stoker", "spdl")):
                    loaders[name].set_epoch(r)
                m = time_epoch(loaders[name], server.proc.pid)
                first = m.pop("first")
                image = first["image"]
                if r == 0:
                    firsts[name] = image
                if tuple(image.shape) != (args.batch_size, 3, 224, 224) or \
                        image.dtype != torch.float32:
                    problems.append(f"{name}: batch image {image.dtype}{list(image.shape)}")
                m["images_per_s"] = m["batches_per_s"] * args.batch_size
                runs[name].append(m)
                if not args.json_only:
                    print(f"  W={w} repeat {r} {_label(name):<20} {m['images_per_s']:8.1f} "
                          f"images/s  {m['cpu_ms_per_batch']:7.1f} CPU ms/batch", flush=True)
        # Same seed and epoch: the server's normalize and the client's give the same pixels.
        if not torch.allclose(firsts["stoker"], firsts["stoker_uint8"], atol=1e-4):
            problems.append(f"W={w}: uint8 + client normalize differs from server normalize")
    finally:
        loaders.pop("dataloader")
        loaders.pop("stateful")
        ran = transport_ran(args.transport, {n: loaders[n] for n in ("stoker", "stoker_uint8")},
                            problems)
        for name in ("stoker", "stoker_uint8"):
            loaders.pop(name).close()
        code = server.stop()
    if code != 0:
        problems.append(f"W={w}: server exit code {code}: {server.stderr[-2000:]}")
    out: dict[str, Any] = {"workers": w, "server_start_s": start_s, "problems": problems,
                           "transport_ran": ran}
    for name in systems:
        out[name] = _summary(runs[name])
    # The training node's CPU: DataLoader's main process and workers, against what stoker's
    # client spends there (its servers run elsewhere in a deployment).
    dl_node = sum(out["dataloader"]["cpu_ms_per_batch_by_role"][r]
                  for r in ("trainer", "loader workers"))
    out["trainer_cpu_vs_dataloader_node"] = {
        name: out[name]["cpu_ms_per_batch_by_role"]["trainer"] / dl_node for name in SYSTEMS[1:]}
    out["ratio_images_per_s"] = {
        name: out[name]["images_per_s"]["median"] / out["dataloader"]["images_per_s"]["median"]
        for name in SYSTEMS[1:]}
    if spdl:
        best = max(spdl, key=lambda n: out[n]["images_per_s"]["median"])
        dl = out["dataloader"]["images_per_s"]["median"]
        out["spdl"] = {"threads": spdl_threads, "best": best,
                       "ratio_images_per_s": {n: out[n]["images_per_s"]["median"] / dl
                                              for n in spdl}}
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {
        "benchmark": "pipeline", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(torch=torch.__version__, numpy=np.__version__,
                                pillow=PIL.__version__, simplejpeg=simplejpeg.__version__),
        "parameters": dict(vars(args)), "transforms": TRANSFORMS,
        # The DataLoader peer's decode (the page says what it did): Pillow with draft().
        "dataloader_peer": "pillow-draft"}
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="stoker-pipe-")))
        data_dir = Path(args.data_dir) if args.data_dir else tmp / "images"
        made = not any(data_dir.glob("class_*/*.jpg"))
        if made:
            make_photo_folder(data_dir, args.images)
        jpegs = list(data_dir.glob("class_*/*.jpg"))
        # "set" tells the page what the images were (results without it: synthetic JPEGs).
        res["data"] = {"images": len(jpegs), "set": "photos" if made else "--data-dir",
                       "mean_jpeg_bytes": sum(p.stat().st_size for p in jpegs) / len(jpegs)}
        spdl_w = max(args.workers)
        res["spdl"] = _spdl_plan(args, spdl_w)
        res["sweep"] = [measure_w0(args, data_dir) if w == 0 else
                        measure_w(args, data_dir, tmp, w,
                                  res["spdl"].get("threads", []) if w == spdl_w else [])
                        for w in args.workers]
        if "skipped" not in res["spdl"]:
            _spdl_best(res)
    res["check_problems"] = [p for s in res["sweep"] for p in s["problems"]]
    res["server_exit_code"] = 0  # per-W exit codes are checked into check_problems
    return res


def _spdl_plan(args: argparse.Namespace, spdl_w: int) -> dict[str, Any]:
    """Where and how SPDL runs in this sweep, or why it does not."""
    if not args.spdl_threads:
        return {"skipped": "--spdl-threads 0"}
    if spdl_w == 0:
        return {"skipped": "no W >= 1 in --workers (SPDL runs beside the largest W)"}
    reason = unavailable()
    if reason:
        print(f"SPDL left out: {reason}", file=sys.stderr, flush=True)
        return {"skipped": reason}
    return {"version": spdl_version(), "threads": args.spdl_threads, "at_workers": spdl_w}


def _spdl_best(res: dict[str, Any]) -> None:
    """res["spdl"] gains SPDL's best thread count, its images/s, and every other system's
    images/s over it, in the block it ran beside."""
    plan = res["spdl"]
    block = next(s for s in res["sweep"] if s["workers"] == plan["at_workers"])
    rate = block[block["spdl"]["best"]]["images_per_s"]["median"]
    plan.update(best=block["spdl"]["best"], images_per_s=rate, others_over_best={
        n: block[n]["images_per_s"]["median"] / rate for n in SYSTEMS if n in block})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    cores = len(os.sched_getaffinity(0))
    ap = scenario_parser(__doc__)
    ap.add_argument("--images", type=int)
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--workers", type=int, nargs="+", default=list(range(1, cores + 1)),
                    help="the W values to sweep (default 1..cores; 0: DataLoader alone, "
                         "loading in the training process)")
    ap.add_argument("--prefetch", type=int, default=8, help="RemoteLoader batches in flight")
    ap.add_argument("--transport", choices=sorted(TRANSPORTS), default="shm",
                    help="how stoker batches reach this process, each label turning the other "
                         "paths off (_data.TRANSPORTS): shm (shared memory, data_socket=False), "
                         "grpc (gRPC frames), socket (the data connection, the default path "
                         "between machines and on one host)")
    ap.add_argument("--spdl-threads", type=int, nargs="+", default=[1, 2, 4, 8],
                    help="SPDL's thread counts, each measured beside the largest W (0: leave "
                         "SPDL out)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-dir", help="use (or fill) this folder of JPEGs")
    args = ap.parse_args(argv)
    settle(args, QUICK, FULL)
    if min(args.workers) < 0:
        ap.error("--workers values must be >= 0")
    if min(args.spdl_threads) < 0 or (0 in args.spdl_threads and len(args.spdl_threads) > 1):
        ap.error("--spdl-threads: thread counts >= 1, or 0 alone to leave SPDL out")
    args.spdl_threads = [t for t in args.spdl_threads if t > 0]
    if args.images // args.batch_size < 2:
        ap.error("need at least 2 batches per epoch (one warm-up, one timed)")
    return args


def main(argv: list[str] | None = None) -> int:
    return run_scenario(parse_args(argv), run)


if __name__ == "__main__":
    sys.exit(main())
