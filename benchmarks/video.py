"""Video clips, per core: `format: video` against a careful PyAV clip Dataset in torch
DataLoader, same videos, same number of workers, H.264 and VP9 apart.

    python benchmarks/video.py                 # 48 videos, W = 2, 5 repeats
    python benchmarks/video.py --quick         # 12 videos, W = 2, 1 repeat
    python benchmarks/video.py --workers 1 2 --videos-dir /tmp/v --json out.json

Videos (issue 49's): 480x360, 30 fps, 6 s, a 48-frame GOP; half H.264 with B-frames
(3, pyramid) in MP4, half VP9 in WebM (libvpx's good deadline, constant quality), made here
with PyAV's encoders (`--videos-dir` keeps them for the next run). A sample is one random clip
per video per epoch: 16 frames, every 2nd, 112x112 RGB, uint8 TCHW, batches of 8.

- peer: the clip Dataset written the way PyAV's docs and a careful user write it
  (`ClipDataset` below): FFmpeg's own threads (`stream.thread_type = "AUTO"`), seek to the
  keyframe before a random start, decode, keep every 2nd frame from the start, each kept one
  `frame.reformat(width=112, height=112, format="rgb24")` (one scaler pass; PyAV keeps the
  scaler per thread); torch DataLoader with W persistent workers, one loader for every epoch.
- stoker: `format: video`, `clip: {frames: 16, stride: 2}`, `size: 112`, one server with W
  workers, read with one default RemoteLoader (on one host: the data connection).

Each run: one warm-up epoch (workers start, files are opened once), then `--epochs` timed
epochs. Figures: CPU ms per clip of every process the system ran (this trainer, its DataLoader
workers or the server's whole process tree: /proc of this process and all its descendants,
reaped ones included), clips/s, and the ratio per core: the peer's CPU per clip over stoker's
(issue 49's targets: >= 1.5x on H.264, >= 1.15x on VP9). Systems alternate within a repeat;
medians over repeats. `reference_share` is the share of each codec's frames that another frame
may refer to (what FFmpeg decodes with `skip_frame = NONREF`): what skipping can save.
"""

from __future__ import annotations

import argparse
import os
import random
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

FULL = {"videos": 48, "repeats": 5, "epochs": 3}
QUICK = {"videos": 12, "repeats": 1, "epochs": 2}
TARGETS = {"h264": 1.5, "vp9": 1.15}  # stoker's clips per CPU second over the peer's
FRAMES, STRIDE, SIZE, BATCH = 16, 2, 112, 8
HERE = Path(__file__).resolve().parent
# codec -> (encoder, suffix, options): a 48-frame GOP; H.264 with a B-pyramid, VP9 from
# libvpx's "good" deadline at constant quality (about H.264's bitrate here).
ENCODERS = {
    "h264": ("libx264", ".mp4", {"preset": "veryfast", "x264-params":
             "bframes=3:b-pyramid=normal:keyint=48:min-keyint=48:scenecut=0"}),
    "vp9": ("libvpx-vp9", ".webm", {"deadline": "good", "cpu-used": "8", "g": "48",
                                    "keyint_min": "48", "crf": "32", "b": "0"}),
}


def make_video(path: Path, codec: str, seed: int) -> None:
    """180 frames, 480x360, 30 fps: a moving gradient plus mild noise (a photo-like bitrate)."""
    encoder, _, options = ENCODERS[codec]
    h, w = 360, 480
    xx, yy = np.arange(w, dtype=np.float32), np.arange(h, dtype=np.float32)
    rng = np.random.default_rng(seed)
    with av.open(str(path), "w") as out:
        stream = out.add_stream(encoder, rate=30, options=dict(options))
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


def make_videos(root: Path, n: int) -> None:
    """`n` videos, half per codec, under root/<codec>/class_<0|1>/ (kept ones are reused)."""
    for codec, (_, suffix, _) in ENCODERS.items():
        for i in range(n // 2):
            path = root / codec / f"class_{i % 2}" / f"{i:04d}{suffix}"
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                part = path.with_name("part-" + path.name)
                make_video(part, codec, i)
                part.rename(path)


class ClipDataset:
    """The peer: a PyAV clip Dataset as its docs and a careful user write it (map-style,
    picklable). The start comes from `random`, which DataLoader seeds in every worker."""

    def __init__(self, root: str) -> None:
        self.paths = sorted(str(p) for p in Path(root).glob("*/*") if p.is_file())

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> dict[str, Any]:
        with av.open(self.paths[i]) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"  # FFmpeg's frame and slice threads
            rate = Fraction(stream.average_rate)
            n = stream.frames or int(container.duration * rate / av.time_base)  # WebM: 0
            start = random.randrange(n - (FRAMES - 1) * STRIDE)
            target = int(Fraction(start) / rate / stream.time_base)
            container.seek(target, stream=stream)
            frames, seen = [], 0
            for frame in container.decode(stream):
                if frame.pts < target:
                    continue
                if seen % STRIDE == 0:
                    small = frame.reformat(width=SIZE, height=SIZE, format="rgb24")
                    frames.append(small.to_ndarray())
                    if len(frames) == FRAMES:
                        break
                seen += 1
        video = np.stack(frames).transpose(0, 3, 1, 2).copy()
        return {"video": video, "label": np.int64(Path(self.paths[i]).parent.name[-1] == "1")}


def tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) of process `pid` and every live descendant, with the
    children each has reaped, from /proc: what this run's processes used, not the rest of a
    shared machine."""
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry)] = (int(fields[1]), sum(int(x) for x in fields[11:15]))
    tree, grew = {pid}, True
    while grew:
        more = {p for p, (ppid, _) in stats.items() if ppid in tree} - tree
        tree |= more
        grew = bool(more)
    return sum(stats[p][1] for p in tree if p in stats) / os.sysconf("SC_CLK_TCK")


def _collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    import torch

    return {k: torch.from_numpy(np.stack([s[k] for s in samples])) for k in samples[0]}


def peer_run(root: Path, workers: int, epochs: int) -> dict[str, float]:
    """clips/s and CPU s per clip of the Dataset in one DataLoader with persistent workers."""
    from torch.utils.data import DataLoader

    loader = DataLoader(ClipDataset(str(root)), batch_size=BATCH, shuffle=True,
                        num_workers=workers, collate_fn=_collate, persistent_workers=True)
    try:
        for _ in loader:  # warm-up: the workers start
            pass
        cpu, t0, n = tree_cpu(os.getpid()), time.perf_counter(), 0
        for _ in range(epochs):
            for batch in loader:
                n += len(batch["label"])
        elapsed, cpu = time.perf_counter() - t0, tree_cpu(os.getpid()) - cpu
    finally:
        del loader  # its workers stop
    return {"clips_per_s": n / elapsed, "cpu_per_clip": cpu / n}


def stoker_run(config: Path, dataset: str, workers: int, epochs: int, env: dict[str, str]
               ) -> dict[str, float]:
    """clips/s, CPU s per clip (all processes) and the server tree's part, exit code."""
    server = ServerProcess(config, workers=workers, env=env).start()
    try:
        assert server.proc is not None
        with RemoteLoader(server.address, dataset, batch_size=BATCH, seed=1, drop_last=False,
                          output="numpy", timeout=300) as loader:
            for _ in loader:  # warm-up: epoch 0
                pass
            # The server's tree from /proc; this process (the trainer, the server's parent)
            # by process_time: a short run's trainer can use less than /proc's 10 ms tick.
            mine, own = time.process_time(), tree_cpu(server.proc.pid)
            t0, n = time.perf_counter(), 0
            for epoch in range(1, epochs + 1):
                loader.set_epoch(epoch)
                for batch in loader:
                    n += len(batch["label"])
            elapsed = time.perf_counter() - t0
            own = tree_cpu(server.proc.pid) - own
            cpu = own + time.process_time() - mine
    finally:
        code = server.stop()
    return {"clips_per_s": n / elapsed, "cpu_per_clip": cpu / n, "server_cpu_per_clip": own / n,
            "exit_code": code}


def reference_share(root: Path) -> float:
    """Of the frames of the videos under `root`, the share FFmpeg still decodes with
    `skip_frame = NONREF` (frames another frame may refer to): the most skipping can drop."""
    kept = total = 0
    for path in sorted(root.glob("*/*")):
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            total += sum(1 for p in container.demux(stream) if p.size)
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            stream.codec_context.skip_frame = "NONREF"
            kept += sum(1 for _ in container.decode(stream))
    return kept / total


def run(args: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {"benchmark": "video", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "machine": machine_info(numpy=np.__version__, av=av.__version__),
                           "parameters": dict(vars(args)), "targets": TARGETS, "rows": []}
    codes = []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])}
    with tempfile.TemporaryDirectory(prefix="stoker-video-") as tmp:
        root = Path(args.videos_dir or Path(tmp) / "videos")
        t0 = time.perf_counter()
        make_videos(root, args.videos)
        res["make_videos_s"] = time.perf_counter() - t0
        res["reference_share"] = {c: reference_share(root / c) for c in ENCODERS}
        config = write_config(Path(tmp) / "video.yaml", {"datasets": {codec: {
            "format": "video", "source": str(root / codec),
            "clip": {"frames": FRAMES, "stride": STRIDE}, "size": SIZE} for codec in ENCODERS}})
        for workers in args.workers:
            for r in range(args.repeats):
                for codec in ENCODERS:
                    row: dict[str, Any] = {"codec": codec, "workers": workers, "repeat": r}
                    # Alternating, the first system flipping each repeat.
                    order = ["peer", "stoker"] if r % 2 == 0 else ["stoker", "peer"]
                    for system in order:
                        if system == "peer":
                            row["peer"] = peer_run(root / codec, workers, args.epochs)
                        else:
                            row["stoker"] = stoker_run(config, codec, workers, args.epochs,
                                                       env)
                            codes.append(row["stoker"].pop("exit_code"))
                    row["per_core"] = row["peer"]["cpu_per_clip"] / row["stoker"]["cpu_per_clip"]
                    row["speed"] = row["stoker"]["clips_per_s"] / row["peer"]["clips_per_s"]
                    res["rows"].append(row)
                    if not args.json_only:
                        p, s = row["peer"], row["stoker"]
                        print(f"  {codec} W={workers} repeat {r}: peer {p['clips_per_s']:.1f}/s "
                              f"{1000 * p['cpu_per_clip']:.1f} ms, stoker "
                              f"{s['clips_per_s']:.1f}/s {1000 * s['cpu_per_clip']:.1f} ms "
                              f"(server {1000 * s['server_cpu_per_clip']:.1f}): per core "
                              f"{row['per_core']:.2f}x", flush=True)
    res["server_exit_code"] = max(codes, key=abs) if codes else 0
    res["summary"] = {}
    for codec in ENCODERS:
        for workers in args.workers:
            rows = [row for row in res["rows"]
                    if row["workers"] == workers and row["codec"] == codec]
            res["summary"][f"{codec} W={workers}"] = {
                "codec": codec, "workers": workers,
                **{f"{s}_{k}": summarise([row[s][k] for row in rows])
                   for s in ("peer", "stoker") for k in ("clips_per_s", "cpu_per_clip")},
                "stoker_server_cpu_per_clip": summarise(
                    [row["stoker"]["server_cpu_per_clip"] for row in rows]),
                "per_core": summarise([row["per_core"] for row in rows]),
                "speed": summarise([row["speed"] for row in rows])}
    res["meets_target"] = all(statistics.median(
        row["per_core"] for row in res["rows"] if row["codec"] == c and row["workers"] == w)
        >= TARGETS[c] for c in ENCODERS for w in args.workers)
    res["check_problems"] = []
    return res


def main(argv: list[str] | None = None) -> int:
    ap = scenario_parser(__doc__)
    ap.add_argument("--videos", type=int)
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--epochs", type=int)
    ap.add_argument("--workers", type=int, nargs="+", default=[2])
    ap.add_argument("--videos-dir", help="make the videos here, or reuse those already there")
    args = ap.parse_args(argv)
    settle(args, QUICK, FULL)
    return run_scenario(args, run)


if __name__ == "__main__":
    sys.exit(main())
