"""SPDL as a peer: the image training pipeline written the way SPDL's own docs write it.

Meta's SPDL (`spdl`, `spdl-io`, `spdl-core`, 0.8; they load Debian's FFmpeg 5.1 shared
libraries) runs a pipeline on a thread pool in the training process: FFmpeg decodes and
filters with the GIL released, so threads scale where Python code would not. Following its
"Best Practices" page and its multi_thread_preprocessing example:

    PipelineBuilder()
      .add_source(this epoch's shuffled indices)
      .pipe(decode, concurrency=T)      # demux_image + decode_packets(filter_desc=...)
      .aggregate(batch_size, drop_last=True)
      .pipe(collate)                    # convert_frames: ONE buffer per batch, then torch
      .add_sink(prefetch)
      .build(num_threads=T, max_failures=0)

`decode` runs the whole per-image work in one FFmpeg filter graph, as SPDL's filtering guide
does augmentation: crop (the random resized crop's box, picked as torchvision picks it, from
a generator seeded by (seed, epoch, index)), scale to 224x224 bilinear (swscale widens its
filter when shrinking, so it is antialiased like Pillow's and OpenCV's area resample), hflip
(p 0.5), rgb24. No per-image tensor is made. `collate` turns the batch's frames into one
uint8 NHWC buffer (spdl.io.convert_frames), views it as a tensor (spdl.io.to_torch) and
writes float32 NCHW normalized with ImageNet's mean/std: the same batch the other systems
deliver (contiguous float32 (B, 3, 224, 224), int64 labels), plus the int64 `sample_index`
stoker adds to every batch (which image each row is: batches come in completion order).

`max_failures=0`: SPDL's pipeline drops items that fail by default; a benchmark must not
measure fewer images than it counts, so any failure stops the epoch with its error.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from functools import cache, partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _data import MEAN, STD
from PIL import Image

from stoker.server.images import rrc_box

SCALE, RATIO = (0.08, 1.0), (3 / 4, 4 / 3)  # RandomResizedCrop's defaults, as pipeline.py


@cache
def unavailable() -> str | None:
    """Why SPDL cannot run here, or None when it can: it decodes one small JPEG. (spdl.io
    loads its FFmpeg extension lazily: the import alone succeeds without the libraries.)"""
    try:
        import spdl.io
        import spdl.pipeline

        jpeg = io.BytesIO()
        Image.new("RGB", (16, 8), (200, 30, 30)).save(jpeg, "JPEG")
        spdl.io.decode_packets(spdl.io.demux_image(jpeg.getvalue()))
    except Exception as e:  # ImportError, or RuntimeError when FFmpeg's libraries are missing
        return (f"spdl is not importable ({type(e).__name__}: {e}); pip install -e "
                "'.[bench]' and apt-get install libavcodec59 libavformat59 libavfilter8 "
                "libavutil57 libavdevice59")
    return None


def spdl_version() -> str:
    from importlib.metadata import version

    return version("spdl")


def plan(width: int, height: int, seed: int, epoch: int, index: int
         ) -> tuple[tuple[int, int, int, int], bool]:
    """The random resized crop box (left, top, w, h) and the flip of one sample: a pure
    function of (seed, epoch, index), so batches do not depend on thread timing."""
    rng = np.random.default_rng([seed, epoch, index])
    box = rrc_box(width, height, SCALE, RATIO, rng)
    return box, bool(rng.random() < 0.5)


def filter_desc(box: tuple[int, int, int, int], flip: bool, size: int) -> str:
    """crop -> scale (bilinear) -> [hflip] -> rgb24, as one FFmpeg filter graph. The crop
    comes first so that scaling touches only the box's pixels; swscale converts to rgb24 in
    the same pass."""
    import spdl.io

    left, top, w, h = box
    steps = [f"crop={w}:{h}:{left}:{top}", f"scale={size}:{size}:flags=bilinear"]
    if flip:
        steps.append("hflip")
    return spdl.io.get_video_filter_desc(filter_desc=",".join(steps), pix_fmt="rgb24")


class SpdlImageLoader:
    """One epoch per `iter()`: a fresh SPDL pipeline over this epoch's shuffled order.

    A pipeline is built per epoch (threads start in well under the first batch's time, which
    is timed apart) rather than kept running with a continuous source: a running pipeline
    would decode the next epoch's first batches while other systems are being timed.
    """

    def __init__(self, root: Path, batch_size: int, threads: int, seed: int = 0,
                 size: int = 224, prefetch: int = 3) -> None:
        classes = sorted(p.name for p in Path(root).iterdir() if p.is_dir())
        self.items = [(str(f), c) for c, name in enumerate(classes)
                      for f in sorted((Path(root) / name).glob("*.jpg"))]
        if len(self.items) < batch_size:
            raise ValueError(f"{root} holds {len(self.items)} JPEGs, fewer than one batch "
                             f"of {batch_size}")
        self.batch_size, self.threads, self.seed = batch_size, threads, seed
        self.size, self.prefetch = size, prefetch
        self.epoch = 0
        # (x / 255 - mean) / std == (x - 255 mean) / (255 std), per channel
        self._mean = torch.tensor([255 * m for m in MEAN]).view(1, 3, 1, 1)
        self._std = torch.tensor([255 * s for s in STD]).view(1, 3, 1, 1)

    def __len__(self) -> int:
        return len(self.items) // self.batch_size  # drop_last

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _decode(self, epoch: int, index: int) -> tuple[Any, int, int]:
        import spdl.io

        path, label = self.items[index]
        packets = spdl.io.demux_image(path)
        box, flip = plan(packets.width, packets.height, self.seed, epoch, index)
        frames = spdl.io.decode_packets(packets, filter_desc=filter_desc(box, flip, self.size))
        return frames, label, index

    def _collate(self, items: list[tuple[Any, int, int]]) -> dict[str, torch.Tensor]:
        import spdl.io

        frames, labels, indices = zip(*items, strict=True)
        nhwc = spdl.io.to_torch(spdl.io.convert_frames(list(frames)))  # uint8, one buffer
        image = nhwc.permute(0, 3, 1, 2).to(torch.float32, memory_format=torch.contiguous_format)
        return {"image": image.sub_(self._mean).div_(self._std),
                "label": torch.tensor(labels, dtype=torch.int64),
                "sample_index": torch.tensor(indices, dtype=torch.int64)}

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        from spdl.pipeline import PipelineBuilder

        order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.items))
        pipeline = (PipelineBuilder()
                    .add_source(order.tolist())
                    .pipe(partial(self._decode, self.epoch), concurrency=self.threads)
                    .aggregate(self.batch_size, drop_last=True)
                    .pipe(self._collate)
                    .add_sink(self.prefetch)
                    .build(num_threads=self.threads, max_failures=0))
        with pipeline.auto_stop():
            yield from pipeline.get_iterator()
