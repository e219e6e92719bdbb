"""Image decoding and the `transforms:` pipeline of image datasets.

Decoding: every pixel is the one Pillow's `Image.open(f).convert("RGB")` gives (what
torchvision's ImageFolder loader does), before any resampling. JPEGs in YCbCr, grayscale or
RGB go through libjpeg-turbo: the system's, through this package's extension (server/_jpeg.c,
`stoker.server._jpeg`) where a box is resampled, else simplejpeg's (bundled in its wheel;
10-20% faster than Pillow's decoder, docs/design.md#images); both with the accurate IDCT and
fancy upsampling, Pillow's pixels. CMYK and YCCK JPEGs, whose colour space the header names,
go to Pillow: simplejpeg converts them itself, 0-2 levels off Pillow's conversion. Every other
format (PNG, GIF, BMP, WebP, TIFF...) and any JPEG the decoders refuse goes to Pillow too. All
release the GIL while they decode. So: alpha (LA, RGBA, PA, a palette's transparency) is
dropped, not composited; grayscale and palette images become three equal or looked-up
channels; 16-bit grayscale is clipped at 255 (Pillow's I;16 -> RGB rule) and 16-bit RGB keeps
its high byte; EXIF orientation is not applied.

Geometry is planned before any pixel is touched: `resize`, `center_crop` and
`random_resized_crop` compose into one box in the source image and one output size, so the
image is resampled once instead of once per step. A JPEG is then decoded for the box, not the
file (the extension, one call): only the rows and the iMCU columns the resample reads are
decoded (libjpeg-turbo's jpeg_skip_scanlines and jpeg_crop_scanline; the decode stops after
the last row), at 1/2, 1/4 or 1/8 scale in the DCT domain when the box is at least that much
larger than the output on both sides, and resampled in the same call, mirrored there when
`horizontal_flip` says so, into the output array (CHW or HWC). The resample is antialiased
when it shrinks: each output pixel averages its footprint in the box (Pillow's BOX footprint
at full scale, the exact area after a DCT scale), in 14-bit fixed point with SIMD, uint8 in
and out; bilinear when enlarging or with `antialias: false`. Against an accurate decode and
an exact area average of the same box it measured 41.6 dB where boxes shrink 2x or more
(tf.data's bilinear: 34.7), 53-62 dB below that (tf.data: 36-39; tests/test_crop_decode.py).
Other images, and every image without the extension (not built, or STOKER_JPEG_CROP=0), are
decoded whole (at the DCT scale the box allows) and resampled by OpenCV (SIMD; area-averaging
when shrinking), as before the extension: the fingerprint says which (order/fingerprint.py:
`+jpeg-crop-1`), so servers that decode differently are not mixed. `normalize` writes float
CHW straight from the uint8 pixels, one pass per channel.

A pipeline whose first step is random (`random_resized_crop`, `horizontal_flip`) is planned
whole on the source and decoded for its box, as above. Otherwise it is cut at its first random
step: the prefix (the decode and the `resize` and `center_crop` steps listed before it) is
planned, decoded for its box and resampled as above, into uint8 pixels; the rest is planned
on those pixels and resampled once more, by the same resample. The prefix depends on the image
alone, so the server may keep its pixels across epochs and jobs (cache.decoded_bytes,
server/sources/prefix_cache.py). With that cache, a pipeline whose first step is random keeps
the whole decoded image (the full decode stays: a random crop is taken from the kept pixels)
and, beside it, the image decoded at each DCT scale the crop decode could pick for it, so that
the output is bit-identical with the cache on or off. `normalize` is never in the prefix:
uint8 pixels are a quarter of float32's bytes, and it costs one pass.

Randomness comes only from the generator passed in, which the server seeds from (seed, epoch,
sample index): the same sample in the same epoch is augmented identically everywhere, with the
same draws (and so the same boxes) whichever way it is decoded.
"""

from __future__ import annotations

import functools
import io
import logging
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import cv2
import numpy as np
import simplejpeg
from PIL import Image

from .formats.samples import padded

# STOKER_JPEG_CROP=0 keeps the whole-file decode of servers before the crop decode (and their
# fingerprints): a rolling upgrade's new servers can serve beside the old ones until the last
# old one is gone (docs/operations.md).
CROP_ENV = "STOKER_JPEG_CROP"
try:  # built by the project's install (pyproject.toml, ext-modules); optional
    from . import _jpeg
except ImportError:  # pragma: no cover - a build without a compiler or libjpeg's headers
    _jpeg = None
if os.environ.get(CROP_ENV, "1") == "0":
    _jpeg = None

log = logging.getLogger("stoker.server")

# Workers are processes, one per core: OpenCV's own thread pool would only compete with them.
cv2.setNumThreads(1)

JPEG_MAGIC = b"\xff\xd8\xff"
JPEG_END = b"\xff\xd9"  # a file cut short lacks it: the crop decode may stop before the cut
# What servers agree on beyond the data (order/fingerprint.py): a change to the bytes a
# pipeline gives for the same file and coordinates is a new version here.
CROP_DECODE = f"jpeg-crop-{_jpeg.VERSION}" if _jpeg is not None else ""

DCT_FACTORS = (8, 4, 2)  # the scales libjpeg decodes to cheaply, largest first


@dataclass
class _Plan:
    """Where the output comes from: `box` (x0, y0, x1, y1) in source pixels, the size the
    steps so far would have produced (`width`, `height`), and whether it is mirrored."""

    box: tuple[float, float, float, float]
    width: int
    height: int
    flip: bool = False

    def crop(self, left: int, top: int, w: int, h: int) -> None:
        """Crop (left, top, w, h) of the current virtual image (as the user sees it)."""
        if self.flip:  # the user sees a mirrored image: the crop is mirrored in the source
            left = self.width - left - w
        x0, y0, x1, y1 = self.box
        sx, sy = (x1 - x0) / self.width, (y1 - y0) / self.height
        self.box = (x0 + left * sx, y0 + top * sy, x0 + (left + w) * sx, y0 + (top + h) * sy)
        self.width, self.height = w, h


def _size(v: Any) -> tuple[int, int]:
    """(height, width) from an int (square) or a pair."""
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


# A geometry step: deterministic steps (the prefix's) are given no generator.
def _resize(plan: _Plan, args: Any, rng: np.random.Generator | None) -> None:
    if isinstance(args.size, int):  # shorter side -> size, as torchvision's Resize(int)
        short, long_ = sorted((plan.width, plan.height))
        other = int(args.size * long_ / short)
        plan.width, plan.height = ((args.size, other) if plan.width <= plan.height
                                   else (other, args.size))
    else:
        plan.height, plan.width = _size(args.size)


def _center_crop(plan: _Plan, args: Any, rng: np.random.Generator | None) -> None:
    h, w = _size(args.size)
    if h > plan.height or w > plan.width:
        raise ValueError(f"center_crop {h}x{w} is larger than the image ({plan.height}x"
                         f"{plan.width} at that step): resize first")
    plan.crop(round((plan.width - w) / 2), round((plan.height - h) / 2), w, h)


def rrc_box(width: int, height: int, scale: Sequence[float], ratio: Sequence[float],
            rng: np.random.Generator) -> tuple[int, int, int, int]:
    """(left, top, w, h) of a random resized crop, as torchvision's RandomResizedCrop picks
    it: area fraction uniform in `scale`, aspect ratio log-uniform in `ratio`, ten tries, then
    the central crop clamped to the ratio range."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(*log_ratio))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return left, top, w, h
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, round(width / min(ratio))
    elif in_ratio > max(ratio):
        h, w = height, round(height * max(ratio))
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def _random_resized_crop(plan: _Plan, args: Any, rng: np.random.Generator | None) -> None:
    assert rng is not None  # a random step is never in the prefix
    plan.crop(*rrc_box(plan.width, plan.height, args.scale, args.ratio, rng))
    plan.height, plan.width = _size(args.size)


def _horizontal_flip(plan: _Plan, args: Any, rng: np.random.Generator | None) -> None:
    assert rng is not None  # a random step is never in the prefix
    if rng.random() < args.p:
        plan.flip = not plan.flip


_GEOMETRY = {"resize": _resize, "center_crop": _center_crop,
             "random_resized_crop": _random_resized_crop, "horizontal_flip": _horizontal_flip}


# JPEG colour spaces (as the header names them) that simplejpeg decodes to Pillow's pixels.
SIMPLEJPEG_COLORSPACES = frozenset({"YCbCr", "Gray", "RGB"})


def _source_size(data: bytes) -> tuple[int, int, bool]:
    """(width, height, whether simplejpeg decodes it) read from the header, without
    decoding."""
    if data[:3] == JPEG_MAGIC:
        try:
            height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
        except ValueError:
            pass  # Pillow will say what is wrong with it, or decode what simplejpeg cannot
        else:
            if colorspace in SIMPLEJPEG_COLORSPACES:
                return width, height, True
    with Image.open(io.BytesIO(data)) as img:
        return img.width, img.height, False


def _decode(data: bytes, width: int, height: int, jpeg: bool, factor: int) -> np.ndarray:
    """RGB uint8 HWC, at 1/factor of the source size or a little more (JPEG DCT scaling)."""
    if jpeg:
        try:
            return simplejpeg.decode_jpeg(data, colorspace="RGB",
                                          min_height=-(-height // factor),
                                          min_width=-(-width // factor))
        except ValueError:
            pass  # Pillow decodes it, or says what is wrong with it
    with Image.open(io.BytesIO(data)) as img:
        if factor > 1:
            img.draft("RGB", (-(-width // factor), -(-height // factor)))
        # Transparency changes no RGB pixel; kept, a palette's per-entry alpha makes Pillow warn.
        img.info.pop("transparency", None)
        return np.asarray(img.convert("RGB"))


def decode_rgb(data: bytes) -> np.ndarray:
    """Encoded image bytes -> RGB uint8 HWC at full size: exactly Pillow's
    `Image.open(...).convert("RGB")` pixels, faster for most JPEGs (see the module's
    docstring)."""
    width, height, jpeg = _source_size(data)
    return _decode(data, width, height, jpeg, 1)


def _render(data: bytes, width: int, height: int, jpeg: bool, plan: _Plan,
            antialias: bool) -> np.ndarray:
    """`plan`'s box of the image, resampled once to its size (not mirrored): decoded at the
    largest DCT scale that still leaves the box at least as large as the output."""
    x0, y0, x1, y1 = plan.box
    factor = next((f for f in DCT_FACTORS if (x1 - x0) / f >= plan.width
                   and (y1 - y0) / f >= plan.height), 1)
    pixels = _decode(data, width, height, jpeg, factor)
    sx, sy = pixels.shape[1] / width, pixels.shape[0] / height
    return _resample(pixels, (x0 * sx, y0 * sy, x1 * sx, y1 * sy), plan.width, plan.height,
                     antialias)


@functools.cache
def _say_no_extension() -> None:
    if os.environ.get(CROP_ENV, "1") == "0":
        log.warning("%s=0: JPEGs are decoded whole, then cropped (the decode of servers before"
                    " the crop decode, whose fingerprints this server's match)", CROP_ENV)
        return
    log.warning("stoker.server._jpeg is not built (no compiler or libjpeg headers at install):"
                " JPEGs are decoded whole, then cropped; install gcc and libjpeg62-turbo-dev "
                "and reinstall stoker for the crop decode")


def _resample(pixels: np.ndarray, box: tuple[float, float, float, float], width: int,
              height: int, antialias: bool) -> np.ndarray:
    """The `box` of `pixels` (rounded to whole pixels) resized to width x height."""
    rows, cols = pixels.shape[:2]
    x0, y0 = min(round(box[0]), cols - 1), min(round(box[1]), rows - 1)
    x1, y1 = max(min(round(box[2]), cols), x0 + 1), max(min(round(box[3]), rows), y0 + 1)
    crop = pixels[y0:y1, x0:x1]
    if crop.shape[:2] == (height, width):
        return crop
    shrink = antialias and x1 - x0 >= width and y1 - y0 >= height
    return cv2.resize(crop, (width, height),
                      interpolation=cv2.INTER_AREA if shrink else cv2.INTER_LINEAR)


def _complete_jpeg(data: bytes) -> bool:
    """Whether `data` starts and ends as a JPEG does. A file cut short is decoded whole
    (and refused, as Pillow refuses it): the crop decode may stop before the cut."""
    return data[:3] == JPEG_MAGIC and bytes(data[-16:]).rstrip(b"\0").endswith(JPEG_END)


def _resamples(plan: _Plan) -> bool:
    """Whether `plan` resamples: not a whole-pixel box of the output's size."""
    x0, y0, x1, y1 = plan.box
    return not (float(x0).is_integer() and float(y0).is_integer()
                and (x1 - x0, y1 - y0) == (plan.width, plan.height))


@dataclass(frozen=True)
class Prefix:
    """A prefix's RGB uint8 HWC pixels, and whether they are a JPEG's that the extension
    decoded (or can): the rest then resamples them as the crop decode does, so that a cached
    prefix gives the bytes the decode without a cache gives."""

    pixels: np.ndarray
    jpeg: bool
    # The JPEG decoded at DCT scale 1/f, for each f at which the crop decode might decode
    # one of its boxes (a pipeline whose first step is random, with a prefix cache): the rest
    # resamples from these where the crop decode would, so the bytes are the same.
    scaled: dict[int, np.ndarray] = field(default_factory=dict)

    def arrays(self) -> dict[str, np.ndarray]:
        """What the prefix cache keeps of it."""
        return {"pixels": self.pixels, "jpeg": np.array([self.jpeg], np.uint8),
                **{f"s{f}": level for f, level in self.scaled.items()}}

    @classmethod
    def of(cls, arrays: dict[str, np.ndarray]) -> Prefix:
        return cls(arrays["pixels"], bool(arrays["jpeg"][0]),
                   {f: arrays[f"s{f}"] for f in DCT_FACTORS if f"s{f}" in arrays})


def _dct_factor(box: tuple[float, float, float, float], width: int, height: int) -> int:
    """The DCT scale the crop decode decodes `box` at for an output of width x height (as
    _jpeg.c chooses it): the largest that leaves the box at least as large as the output."""
    x0, y0, x1, y1 = box
    return next((f for f in DCT_FACTORS if (x1 - x0) / f >= width and (y1 - y0) / f >= height),
                1)


# Steps that draw nothing from the generator: a pipeline's leading run of them is its prefix.
DETERMINISTIC = frozenset({"resize", "center_crop"})
PREFIX_VERSION = 2  # part of every cache key: a change to how the prefix is computed


class ImagePipeline:
    """Encoded image bytes -> the output array of a `transforms:` list (or a plain resize).

    `steps`: (name, arguments) pairs, validated by the config (formats/image_config.py): geometric
    steps in any order, `normalize` at most once and last; none at all: the image at its
    native size. `layout` applies to uint8 output; normalized output is always CHW.
    Thread-safe, apart from `use_cache`, called once before any sample.

    Unless a step fixes the output size (`center_crop`, `random_resized_crop`, `resize` to
    [height, width]), images keep sizes of their own: `fixed_size` is False, the output is a
    `Padded` array (padded to the batch's largest when collated, see pool/batch.py), and `write`
    adds the field `<name>_size`, the image's (height, width) before padding.

    The prefix (see the module's docstring) is `prefix(data)`; `cached(index)` is sample
    `index`'s prefix from the cache given to `use_cache`, if there.
    """

    def __init__(self, steps: Sequence[tuple[str, Any]], layout: str = "chw") -> None:
        geometry = [(name, args) for name, args in steps if name != "normalize"]
        cut = next((i for i, (name, _) in enumerate(geometry) if name not in DETERMINISTIC),
                   len(geometry))
        self.head = [(_GEOMETRY[name], args) for name, args in geometry[:cut]]
        self.tail = [(_GEOMETRY[name], args) for name, args in geometry[cut:]]
        norm = [args for name, args in steps if name == "normalize"]
        # Every resample, the prefix's and the rest's: antialiased unless a step says otherwise.
        self.antialias = all(getattr(args, "antialias", True) for _, args in steps)
        # What the prefix computes, for cache keys: equal text, equal pixels.
        self.prefix_spec = repr((PREFIX_VERSION, geometry[:cut], self.antialias))
        self.layout = "chw" if norm else layout
        self.dtype = np.dtype(norm[0].dtype) if norm else np.dtype(np.uint8)
        if norm:
            mean = np.asarray(norm[0].mean, np.float64)
            std = np.asarray(norm[0].std, np.float64)
            # (x / 255 - mean) / std == x * scale + bias, computed in float32
            self.scale = (1.0 / (255.0 * std)).astype(np.float32)
            self.bias = (-mean / std).astype(np.float32)
        self.normalize = bool(norm)
        self._chw = self.layout == "chw" and not self.normalize  # the extension writes CHW
        self.fixed_size = any(name in ("center_crop", "random_resized_crop")
                              or (name == "resize" and not isinstance(args.size, int))
                              for name, args in steps)
        self.cache: Any = None  # a _prefix_cache.Scope, given by use_cache

    def decode_version(self) -> str:
        """What this pipeline's bytes depend on beyond the file and the coordinates, for the
        fingerprint (order/fingerprint.py): "" without the extension (the whole-file decode
        and OpenCV's resample, as before it) or without geometry (the decode alone, Pillow's
        pixels either way); else `CROP_DECODE`, with a prefix cache or without (the same
        bytes: see Prefix.scaled)."""
        if _jpeg is None:
            _say_no_extension()
            return ""
        return CROP_DECODE if self.head or self.tail else ""

    def use_cache(self, scope: Any) -> None:
        """Keep prefixes in `scope` (a _prefix_cache.Scope), by sample index."""
        self.cache = scope

    def output_names(self, name: str) -> list[str]:
        """The fields `write` adds for an image field called `name`."""
        return [name] if self.fixed_size else [name, f"{name}_size"]

    def cached(self, index: int) -> Prefix | None:
        """Sample `index`'s prefix, if the cache holds it (None without a cache)."""
        if self.cache is None:
            return None
        hit = self.cache.get(index)
        return None if hit is None else Prefix.of(hit)

    def write(self, out: dict[str, Any], name: str, data: bytes | None,
              rng: np.random.Generator, index: int | None = None,
              prefix: Prefix | None = None) -> None:
        """Decode and transform `data` into `out[name]`, and, when sizes vary, its (height,
        width) into `out[name + "_size"]` (int64[2]). `prefix`: the prefix, as `cached(index)`
        gave it (then `data` is not read); else it is computed from `data` and, with a cache,
        kept under `index`."""
        if prefix is None:
            if data is None:
                raise ValueError("no image bytes")
            image = self.planned(data, rng) if self.cache is None else None
            if image is not None:
                self._put(out, name, image)
                return
            kept = self.cache is not None and index is not None
            prefix = self.prefix(data, scaled=kept)
            if kept:
                self.cache.put(index, prefix.arrays())
        self._put(out, name, self.rest(prefix, rng))

    def _put(self, out: dict[str, Any], name: str, image: np.ndarray) -> None:
        out[name] = image
        if not self.fixed_size:
            h, w = image.shape[1:] if self.layout == "chw" else image.shape[:2]
            out[f"{name}_size"] = np.array([h, w], np.int64)

    def __call__(self, data: bytes, rng: np.random.Generator) -> np.ndarray:
        if self.cache is None and (image := self.planned(data, rng)) is not None:
            return image
        return self.rest(self.prefix(data), rng)

    def planned(self, data: bytes, rng: np.random.Generator) -> np.ndarray | None:
        """The output in one plan from the source, for a pipeline whose first step is random
        (nothing for a prefix to keep): a JPEG the extension takes is decoded only where the
        output's box lies, at the DCT scale it allows, resampled and mirrored in the same
        call. None, nothing drawn from `rng`, for every other pipeline and image: the
        prefix's way then."""
        if _jpeg is None or self.head or not self.tail or not _complete_jpeg(data):
            return None
        width, height, jpeg = _source_size(data)
        if not jpeg:
            return None
        # The same draws as rest() makes on the prefix, which is the whole image here.
        plan = _Plan((0.0, 0.0, float(width), float(height)), width, height)
        for step, args in self.tail:
            step(plan, args, rng)
        if _resamples(plan):
            pixels = self._empty(plan)
            try:
                if _jpeg.decode_crop(data, plan.box, pixels, chw=self._chw,
                                     flip=plan.flip, antialias=self.antialias):
                    return self._finish(pixels, self._chw)
            except ValueError:
                pass  # corrupt: the whole-file decoders say what is wrong with it
        return self._resampled(self.prefix(data), plan)

    def prefix(self, data: bytes, scaled: bool = False) -> Prefix:
        """The prefix's RGB uint8 HWC pixels: one plan of the leading deterministic steps,
        decoded at the largest DCT scale that plan allows (with the extension, only where its
        box lies), resampled once. `scaled`: with the DCT-scaled decodes the rest may need
        to give the crop decode's bytes (Prefix.scaled), for a prefix kept in a cache."""
        width, height, jpeg = _source_size(data)
        plan = _Plan((0.0, 0.0, float(width), float(height)), width, height)
        for step, args in self.head:
            step(plan, args, None)  # deterministic steps draw nothing
        ext = _jpeg if jpeg and _complete_jpeg(data) else None
        crop = ext is not None
        if ext is not None and _resamples(plan):
            pixels = np.empty((plan.height, plan.width, 3), np.uint8)
            try:
                if ext.decode_crop(data, plan.box, pixels, antialias=self.antialias):
                    return Prefix(pixels, True)
            except ValueError:
                pass  # corrupt: the whole-file decoders say what is wrong with it
            crop = False
        pixels = _render(data, width, height, jpeg, plan, self.antialias)
        levels: dict[int, np.ndarray] = {}
        if ext is not None and crop and scaled and not self.head and self.tail:
            # The output's size does not depend on the draws: any generator plans it.
            out = _Plan((0.0, 0.0, float(width), float(height)), width, height)
            for step, args in self.tail:
                step(out, args, np.random.default_rng(0))
            for f in DCT_FACTORS:
                if width / f >= out.width and height / f >= out.height:
                    level = np.empty((-(-height // f), -(-width // f), 3), np.uint8)
                    ext.decode_crop(data, (0.0, 0.0, float(width), float(height)), level,
                                    scale=f)
                    levels[f] = level
        return Prefix(pixels, crop, levels)

    def pixels_prefix(self, pixels: np.ndarray) -> np.ndarray:
        """The prefix from decoded RGB uint8 HWC pixels (a video frame) instead of encoded
        bytes: the leading deterministic steps planned and resampled once (none: as given)."""
        if not self.head:
            return pixels
        height, width = pixels.shape[:2]
        plan = _Plan((0.0, 0.0, float(width), float(height)), width, height)
        for step, args in self.head:
            step(plan, args, None)  # deterministic steps draw nothing
        return _resample(pixels, plan.box, plan.width, plan.height, self.antialias)

    def rest(self, prefix: Prefix | np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """The output array from the prefix (or a video frame's pixels): the steps from the
        first random one on, planned on those pixels, one resample (none if they keep the
        size), normalize."""
        if not isinstance(prefix, Prefix):
            prefix = Prefix(prefix, False)
        height, width = prefix.pixels.shape[:2]
        plan = _Plan((0.0, 0.0, float(width), float(height)), width, height)
        for step, args in self.tail:
            step(plan, args, rng)
        return self._resampled(prefix, plan)

    def _resampled(self, prefix: Prefix, plan: _Plan) -> np.ndarray:
        """The output of `plan` on the prefix's pixels: a JPEG's resampled as the crop decode
        resamples (the same bytes where it decodes at full scale), other pixels by OpenCV."""
        pixels = prefix.pixels
        if not _resamples(plan):
            x0, y0 = int(plan.box[0]), int(plan.box[1])
            pixels = pixels[y0:y0 + plan.height, x0:x0 + plan.width]
            return self._finish(pixels[:, ::-1] if plan.flip else pixels)
        if prefix.jpeg and _jpeg is not None:
            out = self._empty(plan)
            box = plan.box
            level = prefix.scaled.get(_dct_factor(box, plan.width, plan.height))
            if level is not None:  # the crop decode would decode this box at a DCT scale
                sx, sy = level.shape[1] / pixels.shape[1], level.shape[0] / pixels.shape[0]
                pixels, box = level, (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)
            _jpeg.resample(np.ascontiguousarray(pixels), box, out, chw=self._chw,
                           flip=plan.flip, antialias=self.antialias, scaled=level is not None)
            return self._finish(out, self._chw)
        pixels = _resample(pixels, plan.box, plan.width, plan.height, self.antialias)
        return self._finish(pixels[:, ::-1] if plan.flip else pixels)

    def _empty(self, plan: _Plan) -> np.ndarray:
        """uint8 pixels of the plan's size for the extension to fill: CHW where that is the
        output (uint8 CHW), else HWC."""
        if self._chw:
            return np.empty((3, plan.height, plan.width), np.uint8)
        return np.empty((plan.height, plan.width, 3), np.uint8)

    def _finish(self, pixels: np.ndarray, chw: bool = False) -> np.ndarray:
        """HWC pixels (or, `chw`, the extension's CHW output itself): the output array,
        padded where sizes vary."""
        out = pixels if chw else self._output(pixels)
        if self.fixed_size:
            return out
        return padded(out, (1, 2) if self.layout == "chw" else (0, 1))

    def _output(self, hwc: np.ndarray) -> np.ndarray:
        """RGB HWC pixels -> the output array."""
        if not self.normalize:
            out = hwc.transpose(2, 0, 1) if self.layout == "chw" else hwc
            # Writable (torch warns on read-only arrays): cached prefixes are mapped
            # copy-on-write, so they are too.
            return np.ascontiguousarray(out)
        out = np.empty((3, *hwc.shape[:2]), self.dtype)
        for c in range(3):  # one pass per channel, no float HWC temporary
            np.multiply(hwc[:, :, c], self.scale[c], out=out[c], casting="unsafe")
            out[c] += self.bias[c]
        return out


@dataclass(frozen=True)
class _ExactSize:
    """Arguments of the resize that a plain `size:` means (module level: picklable)."""

    size: tuple[int, int]
    antialias: bool = True


def resize_pipeline(size: Sequence[int], layout: str) -> ImagePipeline:
    """The plain `size:` of a dataset without `transforms:`: resize to exactly (h, w)."""
    return ImagePipeline([("resize", _ExactSize((int(size[0]), int(size[1]))))], layout)


def decode_version(pipelines: Iterable[ImagePipeline | None]) -> str:
    """The decode version of a dataset's image fields (see ImagePipeline.decode_version):
    "" when none crops in the decode."""
    return max((p.decode_version() for p in pipelines if p is not None), default="")


def image_pipeline(cfg: Any) -> ImagePipeline:
    """The pipeline of a config block with `size:` or `transforms:` (or neither: the native
    size) and `layout:`."""
    if cfg.transforms is None:
        if cfg.size is None:
            return ImagePipeline([], cfg.layout)
        return resize_pipeline(cfg.size, cfg.layout)
    from .formats.image_config import transform_steps

    return ImagePipeline(transform_steps(cfg.transforms), cfg.layout)
