"""The JPEG crop decode (server/_jpeg.c, server/images.py): built by the install, as close to
an accurate decode and an exact area average as the quality rule asks, and part of what
servers agree on: a server that decodes the old way (STOKER_JPEG_CROP=0, the whole file then
OpenCV's resample) is not mixed with one that crops in the decode, and a position saved
against one resumes on the other at the same samples with the same crop boxes."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest
from PIL import Image

from stoker.client import DataMismatch, RemoteLoader
from stoker.server import images
from stoker.server.images import ImagePipeline, rrc_box

from conftest import server_env

pytestmark = pytest.mark.timeout(180)

OUT = 224
SCALE, RATIO = (0.08, 1.0), (3 / 4, 4 / 3)
CLASSES = ("2x or more", "1.3-2x", "under 1.3x")


def test_the_extension_is_built_and_used() -> None:
    """CI must not lose the crop decode silently: the install builds it (the extension is
    optional only so that a client-only install needs no compiler)."""
    from stoker.server import _jpeg

    assert images._jpeg is _jpeg and images.CROP_DECODE == f"jpeg-crop-{_jpeg.VERSION}"


def photo(height: int, width: int, seed: int) -> bytes:
    """A photograph's statistics as a JPEG (q90): amplitude falling as 1/f^1.3 (natural images
    fall as 1/f^1-1.4), colour channels correlated. The exponent puts tf.data's bilinear at
    the PSNR it has on real 500x375 photos (36-39 dB against the reference, issue 49)."""
    rng = np.random.default_rng(seed)
    fy, fx = np.fft.fftfreq(height)[:, None], np.fft.rfftfreq(width)[None, :]
    f = np.hypot(fx, fy)
    f[0, 0] = 1.0
    planes = [np.fft.irfft2((rng.normal(size=f.shape) + 1j * rng.normal(size=f.shape))
                            / f ** 1.3, s=(height, width)) for _ in range(3)]
    x = np.stack(planes, -1) @ np.array([[1, 0.8, 0.6], [0.1, 0.5, 0.3], [0, 0.1, 0.6]])
    x = (x - x.mean()) / x.std() * 50 + 120
    buf = io.BytesIO()
    Image.fromarray(np.clip(x, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def tf_bilinear(crop: np.ndarray, width: int, height: int) -> np.ndarray:
    """tf.image.resize(method="bilinear", antialias=False) of a decoded crop, as TensorFlow
    computes it: half-pixel centres, edges clamped, no antialiasing (a reference
    implementation: TensorFlow is not in the dev venv)."""
    h, w = crop.shape[:2]
    ys = np.clip((np.arange(height) + 0.5) * h / height - 0.5, 0, h - 1)
    xs = np.clip((np.arange(width) + 0.5) * w / width - 0.5, 0, w - 1)
    y0, x0 = np.floor(ys).astype(int), np.floor(xs).astype(int)
    y1, x1 = np.minimum(y0 + 1, h - 1), np.minimum(x0 + 1, w - 1)
    ty, tx = (ys - y0)[:, None, None], (xs - x0)[None, :, None]
    c = crop.astype(np.float64)
    top = c[y0][:, x0] * (1 - tx) + c[y0][:, x1] * tx
    bottom = c[y1][:, x0] * (1 - tx) + c[y1][:, x1] * tx
    return np.clip(np.round(top * (1 - ty) + bottom * ty), 0, 255)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    return float(10 * np.log10(255.0 ** 2 / np.mean((a.astype(np.float64) - b) ** 2)))


@pytest.fixture(scope="module")
def boxes() -> list[tuple[bytes, int, tuple[int, int, int, int], str]]:
    """120 fixed crop boxes (the ImageNet random resized crop's, seeded) of the two image
    sets: 500x375 photos and large ones (1600x1200, 2048x1536): (jpeg, seed, box, class)."""
    files = [photo(375, 500, s) for s in range(6)] + \
        [photo(1200, 1600, 10 + s) for s in range(3)] + [photo(1536, 2048, 20)]
    out = []
    for i, data in enumerate(files):
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
        for j in range(12):
            seed = 1000 * i + j
            left, top, w, h = rrc_box(width, height, SCALE, RATIO, np.random.default_rng(seed))
            factor = min(w, h) / OUT
            cls = CLASSES[0] if factor >= 2 else CLASSES[1] if factor >= 1.3 else CLASSES[2]
            out.append((data, seed, (left, top, left + w, top + h), cls))
    return out


SAME_BYTES = """
import hashlib, pickle, sys
import numpy as np
from stoker.server import _jpeg
h = hashlib.sha256()
for data, box, flip, chw, antialias, shape in pickle.load(sys.stdin.buffer):
    out = np.zeros(shape, np.uint8)
    h.update(str(_jpeg.decode_crop(data, box, out, chw=chw, flip=flip,
                                   antialias=antialias)).encode())
    h.update(out.tobytes())
print(h.hexdigest())
"""


@pytest.mark.timeout(120)
def test_the_vectorised_and_portable_resamples_give_the_same_bytes(boxes: list[Any]) -> None:
    """The AVX2 path (x86 with AVX2) and the portable one (elsewhere, and with
    STOKER_JPEG_NO_AVX2) compute the same integers: servers on different CPUs agree."""
    import os
    import pickle
    import subprocess
    import sys

    rng = np.random.default_rng(3)
    jobs = [(data, box, bool(k % 2), bool(k % 3 == 0), bool(k % 5),
             (3, 224, 224) if k % 3 == 0 else (int(rng.integers(17, 300)),
                                               int(rng.integers(17, 300)), 3))
            for k, (data, _, box, _) in enumerate(boxes)]
    digests = []
    for env in ({}, {"STOKER_JPEG_NO_AVX2": "1"}):
        done = subprocess.run([sys.executable, "-c", SAME_BYTES], input=pickle.dumps(jobs),
                              capture_output=True, timeout=100, env={**os.environ, **env})
        assert done.returncode == 0, done.stderr.decode()
        digests.append(done.stdout.strip())
    assert digests[0] == digests[1]


def table(boxes: list[Any], antialias: bool = True) -> dict[str, dict[str, float]]:
    """Mean PSNR per class against the reference (Pillow's accurate decode, then its exact
    area-average BOX resize of the same box): tf.data's bilinear on the same decode, today's
    stoker before the crop decode (the whole decode, OpenCV's INTER_AREA), and the pipeline
    (random_resized_crop 224 through ImagePipeline, the crop decode)."""
    pipeline = ImagePipeline([("random_resized_crop", _Rrc(antialias=antialias))], "hwc")
    rows: dict[str, list[tuple[float, float, float]]] = {c: [] for c in CLASSES}
    for data, seed, box, cls in boxes:
        with Image.open(io.BytesIO(data)) as img:
            rgb = img.convert("RGB")
            ref = np.asarray(rgb.resize((OUT, OUT), Image.Resampling.BOX, box=box), np.float64)
            full = np.asarray(rgb)
        x0, y0, x1, y1 = box
        crop = full[y0:y1, x0:x1]
        new = pipeline(data, np.random.default_rng(seed))  # draws the same box
        rows[cls].append((psnr(tf_bilinear(crop, OUT, OUT), ref),
                          psnr(cv2.resize(crop, (OUT, OUT), interpolation=cv2.INTER_AREA), ref),
                          psnr(new, ref)))
    return {c: dict(zip(("tf.data bilinear", "stoker before", "stoker", "boxes"),
                        (*np.mean(v, axis=0).tolist(), len(v)), strict=True))
            for c, v in rows.items() if v}


class _Rrc:
    """random_resized_crop's arguments, as the config gives them."""

    def __init__(self, antialias: bool = True) -> None:
        self.size, self.scale, self.ratio, self.antialias = OUT, SCALE, RATIO, antialias


def holds(t: dict[str, dict[str, float]]) -> bool:
    """The rule: at least tf.data's + 3 dB where boxes are downscaled 2x or more, at least
    tf.data's in every class; held here with 1 dB to spare in every class, since a plain
    bilinear resample of the same accurate decode is tf.data's resize itself, equal to it
    within rounding (measured: 39.1 against 39.2 dB at 1.3-2x, 35.6 against 35.6 under 1.3x),
    and the test must tell the two apart."""
    return (t[CLASSES[0]]["stoker"] >= t[CLASSES[0]]["tf.data bilinear"] + 3
            and all(r["stoker"] >= r["tf.data bilinear"] + 1 for r in t.values()))


def say(t: dict[str, dict[str, float]]) -> str:
    lines = ["downscale  | boxes | tf.data bilinear | stoker before | stoker (dB)"]
    lines += [f"{c:10} | {r['boxes']:5.0f} | {r['tf.data bilinear']:16.1f} | "
              f"{r['stoker before']:13.1f} | {r['stoker']:.1f}" for c, r in t.items()]
    return "\n".join(lines)


def test_the_quality_rule_holds_against_the_reference(boxes: list[Any]) -> None:
    t = table(boxes)
    print("\n" + say(t))
    assert set(t) == set(CLASSES), say(t)  # every class measured
    assert holds(t), say(t)


def test_the_rule_fails_without_antialiasing(boxes: list[Any]) -> None:
    """The rule has teeth: the same decode with a plain bilinear resample (antialias: false)
    does not meet it."""
    t = table(boxes, antialias=False)
    print("\n" + say(t))
    assert not holds(t), say(t)


# -- servers ----------------------------------------------------------------------------------

N = 24


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("crop")
    for i in range(N):
        (root / f"c{i % 2}").mkdir(exist_ok=True)
        (root / f"c{i % 2}" / f"{i:02d}.jpg").write_bytes(photo(150 + i, 200, i))
    return root


def dataset(folder: Path) -> dict[str, Any]:
    return {"pics": {"format": "image-folder", "source": str(folder), "layout": "hwc",
                     "transforms": [{"random_resized_crop": {"size": 32}},
                                    {"horizontal_flip": {}}]}}


OLD = {**server_env(), images.CROP_ENV: "0"}


def batches(address: str | list[str], state: dict[str, Any] | None = None,
            **kw: Any) -> list[dict[str, np.ndarray]]:
    with RemoteLoader(address, "pics", batch_size=4, seed=7, output="numpy", timeout=60,
                      **kw) as loader:
        if state is not None:
            loader.load_state_dict(state)
        return [{k: v.copy() for k, v in b.items()} for b in loader]


def test_old_and_new_decode_servers_are_refused_together(start_server, folder: Path) -> None:
    old = start_server(dataset(folder), env=OLD)
    new = start_server(dataset(folder))
    with pytest.raises(DataMismatch) as info:
        batches([old.address, new.address])
    said = str(info.value)
    assert "+jpeg-crop-1" in said and old.address in said and new.address in said, said
    # Alone, each serves the epoch.
    assert len(batches(old.address)) == len(batches(new.address)) == N // 4


def test_a_position_saved_against_the_old_decode_resumes_on_the_new(start_server,
                                                                    folder: Path) -> None:
    old = start_server(dataset(folder), env=OLD)
    new = start_server(dataset(folder))
    with RemoteLoader(old.address, "pics", batch_size=4, seed=7, output="numpy",
                      timeout=60) as loader:
        it = iter(loader)
        for _ in range(2):
            next(it)
        state = loader.state_dict()
    assert "+" not in state["fingerprint"]["digest"]  # saved by the old decode's server
    rest_old = batches(old.address, state)
    rest_new = batches(new.address, state)  # no ValueError: the data is the same
    assert len(rest_new) == len(rest_old) == N // 4 - 2
    for a, b in zip(rest_old, rest_new, strict=True):
        assert np.array_equal(a["sample_index"], b["sample_index"])
        assert np.array_equal(a["label"], b["label"])
    # Same crop boxes and flips: each image the old decode gave is nearest to the one the new
    # decode gave for it (they differ by the decode's rounding and the resample's weights),
    # not to another photo, another box or its mirror image.
    olds = np.concatenate([b["image"] for b in rest_old]).astype(np.float64)
    news = np.concatenate([b["image"] for b in rest_new]).astype(np.float64)
    candidates = np.concatenate([news, news[:, :, ::-1]])
    dist = np.abs(olds[:, None] - candidates[None]).mean(axis=(2, 3, 4))
    assert np.array_equal(dist.argmin(axis=1), np.arange(len(olds))), dist.round(1)
