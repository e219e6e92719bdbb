"""Every pixel stoker serves is the one Pillow's `Image.open(f).convert("RGB")` gives (what
torchvision's ImageFolder loader does), for every colour space and format, on files Pillow
(or libjpeg-turbo, for YCCK) wrote: at the decode function, through the pipeline with no
transform or with one that does not resample, and through a real server."""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable

import cv2
import numpy as np
import pytest
import simplejpeg
from PIL import Image

from stoker.client import RemoteLoader
from stoker.server import ServerProcess
from stoker.server.formats.image_config import CenterCropArgs
from stoker.server.formats.samples import Padded
from stoker.server.images import ImagePipeline, decode_rgb

from conftest import StartServer

CROP = (30, 40)  # (height, width): smaller than every image below


def pillow_rgb(data: bytes) -> np.ndarray:
    """The reference: Pillow's own decode and RGB conversion."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a palette's per-entry alpha: Pillow warns, drops it
        with Image.open(io.BytesIO(data)) as img:
            return np.asarray(img.convert("RGB"))


def picture(h: int, w: int, seed: int) -> np.ndarray:
    """Smooth gradients plus noise: every channel and level in use, chroma that subsampling
    and colour conversion round differently."""
    yy, xx = np.mgrid[0:h, 0:w]
    smooth = np.stack([xx * 255 // w, yy * 255 // h, (xx + yy) * 255 // (h + w)], -1)
    noise = np.random.default_rng(seed).integers(0, 48, (h, w, 3))
    return ((smooth + noise) % 256).astype(np.uint8)


def save(img: Image.Image, fmt: str, **options: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **options)
    return buf.getvalue()


def without_app14(jpeg: bytes) -> bytes:
    """The JPEG without its Adobe (APP14) marker segment."""
    out, i = bytearray(jpeg[:2]), 2
    while jpeg[i + 1] != 0xDA:  # up to the start of scan
        n = int.from_bytes(jpeg[i + 2 : i + 4], "big")
        if jpeg[i + 1] != 0xEE:
            out += jpeg[i : i + 2 + n]
        i += 2 + n
    return bytes(out + jpeg[i:])


def palette_image(rgb: np.ndarray) -> Image.Image:
    return Image.fromarray(rgb).quantize(64)


def files() -> dict[str, bytes]:
    """name -> encoded bytes; each image a different size (batches get padded)."""
    out: dict[str, bytes] = {}

    def add(name: str, make: Callable[[np.ndarray], bytes]) -> None:
        h, w = 37 + len(out), 61 - len(out)
        out[name] = make(picture(h, w, len(out)))

    rgb = Image.fromarray
    add("rgb-baseline.jpg", lambda a: save(rgb(a), "JPEG", quality=90))
    add("rgb-progressive.jpg", lambda a: save(rgb(a), "JPEG", quality=90, progressive=True))
    add("rgb-444.jpg", lambda a: save(rgb(a), "JPEG", quality=95, subsampling=0))
    add("rgb-422.jpg", lambda a: save(rgb(a), "JPEG", quality=80, subsampling=1))
    add("rgb-adobe-rgb.jpg", lambda a: save(rgb(a), "JPEG", keep_rgb=True))
    add("gray.jpg", lambda a: save(rgb(a).convert("L"), "JPEG"))
    # Pillow writes CMYK as Photoshop does: inverted, with an Adobe marker (transform 0).
    add("cmyk-adobe.jpg", lambda a: save(rgb(a).convert("CMYK"), "JPEG", quality=90))
    add("cmyk-plain.jpg", lambda a: without_app14(save(rgb(a).convert("CMYK"), "JPEG")))
    # libjpeg-turbo writes CMYK pixels as YCCK (Adobe transform 2), as Photoshop may; given
    # inverted (Adobe) values, as Photoshop's are.
    add("ycck.jpg", lambda a: simplejpeg.encode_jpeg(
        255 - np.asarray(rgb(a).convert("CMYK")), 90, colorspace="CMYK"))
    add("rgb.png", lambda a: save(rgb(a), "PNG"))
    add("l.png", lambda a: save(rgb(a).convert("L"), "PNG"))
    add("la.png", lambda a: save(rgb(a).convert("LA"), "PNG"))
    add("rgba.png", lambda a: save(rgb(np.dstack([a, a[:, :, :1]])), "PNG"))
    add("p.png", lambda a: save(palette_image(a), "PNG"))
    add("p-transparent-index.png", lambda a: save(palette_image(a), "PNG", transparency=3))
    add("p-alpha-palette.png", lambda a: save(palette_image(a), "PNG",
                                               transparency=bytes(range(0, 256, 4))))
    add("gray16.png", lambda a: save(Image.fromarray(a[:, :, 0].astype(np.uint16) * 5), "PNG"))
    add("rgb48.png", lambda a: cv2.imencode(".png", a.astype(np.uint16) * 257)[1].tobytes())
    add("bilevel.png", lambda a: save(rgb(a).convert("1"), "PNG"))
    return out


FILES = files()
# Formats image-folder lists by extension: the rest reach a server through tar members.
OTHERS = {
    "rgb.gif": save(Image.fromarray(picture(40, 44, 90)), "GIF"),
    "rgb.bmp": save(Image.fromarray(picture(41, 45, 91)), "BMP"),
    "rgb.webp": save(Image.fromarray(picture(42, 46, 92)), "WEBP", lossless=True),
    "rgb.tiff": save(Image.fromarray(picture(43, 47, 93)), "TIFF"),
    "cmyk.tiff": save(Image.fromarray(picture(44, 48, 94)).convert("CMYK"), "TIFF"),
}
ALL = {**FILES, **OTHERS}


@pytest.mark.parametrize("name", sorted(ALL))
def test_decode_equals_pillow(name: str) -> None:
    want = pillow_rgb(ALL[name])
    got = decode_rgb(ALL[name])  # warnings are errors here: Pillow's alpha warning must not be
    assert got.dtype == np.uint8 and got.shape == want.shape
    assert np.array_equal(got, want), f"{name}: max diff {np.abs(got - want.astype(int)).max()}"


def test_cmyk_and_ycck_need_pillow() -> None:
    """What the test above guards against: simplejpeg converts CMYK and YCCK itself, off
    Pillow's pixels (the bug this routing fixed)."""
    for name in ("cmyk-adobe.jpg", "ycck.jpg"):
        own = simplejpeg.decode_jpeg(FILES[name], colorspace="RGB")
        want = pillow_rgb(FILES[name])
        assert want.std() > 30, name  # a real picture, not a flat one
        assert not np.array_equal(own, want), name


def source(name: str) -> np.ndarray:
    """The RGB array FILES[name] was made from."""
    i = list(FILES).index(name)
    return picture(37 + i, 61 - i, i)


def test_what_alpha_and_16_bit_become() -> None:
    """The documented rules: alpha is dropped (not composited), 16-bit gray clips at 255,
    16-bit RGB keeps the high byte."""
    assert np.array_equal(decode_rgb(FILES["rgba.png"]), source("rgba.png"))
    gray16 = decode_rgb(FILES["gray16.png"])
    assert gray16.max() == 255 and np.array_equal(gray16[:, :, 0], gray16[:, :, 2])
    # cv2 wrote it as BGR; each 16-bit level is the 8-bit one times 257
    assert np.array_equal(decode_rgb(FILES["rgb48.png"]), source("rgb48.png")[:, :, ::-1])


@pytest.mark.parametrize("layout", ["hwc", "chw"])
def test_the_pipeline_without_transforms_is_the_decode(layout: str) -> None:
    pipeline = ImagePipeline([], layout)
    assert not pipeline.fixed_size
    for name, data in ALL.items():
        out = pipeline(data, np.random.default_rng(0))
        want = pillow_rgb(data)
        assert isinstance(out, Padded) and out.pad_axes == ((0, 1) if layout == "hwc" else (1, 2))
        assert np.array_equal(out if layout == "hwc" else out.transpose(1, 2, 0), want), name


def crop(pixels: np.ndarray) -> np.ndarray:
    """center_crop as the pipeline plans it (rounded offsets)."""
    h, w = CROP
    top, left = round((pixels.shape[0] - h) / 2), round((pixels.shape[1] - w) / 2)
    return pixels[top : top + h, left : left + w]


def test_a_center_crop_does_not_resample() -> None:
    pipeline = ImagePipeline([("center_crop", CenterCropArgs(size=CROP))], "hwc")
    assert pipeline.fixed_size
    for name, data in ALL.items():
        out = pipeline(data, np.random.default_rng(0))
        assert not isinstance(out, Padded)
        assert np.array_equal(out, crop(pillow_rgb(data))), name


# -- through a real server ---------------------------------------------------------------

@pytest.fixture(scope="module")
def server(start_server_module: StartServer, tmp_path_factory: pytest.TempPathFactory
           ) -> ServerProcess:
    root = tmp_path_factory.mktemp("exact")
    (root / "c").mkdir()
    for name, data in FILES.items():
        (root / "c" / name).write_bytes(data)
    return start_server_module({
        "native": {"format": "image-folder", "source": str(root), "layout": "hwc"},
        "cropped": {"format": "image-folder", "source": str(root), "layout": "hwc",
                    "transforms": [{"center_crop": {"size": list(CROP)}}]},
    })


def served(server: ServerProcess, name: str) -> list[dict[str, np.ndarray]]:
    with RemoteLoader(server.address, name, batch_size=4, shuffle=False, drop_last=False,
                      output="numpy", timeout=60) as loader:
        return [{k: v.copy() for k, v in b.items()} for b in loader]


def test_served_pixels_equal_pillow_at_native_size(server: ServerProcess) -> None:
    names = sorted(FILES)  # image-folder's order: by key
    seen = 0
    for batch in served(server, "native"):
        for row, i in enumerate(batch["sample_index"].tolist()):
            h, w = batch["image_size"][row]
            image = batch["image"][row]
            assert np.array_equal(image[:h, :w], pillow_rgb(FILES[names[i]])), names[i]
            assert not image[h:].any() and not image[:, w:].any()  # zero padding
            seen += 1
    assert seen == len(FILES)


def test_served_pixels_equal_pillow_after_a_center_crop(server: ServerProcess) -> None:
    names = sorted(FILES)
    batches = served(server, "cropped")
    assert all("image_size" not in b for b in batches)  # a fixed size: nothing padded
    for batch in batches:
        for image, i in zip(batch["image"], batch["sample_index"].tolist(), strict=True):
            assert np.array_equal(image, crop(pillow_rgb(FILES[names[i]]))), names[i]
