"""A small real image dataset on disk: coloured shapes over noisy backgrounds, one folder a class.

    python examples/shapes.py DIR [--per-class N] [--size PX] [--seed S]

The layout is what `format: image-folder` serves: DIR/circle/00000.jpg, DIR/square/..., so the
demo exercises the real path (files -> JPEG decode -> resize -> batch). Every image comes from a
generator seeded by (seed, class, index): the same arguments give the same files.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

CLASSES = ("circle", "cross", "square", "triangle")
MARKER = ".complete"


def _colour(rng: np.random.Generator) -> tuple[int, int, int]:
    r, g, b = rng.integers(0, 256, size=3)
    return int(r), int(g), int(b)


def _background(rng: np.random.Generator, size: int) -> Image.Image:
    """A random two-colour gradient plus per-pixel noise: colour alone never tells the class."""
    a, b = rng.integers(0, 256, size=(2, 3)).astype(np.float32)
    t = np.linspace(0.0, 1.0, size, dtype=np.float32)
    ramp = t[:, None] if rng.random() < 0.5 else t[None, :]
    img = a + (b - a) * ramp[..., None]
    img = img + rng.normal(0.0, 25.0, size=(size, size, 3))
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), "RGB")


def _draw(draw: ImageDraw.ImageDraw, shape: str, rng: np.random.Generator, size: int) -> None:
    """One shape at a random centre and extent (30 to 70 % of the image), in a random colour."""
    r = rng.uniform(0.15, 0.35) * size
    cx, cy = rng.uniform(r, size - r, size=2)
    fill = _colour(rng)
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        draw.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "triangle":
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    elif shape == "cross":
        w = r / 3
        draw.rectangle([cx - r, cy - w, cx + r, cy + w], fill=fill)
        draw.rectangle([cx - w, cy - r, cx + w, cy + r], fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}")


def make_shapes(root: Path, per_class: int = 300, size: int = 64, seed: int = 0) -> Path:
    """Write `per_class` JPEGs of `size`x`size` pixels for each of CLASSES under `root`.

    Skips the work when `root` already holds a complete set made with the same arguments (a
    marker file, written last, records them); otherwise rebuilds `root` from scratch.
    """
    root = Path(root)
    params = {"classes": list(CLASSES), "per_class": per_class, "size": size, "seed": seed}
    marker = root / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == params:
        return root
    if root.exists():
        shutil.rmtree(root)
    for label, shape in enumerate(CLASSES):
        folder = root / shape
        folder.mkdir(parents=True)
        for i in range(per_class):
            rng = np.random.default_rng([seed, label, i])
            img = _background(rng, size)
            _draw(ImageDraw.Draw(img), shape, rng, size)
            img.save(folder / f"{i:05d}.jpg", quality=90)
    marker.write_text(json.dumps(params))
    return root


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="folder to write (one sub-folder per class)")
    parser.add_argument("--per-class", type=int, default=300)
    parser.add_argument("--size", type=int, default=64, help="image side in pixels")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    root = make_shapes(args.root, args.per_class, args.size, args.seed)
    print(f"{root}: {len(CLASSES)} classes x {args.per_class} images")


if __name__ == "__main__":
    main()
