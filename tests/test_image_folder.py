"""format: image-folder, served for real: classes, decoding, size and layout."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from stoker.client import RemoteLoader
from stoker.server import ServerProcess, write_config

COLOURS = {"blue": (0, 0, 255), "green": (0, 255, 0), "red": (255, 0, 0)}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("images")
    for name, rgb in COLOURS.items():
        (root / name).mkdir()
        for i in range(3):
            img = Image.new("RGB", (40 + i, 30), rgb)
            img.save(root / name / f"{i}.png")
        Image.new("L", (16, 16), 128).save(root / name / "gray.jpg", quality=95)  # grey -> RGB
        (root / name / "notes.txt").write_text("not an image")
    (root / "README").write_text("files at the top level are not classes")
    return root


@pytest.mark.parametrize(("layout", "size", "shape"), [
    ("chw", 8, (3, 8, 8)), ("hwc", [6, 10], (6, 10, 3))])
def test_classes_labels_and_pixels(start_server, folder: Path, layout: str, size, shape) -> None:
    server = start_server({"pics": {"format": "image-folder", "source": str(folder),
                                    "size": size, "layout": layout}})
    with RemoteLoader(server.address, "pics", batch_size=4, shuffle=False, drop_last=False,
                      output="numpy", timeout=60) as loader:
        batches = list(loader)
    images = np.concatenate([b["image"] for b in batches])
    labels = np.concatenate([b["label"] for b in batches])
    assert images.dtype == np.uint8 and images.shape == (12, *shape)
    assert labels.dtype == np.int64
    # Sorted class folders, sorted files: 0.png 1.png 2.png gray.jpg in blue, green, red.
    assert labels.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    hwc = images.transpose(0, 2, 3, 1) if layout == "chw" else images
    for k, (name, rgb) in enumerate(COLOURS.items()):
        for i in range(3):
            assert np.allclose(hwc[4 * k + i].mean(axis=(0, 1)), rgb, atol=1), (name, i)
        grey = images[4 * k + 3]
        assert np.all(np.abs(grey.astype(int) - 128) <= 2)


def test_a_corrupt_image_is_data_loss_naming_the_file(start_server, folder: Path,
                                                      tmp_path: Path) -> None:
    root = tmp_path / "pics"
    (root / "a").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(root / "a" / "0.png")
    (root / "a" / "1.jpg").write_bytes(b"\xff\xd8\xff\xe0 this is no jpeg")
    server = start_server({"pics": {"format": "image-folder", "source": str(root), "size": 4}})
    from stoker.client import RemoteError

    with pytest.raises(RemoteError) as info:
        with RemoteLoader(server.address, "pics", batch_size=2, shuffle=False,
                          output="numpy", timeout=60) as loader:
            list(loader)
    # Named relative to the dataset's root: where the server keeps its data is its business.
    assert "sample 1" in info.value.details and "(a/1.jpg)" in info.value.details
    assert str(root) not in info.value.details


# -- manifests ---------------------------------------------------------------------------------

MANIFEST_ROWS = [("imgs/b.png", 7), ("other/deep/c.jpg", 2), ("imgs/a.png", 0),
                 ("./imgs/b.png", 3)]  # a key may repeat; a leading ./ is the source itself
SHADES = {"imgs/a.png": (250, 0, 0), "imgs/b.png": (0, 250, 0), "other/deep/c.jpg": (0, 0, 250)}


@pytest.fixture(scope="module")
def manifested(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("manifested")
    for key, rgb in SHADES.items():
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (12, 9), rgb).save(root / key, quality=95)
    lines = ["path,label", ""] + [f"{p},{label}" for p, label in MANIFEST_ROWS]
    (root / "train.csv").write_text("\n".join(lines) + "\n")
    (root / "train.jsonl").write_text("".join(
        json.dumps({"path": p, "label": label}) + "\n" for p, label in MANIFEST_ROWS))
    return root


def test_a_manifest_gives_the_samples_and_labels(start_server, manifested: Path) -> None:
    server = start_server({
        name: {"format": "image-folder", "source": str(manifested), "size": 4,
               "manifest": f"train.{name}"} for name in ("csv", "jsonl")})
    for name in ("csv", "jsonl"):
        with RemoteLoader(server.address, name, batch_size=3, shuffle=False, drop_last=False,
                          output="numpy", timeout=60) as loader:
            batches = [{k: v.copy() for k, v in b.items()} for b in loader]
        labels = np.concatenate([b["label"] for b in batches])
        images = np.concatenate([b["image"] for b in batches])
        assert labels.dtype == np.int64 and labels.tolist() == [lab for _, lab in MANIFEST_ROWS]
        assert images.shape == (4, 3, 4, 4)
        for image, (path, _) in zip(images, MANIFEST_ROWS, strict=True):
            rgb = SHADES[path.removeprefix("./")]
            assert np.allclose(image.mean(axis=(1, 2)), rgb, atol=3), (name, path)


def start_fails(tmp_path: Path, dataset: dict) -> str:
    config = write_config(tmp_path / "bad.yaml", {"datasets": {"bad": dataset}})
    with pytest.raises(RuntimeError) as info:
        ServerProcess(config, workers=1).start()
    return str(info.value)


@pytest.mark.parametrize(("manifest", "text", "expected"), [
    ("m.csv", "path,label\nimgs/a.png,1\n\nimgs/nope.png,2\nother/none.jpg,1\n",
     "m.csv line 4: no file 'imgs/nope.png' under {root} (and 1 more rows)"),
    ("m.jsonl", '{"path": "imgs/a.png", "label": 1}\n{"path": "imgs/b.png", "label": 1.5}\n',
     "m.jsonl line 2: label must be an integer (int64), got 1.5"),
    ("m.csv", "path,label\nimgs/a.png,one\n", "m.csv line 2: label must be an integer"),
    ("m.csv", "file,label\nimgs/a.png,1\n", "m.csv line 1: expected a header with `path`"),
    ("m.jsonl", '{"path": "../x.png", "label": 1}\n', "m.jsonl line 1: path '../x.png' must"),
])
def test_a_bad_manifest_stops_the_start_naming_the_line(manifested: Path, tmp_path: Path,
                                                        manifest: str, text: str,
                                                        expected: str) -> None:
    root = tmp_path / "data"
    shutil.copytree(manifested, root)
    (root / manifest).write_text(text)
    message = start_fails(tmp_path, {"format": "image-folder", "source": str(root), "size": 4,
                                     "manifest": manifest})
    assert "cannot start" in message and "dataset 'bad'" in message
    assert str(root / expected.format(root=root)) in message, message
