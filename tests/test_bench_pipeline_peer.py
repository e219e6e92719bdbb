"""The pipeline benchmark's DataLoader peer (benchmarks/pipeline.py, `PillowPipeline`) decodes
at a DCT scale where the crop allows it (`Image.draft`) and still gives each image's random
resized crop: the same box torchvision's draws give, resampled to what a full decode, crop
and bilinear resize give, so its figure cannot come from skipped or wrong work."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

torch = pytest.importorskip("torch")
pipeline = pytest.importorskip("pipeline", reason="benchmarks/pipeline.py needs its peers")


def _write_images(root: Path, n: int) -> None:
    """Smooth, left-right asymmetric JPEGs of 1200x900 and so, large enough that many crop
    boxes are at least twice 224 on both sides (the draft's case)."""
    folder = root / "class_000"
    folder.mkdir(parents=True)
    for i in range(n):
        h, w = 900 + 13 * i, 1200 - 17 * i
        yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
        px = np.stack([128 + 100 * np.sin(xx / 61 + i), 128 + 100 * np.sin(yy / 47 + xx / 113),
                       40 + 200 * xx / w], axis=-1)
        Image.fromarray(np.clip(px, 0, 255).astype(np.uint8)).save(folder / f"{i:03d}.jpg",
                                                                    quality=95)


def _reference(path: str, box: tuple[int, int, int, int]) -> np.ndarray:
    """torchvision's Pillow path on the same box: full decode, crop, bilinear resize."""
    left, top, w, h = box
    with Image.open(path) as im:
        out = im.convert("RGB").crop((left, top, left + w, top + h)).resize(
            (224, 224), Image.Resampling.BILINEAR)
    return np.asarray(out, dtype=np.float32)


@pytest.mark.timeout(60)
def test_dataloader_peer_decodes_at_a_dct_scale_and_keeps_each_crop(tmp_path: Path) -> None:
    _write_images(tmp_path, 6)
    ds = pipeline.PillowPipeline(tmp_path)
    drafted = 0
    for k in range(24):
        path, _ = ds.items[k % len(ds)]
        torch.manual_seed(k)
        got = np.asarray(ds.load(path), dtype=np.float32)
        torch.manual_seed(k)  # the same draws: the box the peer used
        with Image.open(path) as im:
            left, top, w, h = ds._crop(*im.size)
        drafted += w >= 448 and h >= 448
        assert got.shape == (224, 224, 3)
        diff = float(np.abs(got - _reference(path, (left, top, w, h))).mean())
        assert diff < 2, f"{path} box {(left, top, w, h)}: {diff:.2f} levels from the reference"
        # The check can fail: the box 16 px to the side is far.
        shifted = (left + 16 if left + w + 16 <= im.size[0] else left - 16, top, w, h)
        assert float(np.abs(got - _reference(path, shifted)).mean()) > 4
    assert drafted >= 4  # the DCT-scaled decode ran, not only the full one
