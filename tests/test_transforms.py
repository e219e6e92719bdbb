"""The image pipeline (`transforms:`) and the user's `transform:`: geometry, normalisation,
DCT-scaled decoding, and augmentation that is the same on every server and worker count."""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from stoker.client import RemoteLoader
from stoker.server import ConfigError, ServerProcess, load_config, write_config
from stoker.server.formats.image_config import transform_steps
from stoker.server.formats.image_folder_config import ImageFolderDataset
from stoker.server.images import ImagePipeline, rrc_box
from stoker.server.order.sampling import EpochKey

from conftest import server_env

pytestmark = pytest.mark.timeout(120)


def pipeline(steps_yaml: str, layout: str = "chw") -> ImagePipeline:
    cfg = ImageFolderDataset.model_validate({"format": "image-folder", "source": "/",
                                             "transforms": yaml.safe_load(steps_yaml)})
    return ImagePipeline(transform_steps(cfg.transforms), layout)


def png(pixels: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def coordinates_image(height: int, width: int) -> np.ndarray:
    """Red = column, green = row: each output pixel says where it came from."""
    img = np.zeros((height, width, 3), np.uint8)
    img[..., 0] = np.arange(width)[None, :]
    img[..., 1] = np.arange(height)[:, None]
    return img


def test_center_crop_takes_the_middle_and_flip_mirrors_it() -> None:
    src = png(coordinates_image(60, 100))
    out = pipeline("[{center_crop: {size: [20, 30]}}]", "hwc")(src, np.random.default_rng(0))
    assert out.shape == (20, 30, 3) and out.dtype == np.uint8
    assert out[0, 0, 0] == 35 and out[0, -1, 0] == 64  # columns 35..64
    assert out[0, 0, 1] == 20 and out[-1, 0, 1] == 39  # rows 20..39
    flipped = pipeline("[{center_crop: {size: [20, 30]}}, {horizontal_flip: {p: 1}}]", "hwc")(
        src, np.random.default_rng(0))
    assert np.array_equal(flipped, out[:, ::-1])
    # A flip before the crop mirrors the image the crop sees: same pixels, mirrored.
    first = pipeline("[{horizontal_flip: {p: 1.0}}, {center_crop: {size: [20, 31]}}]", "hwc")(
        src, np.random.default_rng(0))
    assert first[0, 0, 0] == 100 - 1 - 34 and first[0, -1, 0] == 100 - 1 - 64


def test_resize_shorter_side_keeps_aspect_then_crops() -> None:
    out = pipeline("[{resize: {size: 30}}, {center_crop: {size: 30}}]")(
        png(coordinates_image(60, 100)), np.random.default_rng(0))
    assert out.shape == (3, 30, 30)
    # 60x100 -> 30x50, the middle 30 columns are source columns ~20..79
    assert 18 <= out[0, 0, 0] <= 22 and 77 <= out[0, 0, -1] <= 81


def test_random_resized_crop_follows_its_ranges_and_is_a_function_of_the_rng() -> None:
    boxes = [rrc_box(200, 100, (0.25, 0.5), (0.5, 2.0), np.random.default_rng(s))
             for s in range(300)]
    for left, top, w, h in boxes:
        assert 0 <= left and left + w <= 200 and 0 <= top and top + h <= 100
        assert 0.24 <= w * h / 20000 <= 0.51 and 0.49 <= w / h <= 2.02
    assert len(set(boxes)) > 250
    # Impossible ranges fall back to the central crop, clamped to the ratio range.
    assert rrc_box(200, 100, (1.0, 1.0), (0.5, 0.5), np.random.default_rng(0)) == (75, 0, 50, 100)
    p = pipeline("[{random_resized_crop: {size: 16}}, {horizontal_flip: {}}]")
    src = png(coordinates_image(80, 120))
    a, b = (p(src, np.random.default_rng([1, 2, 3])) for _ in range(2))
    assert np.array_equal(a, b)
    assert not np.array_equal(a, p(src, np.random.default_rng([1, 2, 4])))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_normalize_matches_the_formula_on_the_uint8_pixels(dtype: str) -> None:
    src = png(np.random.default_rng(0).integers(0, 256, (40, 50, 3), dtype=np.uint8))
    geometry = "[{random_resized_crop: {size: [24, 20]}}, {horizontal_flip: {}}"
    raw = pipeline(geometry + "]")(src, np.random.default_rng(5))
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    norm = pipeline(geometry + f", {{normalize: {{mean: {list(mean)}, std: {list(std)}, "
                               f"dtype: {dtype}}}}}]")(src, np.random.default_rng(5))
    assert norm.shape == (3, 24, 20) and norm.dtype == np.dtype(dtype)
    want = (raw / 255.0 - np.array(mean)[:, None, None]) / np.array(std)[:, None, None]
    np.testing.assert_allclose(norm, want, atol=1e-5 if dtype == "float32" else 5e-3)


def test_a_much_smaller_output_decodes_the_jpeg_at_reduced_scale_with_the_same_picture() -> None:
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:1200, 0:1600]
    smooth = np.stack([xx * 255 // 1600, yy * 255 // 1200, (xx + yy) * 255 // 2800], -1)
    buf = io.BytesIO()
    Image.fromarray((smooth + rng.integers(0, 8, smooth.shape)).astype(np.uint8)).save(
        buf, format="JPEG", quality=90)
    out = pipeline("[{resize: {size: [96, 128]}}]", "hwc")(buf.getvalue(), rng)
    with Image.open(io.BytesIO(buf.getvalue())) as img:
        full = np.asarray(img.convert("RGB").resize((128, 96), Image.Resampling.BILINEAR))
    assert out.shape == full.shape
    assert np.abs(out.astype(int) - full.astype(int)).mean() < 2.0


@pytest.mark.parametrize(("steps", "message"), [
    ("[{rotate: {}}]", "one-key mapping"),
    ("[{normalize: {}}, {center_crop: {size: 8}}]", "normalize must be the last"),
    ("[{resize: {size: 8}}]", "the same size"),
    ("[{horizontal_flip: {p: 2}}, {center_crop: {size: 8}}]", "less than or equal to 1"),
    ("[{random_resized_crop: {size: 8, scale: [0.5, 0.1]}}]", "0 < low <= high"),
    ("[{normalize: {std: [1, 0, 1]}}, {center_crop: {size: 8}}]", "std must be > 0"),
])
def test_bad_transforms_are_config_errors_naming_the_field(tmp_path: Path, steps: str,
                                                          message: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"datasets": {"pics": {
        "format": "image-folder", "source": str(tmp_path), "transforms": yaml.safe_load(steps)}}}))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "datasets.pics.image-folder.transforms" in str(info.value)
    assert message in str(info.value)


def test_size_and_transforms_are_one_or_the_other(tmp_path: Path) -> None:
    # Neither is the native size (tests/test_native_size.py); both is an error.
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"datasets": {"pics": {
        "format": "image-folder", "source": str(tmp_path), "size": 8,
        "transforms": [{"center_crop": {"size": 8}}]}}}))
    with pytest.raises(ConfigError, match=r"not both"):
        load_config(path)


# -- end to end: augmentation is a function of (seed, epoch, index), not of who computes it --
AUGMENT = [{"random_resized_crop": {"size": 24}}, {"horizontal_flip": {"p": 0.5}},
           {"normalize": {"dtype": "float16"}}]


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(0)
    for c in range(3):
        (root / f"c{c}").mkdir()
        for i in range(8):
            h, w = (int(v) for v in rng.integers(40, 90, 2))
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(
                root / f"c{c}" / f"{i}.jpg", quality=85)
    return root


def epoch_of(server, epoch: int, batch_size: int = 5) -> dict[str, np.ndarray]:
    with RemoteLoader(server.address, "pics", batch_size=batch_size, seed=7, shuffle=True,
                      drop_last=False, output="numpy", timeout=60) as loader:
        loader.set_epoch(epoch)
        batches = list(loader)
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def test_augmentation_is_identical_across_servers_and_worker_counts(start_server,
                                                                   photos: Path) -> None:
    ds = {"pics": {"format": "image-folder", "source": str(photos), "transforms": AUGMENT}}
    one, two = start_server(ds, workers=1), start_server(ds, workers=2)
    a, b = epoch_of(one, 0), epoch_of(two, 0, batch_size=3)  # other batch boundaries too
    assert a["image"].shape == (24, 3, 24, 24) and a["image"].dtype == np.float16
    for k in a:
        assert np.array_equal(a[k], b[k]), k
    # Another epoch: another order and other crops of the same images.
    c = epoch_of(one, 1)
    assert not np.array_equal(a["sample_index"], c["sample_index"])
    by_index = {int(i): img for i, img in zip(c["sample_index"], c["image"], strict=True)}
    same = sum(np.array_equal(img, by_index[int(i)])
               for i, img in zip(a["sample_index"], a["image"], strict=True))
    assert same == 0


def test_user_transform_runs_after_the_format_with_its_own_seeded_rng(start_server) -> None:
    ds = {"pics": {"format": "python", "factory": "toy_datasets:toy", "options": {"n": 12},
                   "transform": "toy_datasets:jitter"}}
    one, two = start_server(ds, workers=1), start_server(ds, workers=2)
    a, b = epoch_of(one, 3), epoch_of(two, 3, batch_size=4)
    assert set(a) == {"x", "tokens", "label", "weight", "flag", "small", "coin", "sample_index"}
    for k in a:
        assert np.array_equal(a[k], b[k]), k
    base = np.arange(3, dtype=np.float32)[None, :] + a["sample_index"][:, None]
    noise = a["x"] - base
    assert np.all(np.abs(noise) > 0) and np.abs(noise).max() < 10
    other = epoch_of(one, 4)
    again = other["x"][np.argsort(other["sample_index"])] - base[np.argsort(a["sample_index"])]
    assert not np.allclose(again, noise[np.argsort(a["sample_index"])])  # new noise per epoch
    assert set(np.unique(a["coin"])) <= {0, 1}


@pytest.mark.parametrize(("spec", "message"), [
    ("toy_datasets:nope", "transform 'toy_datasets:nope': 'toy_datasets' has no 'nope'"),
    ("toy_datasets:not_a_dict", "transform 'toy_datasets:not_a_dict' returned list, expected "
                                "a dict of fields"),
])
def test_a_broken_user_transform_stops_the_server_naming_it(tmp_path: Path, spec: str,
                                                            message: str) -> None:
    config = write_config(tmp_path / "c.yaml", {"datasets": {"pics": {
        "format": "python", "factory": "toy_datasets:toy", "transform": spec}}})
    proc = ServerProcess(config, workers=1, env=server_env())
    with pytest.raises(RuntimeError) as info:
        proc.start()
    assert message in str(info.value) and "dataset 'pics'" in str(info.value)


def test_epoch_key_rng_streams_are_independent() -> None:
    key = EpochKey(1, 2, True)
    assert key.rng(5).random() == EpochKey(1, 2, True).rng(5).random()
    assert key.rng(5).random() != key.rng(5, stream=1).random()
    assert key.rng(5).random() != EpochKey(1, 3, True).rng(5).random()


# -- uint8 on the wire, normalised by the client ---------------------------------------------
GEOMETRY = AUGMENT[:2]
MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)


@pytest.mark.parametrize(("output", "dtype"), [("numpy", "float32"), ("torch", "float16"),
                                               ("torch", "bfloat16")])
def test_client_normalize_of_uint8_equals_the_servers_normalize(start_server, photos: Path,
                                                                output: str, dtype: str) -> None:
    server = start_server({
        "raw": {"format": "image-folder", "source": str(photos), "transforms": GEOMETRY},
        "pics": {"format": "image-folder", "source": str(photos), "transforms": [
            *GEOMETRY, {"normalize": {"mean": list(MEAN), "std": list(STD)}}]}})
    on_server = epoch_of(server, 2)
    with RemoteLoader(server.address, "raw", batch_size=5, seed=7, drop_last=False,
                      output=output, normalize={"image": (MEAN, STD)}, normalize_dtype=dtype,
                      timeout=60) as loader:
        loader.set_epoch(2)
        batches = list(loader)
    image = np.concatenate([np.asarray(b["image"].float() if output == "torch" else b["image"])
                            for b in batches])
    assert str(batches[0]["image"].dtype).removeprefix("torch.") == dtype
    assert str(batches[0]["label"].dtype).removeprefix("torch.") == "int64"  # untouched
    tolerance = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 5e-2}[dtype]
    np.testing.assert_allclose(image, on_server["image"].astype(np.float32), atol=tolerance)


@pytest.mark.parametrize(("normalize", "message"), [
    ({"picture": (MEAN, STD)}, "fields the dataset does not have: ['picture']"),
    ({"label": (MEAN, STD)}, "the field is int64, not uint8"),
    ({"image": ((0.5,) * 4, (0.2,) * 4)}, "no axis of 4 channels"),
])
def test_client_normalize_that_does_not_fit_the_dataset_is_a_value_error(
        start_server, photos: Path, normalize, message: str) -> None:
    server = start_server({"raw": {"format": "image-folder", "source": str(photos),
                                   "transforms": GEOMETRY}})
    with RemoteLoader(server.address, "raw", batch_size=5, output="numpy", timeout=60,
                      normalize=normalize) as loader:
        with pytest.raises(ValueError, match=re.escape(message)):
            next(iter(loader))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"normalize": {"image": (MEAN, (0.2, 0.0, 0.3))}}, "std must be > 0"),
    ({"normalize": {"image": (MEAN, STD[:2])}}, "mean has 3 values, std 2"),
    ({"normalize": {"image": (MEAN, STD)}, "normalize_dtype": "int8"}, "normalize_dtype"),
    ({"normalize": {"image": (MEAN, STD)}, "normalize_dtype": "bfloat16", "output": "numpy"},
     "needs output='torch'"),
])
def test_bad_client_normalize_arguments_are_refused_at_once(kwargs, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        RemoteLoader("127.0.0.1:1", "raw", batch_size=5, **kwargs)


def test_tar_image_fields_take_transforms_seeded_per_sample(tmp_path: Path) -> None:
    import tarfile

    from stoker.server.formats.tar import Tar
    from stoker.server.formats.tar_config import TarDataset
    from stoker.server.sources.local import LocalStorage

    rng = np.random.default_rng(0)
    with tarfile.open(tmp_path / "a.tar", "w") as tf:
        for i in range(4):
            for ext in ("jpg", "mask.png"):
                data = png(rng.integers(0, 256, (50, 70, 3), dtype=np.uint8))
                info = tarfile.TarInfo(f"{i:04d}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    cfg = TarDataset.model_validate({"format": "tar", "source": str(tmp_path), "fields": {
        "image": {"ext": "jpg", "decode": "image", "transforms": AUGMENT},
        "mask": {"ext": "mask.png", "decode": "image", "size": 16}}})
    a, b = (Tar(cfg, LocalStorage(tmp_path)) for _ in range(2))  # two "servers"
    key = EpochKey(3, 1, True)
    for i in range(4):
        x, y = a.sample(i, key), b.sample(i, key)
        assert x["image"].shape == (3, 24, 24) and x["image"].dtype == np.float16
        assert x["mask"].shape == (3, 16, 16) and x["mask"].dtype == np.uint8
        assert np.array_equal(x["image"], y["image"]) and np.array_equal(x["mask"], y["mask"])
    assert not np.array_equal(a.sample(0, key)["image"], a.sample(0, EpochKey(3, 2, True))["image"])


def test_pipelines_pickle_for_spawned_processes() -> None:
    import pickle

    from stoker.server.images import resize_pipeline

    src = png(coordinates_image(30, 40))
    for p in (resize_pipeline((8, 8), "chw"), pipeline(yaml.safe_dump(AUGMENT))):
        again = pickle.loads(pickle.dumps(p))
        rng_a, rng_b = np.random.default_rng(1), np.random.default_rng(1)
        assert np.array_equal(again(src, rng_a), p(src, rng_b))
