"""format: image-folder, served for real: classes, decoding, size and layout."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from stoker.client import RemoteLoader

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
    assert "sample 1" in info.value.details and str(root / "a" / "1.jpg") in info.value.details
