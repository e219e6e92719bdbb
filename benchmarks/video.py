"""Video clips: `format: video` against a PyAV clip Dataset in torch DataLoader, same videos, same
number of workers, and the same Dataset served through `format: python`.

    python benchmarks/video.py                 # 48 videos, W = 1 and 2, 3 repeats
    python benchmarks/video.py --quick         # 12 videos, W = 1 and 2, 1 repeat
    python benchmarks/video.py --json out.json

Videos (issue 40's): 480x360, 30 fps, 6 s, H.264 with B-frames (3, pyramid) and a 48-frame
GOP, in MP4, made here with PyAV's libx264. A sample is one random clip per video per epoch:
16 frames, every 2nd, resized to 112x112 RGB, uint8 TCHW, batches of 8.

- peer: the Dataset written the way people write it with PyAV (`ClipDataset` below): seek to
  the keyframe before a seeded start, decode, keep every 2nd frame from the start, convert
  each kept one to 112x112 RGB with FFmpeg's scaler; torch DataLoader, W workers.
- stoker: `format: video`, `clip: {frames: 16, stride: 2}`, `size: 112`, W workers, read with
  a default RemoteLoader (on one host: the data connection).
- python: the peer's Dataset as a `format: python` factory, W workers.

Figures: clips/s over whole epochs (median over repeats), the ratio stoker / peer (issue
40's target: >= 1.5x at W = 1 and 2), and CPU seconds per clip: of the processes each system
ran (the trainer's and its DataLoader workers', or the trainer's and the server's whole
process tree), over the clips delivered. These machines are shared: read ratios measured in
the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import numpy as np
from _measure import (
    machine_info,
    run_scenario,
    scenario_parser,
    settle,
    summarise,
)

from stoker.client import RemoteLoader
from stoker.server import ServerProcess, write_config

FULL = {"videos": 48, "repeats": 3, "epochs": 2}
QUICK = {"videos": 12, "repeats": 1, "epochs": 1}
TARGET = 1.5
FRAMES, STRIDE, SIZE, BATCH = 16, 2, 112, 8
HERE = Path(__file__).resolve().parent


def make_videos(root: Path, n: int) -> None:
    """`n` videos of 180 frames, 480x360, 30 fps, in two class folders: a moving gradient
    plus mild noise (a photo-like bitrate), x264 with B-frames and a 48-frame GOP."""
    h, w = 360, 480
    xx, yy = np.arange(w, dtype=np.float32), np.arange(h, dtype=np.float32)
    for i in range(n):
        folder = root / f"class_{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(i)
        with av.open(str(folder / f"{i:04d}.mp4"), "w") as out:
            stream = out.add_stream("libx264", rate=30, options={
                "preset": "veryfast", "x264-params": "bframes=3:b-pyramid=normal:keyint=48:"
                                                     "min-keyint=48:scenecut=0"})
            stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
            base = rng.uniform(40, 215, 3).astype(np.float32)
            noise = rng.normal(0, 6, (8, h, w, 3)).astype(np.float32)  # cycled: cheap to make
            for k in range(180):
                rows = 40 * np.cos((yy - 3 * k) / 30)[:, None, None]
                cols = np.stack([60 * np.sin((xx + 4 * k * (c + 1)) / 40) for c in range(3)], -1)
                pixels = base + rows + cols[None] + noise[k % 8]
                frame = av.VideoFrame.from_ndarray(np.clip(pixels, 0, 255).astype(np.uint8),
                                                   format="rgb24")
                frame.pts = k
                out.mux(stream.encode(frame))
            out.mux(stream.encode(None))


class ClipDataset:
    """The peer: a PyAV clip Dataset as people write it (map-style, picklable)."""

    def __init__(self, root: str, seed: int = 0) -> None:
        self.paths = sorted(str(p) for p in Path(root).glob("*/*.mp4"))
        self.seed = seed
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> dict[str, Any]:
        rng = np.random.default_rng([self.seed, self.epoch, i])
        with av.open(self.paths[i]) as container:
            stream = container.streams.video[0]
            n = stream.frames
            start = int(rng.integers(0, n - (FRAMES - 1) * STRIDE))
            rate = Fraction(stream.average_rate)
            target = int(Fraction(start) / rate / stream.time_base)
            container.seek(target, stream=stream)
            frames, seen = [], 0
            for frame in container.decode(stream):
                if frame.pts < target:
                    continue
                if seen % STRIDE == 0:
                    frames.append(frame.to_ndarray(width=SIZE, height=SIZE, format="rgb24"))
                    if len(frames) == FRAMES:
                        break
                seen += 1
        video = np.stack(frames).transpose(0, 3, 1, 2).copy()
        return {"video": video, "label": np.int64(i % 2)}


def clip_dataset(root: str) -> ClipDataset:
    """The `format: python` factory of the same Dataset."""
    return ClipDataset(root)


def tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) of process `pid` and every live descendant, from /proc:
    what this run's processes used, not the rest of a shared machine."""
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    tree, grew = {pid}, True
    while grew:
        more = {p for p, (ppid, _) in stats.items() if ppid in tree} - tree
        tree |= more
        grew = bool(more)
    return sum(stats[p][1] for p in tree if p in stats) / os.sysconf("SC_CLK_TCK")


def own_cpu() -> float:
    """CPU seconds of this process and of its children it has reaped (DataLoader's workers)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    import torch

    return {k: torch.from_numpy(np.stack([s[k] for s in samples])) for k in samples[0]}


def peer_rate(root: Path, workers: int, epochs: int) -> tuple[float, float]:
    """(clips/s, CPU s per clip) of the Dataset in torch DataLoader with `workers` workers."""
    from torch.utils.data import DataLoader

    ds = ClipDataset(str(root))
    busy, t0, n = own_cpu(), time.perf_counter(), 0
    for epoch in range(epochs):
        ds.epoch = epoch
        loader = DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=workers,
                            collate_fn=_collate, drop_last=False)
        for batch in loader:
            n += len(batch["label"])
    elapsed = time.perf_counter() - t0
    return n / elapsed, (own_cpu() - busy) / n


def server_rate(config: Path, workers: int, epochs: int, env: dict[str, str]
                ) -> tuple[float, float, int]:
    """(clips/s, CPU s per clip, exit code) of one server's dataset `clips`."""
    server = ServerProcess(config, workers=workers, env=env).start()
    try:
        assert server.proc is not None
        busy, t0, n = own_cpu() + tree_cpu(server.proc.pid), time.perf_counter(), 0
        with RemoteLoader(server.address, "clips", batch_size=BATCH, seed=1, drop_last=False,
                          output="numpy", timeout=300) as loader:
            for epoch in range(epochs):
                loader.set_epoch(epoch)
                for batch in loader:
                    n += len(batch["label"])
        rate = n / (time.perf_counter() - t0)
        cpu = (own_cpu() + tree_cpu(server.proc.pid) - busy) / n
    finally:
        code = server.stop()
    return rate, cpu, code


def run(args: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {"benchmark": "video", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "machine": machine_info(numpy=np.__version__, av=av.__version__),
                           "parameters": dict(vars(args)), "rows": []}
    codes = []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])}
    with tempfile.TemporaryDirectory(prefix="stoker-video-") as tmp:
        root = Path(tmp) / "videos"
        t0 = time.perf_counter()
        make_videos(root, args.videos)
        res["make_videos_s"] = time.perf_counter() - t0
        clip = {"frames": FRAMES, "stride": STRIDE}
        stoker_cfg = write_config(Path(tmp) / "video.yaml", {"datasets": {"clips": {
            "format": "video", "source": str(root), "clip": clip, "size": SIZE}}})
        python_cfg = write_config(Path(tmp) / "python.yaml", {"datasets": {"clips": {
            "format": "python", "factory": "video:clip_dataset",
            "options": {"root": str(root)}}}})
        for workers in args.workers:
            for r in range(args.repeats):
                row: dict[str, Any] = {"workers": workers, "repeat": r}
                row["peer"], row["peer_cpu"] = peer_rate(root, workers, args.epochs)
                row["stoker"], row["stoker_cpu"], code = server_rate(
                    stoker_cfg, workers, args.epochs, env)
                codes.append(code)
                row["python"], row["python_cpu"], code = server_rate(
                    python_cfg, workers, args.epochs, env)
                codes.append(code)
                row["ratio"] = row["stoker"] / row["peer"]
                res["rows"].append(row)
                if not args.json_only:
                    print(f"  W={workers} repeat {r}: peer {row['peer']:.1f}/s, stoker "
                          f"{row['stoker']:.1f}/s ({row['ratio']:.2f}x), python "
                          f"{row['python']:.1f}/s", flush=True)
    res["server_exit_code"] = max(codes, key=abs) if codes else 0
    res["summary"] = {}
    for workers in args.workers:
        rows = [row for row in res["rows"] if row["workers"] == workers]
        res["summary"][str(workers)] = {k: summarise([row[k] for row in rows]) for k in (
            "peer", "stoker", "python", "ratio", "peer_cpu", "stoker_cpu", "python_cpu")}
    res["meets_target"] = all(statistics.median(
        row["ratio"] for row in res["rows"] if row["workers"] == w) >= TARGET
        for w in args.workers)
    res["check_problems"] = []
    return res


def main(argv: list[str] | None = None) -> int:
    ap = scenario_parser(__doc__)
    ap.add_argument("--videos", type=int)
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--epochs", type=int)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args(argv)
    settle(args, QUICK, FULL)
    return run_scenario(args, run)


if __name__ == "__main__":
    sys.exit(main())
