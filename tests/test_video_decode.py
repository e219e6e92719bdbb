"""`format: video`'s decode against a plain full decode of the same files, on the streams its
shortcuts meet (files opened without FFmpeg's probe decoder, non-reference frames skipped,
decoding stopped after the last kept frame, one scaler on one thread): VP9 from libvpx's good
deadline in WebM, H.264 with a B-pyramid in MP4, and H.264 in MPEG-TS (no global header: the
parameter sets come in the stream). Every served frame equals, byte for byte, the frame with
its timestamp from `VideoFrame.to_ndarray` after decoding the file from its start: at the
native size, and at `size:` (FFmpeg's area scaler, one pass)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

av = pytest.importorskip("av")

import video_files  # noqa: E402

from stoker.client import RemoteLoader  # noqa: E402

from conftest import StartServer  # noqa: E402

pytestmark = pytest.mark.timeout(180)

# name -> (encoder, suffix, options): 64x96, keyframes every 24 frames
STREAMS = {
    "vp9-good": ("libvpx-vp9", ".webm", {"deadline": "good", "cpu-used": "8", "g": "24"}),
    "h264-pyramid": ("libx264", ".mp4", {"preset": "ultrafast", "x264-params":
                     "bframes=3:b-pyramid=normal:keyint=24:min-keyint=24:scenecut=0"}),
    "h264-ts": ("libx264", ".ts", {"preset": "ultrafast", "x264-params":
                "bframes=2:keyint=24:min-keyint=24:scenecut=0"}),
}
FRAMES, SIZE = 60, (64, 96)


def write(path: Path, name: str, seed: int) -> Path:
    encoder, suffix, options = STREAMS[name]
    path = path.with_suffix(suffix)
    with av.open(str(path), "w") as out:
        stream = out.add_stream(encoder, rate=24, options=dict(options))
        stream.height, stream.width = SIZE
        stream.pix_fmt = "yuv420p"
        for n in range(FRAMES):
            frame = av.VideoFrame.from_ndarray(video_files.picture(*SIZE, n, seed),
                                               format="rgb24")
            frame.pts = n
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    return path


def full_decode(path: Path, **how: Any) -> dict[float, np.ndarray]:
    """time (s) -> frame: decoded from the start, no seek, FFmpeg's own conversion."""
    with av.open(str(path)) as f:
        stream = f.streams.video[0]
        return {float(fr.pts * stream.time_base): fr.to_ndarray(format="rgb24", **how)
                for fr in f.decode(stream)}


@pytest.mark.parametrize("name", [n for n, (enc, _, _) in STREAMS.items()
                                  if video_files.available(enc)])
def test_served_frames_equal_the_full_decode(tmp_path: Path, start_server: StartServer,
                                             name: str) -> None:
    root = tmp_path / "videos"
    paths = []
    for i in range(3):
        (root / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        paths.append(write(root / f"c{i % 2}" / f"v{i}", name, seed=i))
    source = {"format": "video", "source": str(root), "extensions": [".webm", ".mp4", ".ts"],
              "clip": {"frames": 8, "stride": 2}}
    server = start_server({"native": source, "sized": {**source, "size": [20, 30]}},
                          workers=2)
    for dataset, how in (("native", {}), ("sized", {"width": 30, "height": 20,
                                                    "interpolation": "AREA"})):
        refs = {str(p.relative_to(root)): full_decode(p, **how) for p in paths}
        clips = 0
        with RemoteLoader(server.address, dataset, batch_size=3, seed=5, output="numpy",
                          timeout=120) as loader:
            for epoch in range(6):  # random starts: most of each GOP's positions
                loader.set_epoch(epoch)
                for batch in loader:
                    for video, times, index in zip(batch["video"], batch["timestamps"],
                                                   batch["sample_index"], strict=True):
                        ref = refs[sorted(refs)[int(index)]]
                        frames = video.transpose(0, 2, 3, 1)  # tchw -> thwc
                        if dataset == "native":
                            h, w = SIZE
                            frames = frames[:, :h, :w]
                        for frame, t in zip(frames, times, strict=True):
                            assert np.array_equal(frame, ref[float(t)]), (name, dataset, t)
                        clips += 1
        assert clips == 6 * len(paths)
