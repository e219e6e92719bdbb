"""Datasets the benchmarks generate (nothing is downloaded): deterministic in their arguments."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

# The image pipeline of the pipeline, sweep and prefix_cache scenarios (torchvision's
# ImageNet statistics).
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
TRANSFORMS = [{"random_resized_crop": {"size": 224}}, {"horizontal_flip": {"p": 0.5}},
              {"normalize": {"mean": list(MEAN), "std": list(STD)}}]
# A --transport label -> the RemoteLoader arguments that make exactly that transport carry the
# batches on one host, and the name stats()["transport"] gives it. Each label turns the others
# off: on the same host a data connection is offered and wins over shared memory
# (server/front/handshake.py), so shared memory alone is `data_socket=False`.
TRANSPORTS = {"shm": {"shared_memory": True, "data_socket": False},
              "grpc": {"shared_memory": False, "data_socket": False},
              "socket": {"shared_memory": False, "data_socket": True}}
RAN_AS = {"shm": "shm", "grpc": "frames", "socket": "data_socket"}


def transport_ran(label: str, loaders: dict[str, Any], problems: list[str]) -> dict[str, str]:
    """Which transport carried each loader's batches (its stats()["transport"], read before
    it closes); one problem per loader whose transport is not the one `label` asked for."""
    ran = {name: loader.stats()["transport"] for name, loader in loaders.items()}
    problems += [f"{name}: --transport {label} asked, batches came by {got}"
                 for name, got in ran.items() if got != RAN_AS[label]]
    return ran


def make_image_folder(root: Path, images: int, classes: int, source_size: int,
                      seed: int = 0, shape: tuple[int, int] | None = None) -> None:
    """Write `images` JPEGs into `classes` class folders under `root`.

    Each image is a class-coloured gradient plus Gaussian noise, its height and width drawn
    from [0.75, 1.25] x source_size (or, given `shape` (height, width), from 0.9 to 1.1 times
    it, e.g. ImageNet's typical 375x500): noise keeps the JPEG entropy (and so the decode cost)
    close to a photo's, and unequal sizes make the resize do real work on every image.
    Deterministic in (images, classes, source_size, seed).
    """
    rng = np.random.default_rng(seed)
    colours = rng.uniform(40, 215, size=(classes, 3))
    lo, hi = int(source_size * 0.75), int(source_size * 1.25)
    if shape is not None:
        bounds = [(int(v * 0.9), int(v * 1.1)) for v in shape]
    for c in range(classes):
        (root / f"class_{c:03d}").mkdir(parents=True, exist_ok=True)
    for i in range(images):
        c = i % classes
        r = np.random.default_rng([seed, i])
        if shape is None:
            h, w = (int(v) for v in r.integers(lo, hi + 1, size=2))
        else:
            h, w = (int(r.integers(a, b + 1)) for a, b in bounds)
        yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
        direction = r.uniform(-1, 1, size=(2, 3)).astype(np.float32)
        ramp = (yy[..., None] / h) * direction[0] + (xx[..., None] / w) * direction[1]
        pixels = colours[c] + 60 * ramp + r.normal(0, 24, size=(h, w, 3))
        img = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")
        img.save(root / f"class_{c:03d}" / f"{i:06d}.jpg", quality=90)


# Real photographs, from what the dev extra's packages ship (nothing is downloaded):
# scikit-image's sample data, scikit-learn's two sample images, matplotlib's Grace Hopper.
PHOTO_SOURCES = ("astronaut", "chelsea", "coffee", "rocket", "immunohistochemistry",
                 "motorcycle_left", "motorcycle_right", "hubble_deep_field", "china", "flower",
                 "grace_hopper")


def photo_sources() -> list[np.ndarray]:
    """The source photographs (uint8 RGB, 300-1000 pixels a side), in PHOTO_SOURCES' order."""
    import matplotlib.cbook
    import skimage.data
    from sklearn.datasets import load_sample_images

    sk = {"motorcycle_left": lambda: skimage.data.stereo_motorcycle()[0],
          "motorcycle_right": lambda: skimage.data.stereo_motorcycle()[1]}
    china, flower = load_sample_images().images
    out = []
    for name in PHOTO_SOURCES:
        if name in sk:
            img = sk[name]()
        elif name == "china":
            img = china
        elif name == "flower":
            img = flower
        elif name == "grace_hopper":
            with matplotlib.cbook.get_sample_data("grace_hopper.jpg") as f:
                img = np.asarray(Image.open(f).convert("RGB"))
        else:
            img = getattr(skimage.data, name)()
        out.append(np.ascontiguousarray(img[..., :3], dtype=np.uint8))
    return out


def _photo_view(sources: list[np.ndarray], shape: tuple[int, int],
                r: np.random.Generator) -> Image.Image:
    """A `shape` (height, width) view of one source photo: scaled by 1-1.3x what fits it, a
    random window of that, mirrored half the time."""
    src = sources[int(r.integers(len(sources)))]
    h, w = shape
    fit = max(h / src.shape[0], w / src.shape[1])
    scale = fit * float(r.uniform(1.0, 1.3))
    sw, sh = max(w, round(src.shape[1] * scale)), max(h, round(src.shape[0] * scale))
    img = Image.fromarray(src).resize((sw, sh), Image.Resampling.LANCZOS)
    x, y = int(r.integers(sw - w + 1)), int(r.integers(sh - h + 1))
    img = img.crop((x, y, x + w, y + h))
    return img.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if r.random() < 0.5 else img


def make_photo_folder(root: Path, images: int, classes: int = 10, seed: int = 0,
                      shape: tuple[int, int] = (375, 500), tiles: tuple[int, int] = (1, 1)
                      ) -> None:
    """Write `images` JPEGs (q90) of real photographs into `classes` class folders under
    `root`: each a `shape` (height, width) view of a source photo (photo_sources), or with
    `tiles` (rows, cols) a mosaic of that many views, for sizes beyond the sources' own.
    Deterministic in its arguments (and the packages' sample data)."""
    sources = photo_sources()
    h, w = shape
    th, tw = h // tiles[0], w // tiles[1]
    for c in range(classes):
        (root / f"class_{c:03d}").mkdir(parents=True, exist_ok=True)
    for i in range(images):
        r = np.random.default_rng([seed, i])
        img = Image.new("RGB", (w, h))
        for ty in range(tiles[0]):
            for tx in range(tiles[1]):
                ph = th if ty < tiles[0] - 1 else h - th * ty
                pw = tw if tx < tiles[1] - 1 else w - tw * tx
                img.paste(_photo_view(sources, (ph, pw), r), (tx * tw, ty * th))
        c = i % classes
        img.save(root / f"class_{c:03d}" / f"{i:06d}.jpg", quality=90)


# The large image set (issue 49): photos of 1.9 and 3.1 megapixels, as in COCO or OpenImages,
# where decoding a crop at a DCT scale matters most; mosaics of 3x3 views of the sources
# (the sources are 0.1-0.9 MP: one view would be mostly upsampled).
LARGE_SHAPES = ((1200, 1600), (1536, 2048))


def make_large_photos(root: Path, images: int, classes: int = 10, seed: int = 0) -> None:
    """`images` JPEGs (q90) of real photographs, half 1600x1200 and half 2048x1536 (exactly:
    1.92 and 3.15 MP), in `classes` class folders under `root`."""
    for k, shape in enumerate(LARGE_SHAPES):
        part = root / f"part{k}"
        n = images // 2 + (images % 2 if k == 0 else 0)
        make_photo_folder(part, n, classes, seed=seed + 10 + k, shape=shape, tiles=(3, 3))
        for path in sorted(part.rglob("*.jpg")):
            (root / path.parent.name).mkdir(parents=True, exist_ok=True)
            path.rename(root / path.parent.name / f"{k}{path.name}")
        for folder in sorted(part.iterdir()):
            folder.rmdir()
        part.rmdir()
