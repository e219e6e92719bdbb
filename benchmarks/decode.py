"""CPU per image of the image decode and resample alone, on one core: the ImageNet training
crop (random_resized_crop 224, area 0.08-1, ratio 3/4-4/3, horizontal flip, uint8 HWC) of
each image, the same boxes for every row (issue 49).

    python benchmarks/decode.py                   # 200 photos 500x375 and 24 large ones
    python benchmarks/decode.py --json out.json

Sets (benchmarks/_data.py): real photographs as 500x375 JPEGs (q90), and large photos made
from the same sources at 1600x1200 and 2048x1536 (1.9 and 3.1 MP, as in COCO or
OpenImages), where DCT-domain scaling matters most. Rows, ms of thread CPU per image (best of
--repeats passes over the set):

- stoker: server/images.py's pipeline, as a worker runs it (the crop decode, stoker.server._jpeg);
- stoker before the crop decode: the whole file decoded (simplejpeg), the box resized by
  OpenCV's INTER_AREA, mirrored (what a pipeline starting with a random step did before);
- limit, full decode: libjpeg-turbo's decode of the whole file to RGB alone (simplejpeg,
  accurate IDCT; and with its fast IDCT and upsampling);
- limit, cropped decode: libjpeg-turbo's decode of the box's rows and iMCU columns alone, at
  the DCT scale the box allows (the extension with `decode_only`: no resample).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import simplejpeg
from _data import make_large_photos, make_photo_folder
from _measure import run_scenario, scenario_parser, settle

from stoker.server import _jpeg
from stoker.server.images import ImagePipeline, rrc_box
from stoker.server.pool.malloc import keep_freed_memory

OUT = 224
SCALE, RATIO = (0.08, 1.0), (3 / 4, 4 / 3)


class _Args:
    size, scale, ratio, p = OUT, SCALE, RATIO, 0.5


def jobs(root: Path) -> list[tuple[bytes, tuple[int, int, int, int], bool, int]]:
    """(jpeg, box, flip, seed) per image: the draws the pipeline makes for it with `seed`."""
    out = []
    for i, path in enumerate(sorted(root.rglob("*.jpg"))):
        data = path.read_bytes()
        height, width, _, _ = simplejpeg.decode_jpeg_header(data)
        rng = np.random.default_rng(i)
        left, top, w, h = rrc_box(width, height, SCALE, RATIO, rng)
        out.append((data, (left, top, left + w, top + h), bool(rng.random() < 0.5), i))
    return out


def rows(work: list[tuple[bytes, tuple[int, int, int, int], bool, int]]
         ) -> dict[str, Callable[[], None]]:
    pipeline = ImagePipeline([("random_resized_crop", _Args()), ("horizontal_flip", _Args())],
                             "hwc")
    out = np.empty((OUT, OUT, 3), np.uint8)

    def stoker() -> None:
        for data, _, _, seed in work:
            pipeline(data, np.random.default_rng(seed))

    def before() -> None:
        for data, (x0, y0, x1, y1), flip, _ in work:
            pixels = simplejpeg.decode_jpeg(data, colorspace="RGB")
            small = cv2.resize(pixels[y0:y1, x0:x1], (OUT, OUT), interpolation=cv2.INTER_AREA)
            np.ascontiguousarray(small[:, ::-1] if flip else small)

    def full() -> None:
        for data, _, _, _ in work:
            simplejpeg.decode_jpeg(data, colorspace="RGB")

    def full_fast() -> None:
        for data, _, _, _ in work:
            simplejpeg.decode_jpeg(data, colorspace="RGB", fastdct=True, fastupsample=True)

    def cropped() -> None:
        for data, box, _, _ in work:
            _jpeg.decode_crop(data, box, out, decode_only=True)

    return {"stoker (crop decode + resample + flip)": stoker,
            "stoker before the crop decode (whole decode, OpenCV area)": before,
            "limit: libjpeg-turbo full decode": full,
            "limit: libjpeg-turbo full decode, fast IDCT and upsampling": full_fast,
            "limit: libjpeg-turbo cropped decode (rows, iMCU columns, DCT scale)": cropped}


def measure(work: list[Any], repeats: int) -> dict[str, float]:
    """ms of this thread's CPU per image, best of `repeats` passes, rows interleaved."""
    best: dict[str, float] = {}
    for _ in range(repeats):
        for name, run in rows(work).items():
            start = time.thread_time()
            run()
            ms = (time.thread_time() - start) / len(work) * 1e3
            best[name] = min(best.get(name, ms), ms)
    return best


FULL = {"images": 200, "large": 24, "repeats": 5}
QUICK = {"images": 40, "large": 6, "repeats": 2}


def run(args: argparse.Namespace) -> dict[str, Any]:
    cv2.setNumThreads(1)
    keep_freed_memory()  # as a worker does: freed buffers are reused, not faulted in again
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="stoker-decode-") as tmp:
        small, large = Path(tmp) / "small", Path(tmp) / "large"
        make_photo_folder(small, args.images)
        make_large_photos(large, args.large)
        for name, root in (("500x375", small), ("large (1.9-3.1 MP)", large)):
            work = jobs(root)
            results[name] = {"images": len(work), "mean_jpeg_bytes":
                             float(np.mean([len(w[0]) for w in work])),
                             "ms_per_image": measure(work, args.repeats)}
    return {"parameters": {k: getattr(args, k) for k in FULL}, "sets": results}


def section(r: dict[str, Any], plots: Any = None) -> list[str]:
    """The benchmark page's section: CPU ms per image of each row, per set."""
    p = r["parameters"]
    lines = ["The decode and resample alone, on one core (thread CPU, best of "
             f"{p['repeats']} passes, rows interleaved): the ImageNet training crop "
             "(random_resized_crop 224, area 0.08-1, ratio 3/4-4/3, flip, uint8 HWC) of each "
             "image, the same boxes for every row. The limit rows are libjpeg-turbo's decode "
             "alone, of the whole file and of the crop's rows and iMCU columns at the DCT scale "
             "the box allows.", "",
             "| set | images | mean JPEG KiB | row | CPU ms per image |",
             "| --- | --- | --- | --- | --- |"]
    for name, s in r["sets"].items():
        for row, ms in s["ms_per_image"].items():
            lines.append(f"| {name} | {s['images']} | {s['mean_jpeg_bytes'] / 1024:.0f} | "
                         f"{row} | {ms:.3f} |")
    return [*lines, ""]


def main(argv: list[str] | None = None) -> int:
    ap = scenario_parser(__doc__)
    ap.add_argument("--images", type=int, help="in the 500x375 set")
    ap.add_argument("--large", type=int, help="in the large set")
    ap.add_argument("--repeats", type=int)
    args = ap.parse_args(argv)
    settle(args, QUICK, FULL)
    return run_scenario(args, run)


if __name__ == "__main__":
    sys.exit(main())
