"""A tiny video classifier trained from a data server: `format: video` decodes the clips.

    python examples/video.py [--epochs 8] [--workers 2] [--data DIR]

Writes 64 short H.264 videos (a bright square moving left in one class, right in the other:
only the motion tells them apart) and a server config serving them as random clips of 8
frames (every 2nd), starts `stoker serve` as a child process, and trains a small 3D CNN from
a RemoteLoader (on CUDA when present: the loader lands each batch on the GPU). Exits
non-zero unless the loss fell (last epoch's mean < 0.7 x the first's) and the server shut
down cleanly.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import av
import numpy as np
import torch
from torch import nn

from stoker.client import RemoteLoader
from stoker.server import ServerProcess, write_config

SIZE, FRAMES, VIDEOS = 32, 24, 64
LOSS_RATIO = 0.7


def make_videos(root: Path) -> None:
    """VIDEOS videos of FRAMES frames: class `left` and class `right`, a square crossing the
    picture 1 px per frame (both classes pass every place: only the motion differs), on
    noise."""
    for i in range(VIDEOS):
        cls = ("left", "right")[i % 2]
        (root / cls).mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(i)
        y = int(rng.integers(0, SIZE - 8))
        with av.open(str(root / cls / f"{i:03d}.mp4"), "w") as out:
            stream = out.add_stream("libx264", rate=24, options={"preset": "ultrafast"})
            stream.width = stream.height = SIZE
            stream.pix_fmt = "yuv420p"
            for k in range(FRAMES):
                pixels = rng.integers(0, 40, (SIZE, SIZE, 3), dtype=np.uint8)
                left = SIZE - 8 - k if cls == "left" else k
                pixels[y:y + 8, left:left + 8] = 230
                frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
                frame.pts = k
                out.mux(stream.encode(frame))
            out.mux(stream.encode(None))


def model() -> nn.Module:
    return nn.Sequential(
        nn.Conv3d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool3d(2),
        nn.Conv3d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool3d(1),
        nn.Flatten(), nn.Linear(32, 2))


def train(address: str, args: argparse.Namespace) -> list[float]:
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"training on {device}")
    net = model().to(device)
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    losses = []
    # layout cthw: [batch, 3, T, H, W], what Conv3d takes
    with RemoteLoader(address, "moves", batch_size=8, seed=1, device=device,
                      timeout=120) as loader:
        for epoch in range(args.epochs):
            loader.set_epoch(epoch)
            total, n, t0 = 0.0, 0, time.perf_counter()
            for batch in loader:
                clips = batch["video"].float() / 255.0
                loss = nn.functional.cross_entropy(net(clips), batch["label"])
                opt.zero_grad()
                loss.backward()
                opt.step()
                total, n = total + loss.item(), n + 1
            losses.append(total / n)
            print(f"epoch {epoch}: loss {losses[-1]:.3f} ({n} batches, "
                  f"{time.perf_counter() - t0:.1f} s)", flush=True)
    return losses


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--data", type=Path, help="where to write the videos (default: a temp dir)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="stoker-video-example-") as tmp:
        root = args.data or Path(tmp)
        make_videos(root / "videos")
        config = write_config(root / "stoker.yaml", {"datasets": {"moves": {
            "format": "video", "source": str(root / "videos"),
            "clip": {"frames": 8, "stride": 2}, "layout": "cthw"}}})
        server = ServerProcess(config, workers=args.workers).start()
        try:
            losses = train(server.address, args)
        finally:
            code = server.stop()
    fell = losses[-1] < LOSS_RATIO * losses[0]
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} ({'fell' if fell else 'did NOT fall'}); "
          f"server exit code {code}")
    return 0 if fell and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
