"""Images at their native size (neither `size` nor `transforms`): each batch is zero-padded at
the bottom and right to its largest image, and `<field>_size` gives each image's (height,
width); describe() says -1 for the sizes that vary."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from stoker.client import RemoteLoader
from stoker.server import ServerProcess
from stoker.server.formats.tar import Tar

from conftest import StartServer

SIZES = [(5, 7), (9, 4), (5, 7), (5, 7), (3, 3), (8, 8), (6, 2)]  # (height, width)


def png(h: int, w: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(1, 256, (h, w, 3), np.uint8)  # no zeros
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def server(start_server_module: StartServer, tmp_path_factory: pytest.TempPathFactory
           ) -> ServerProcess:
    root = tmp_path_factory.mktemp("native")
    for i, (h, w) in enumerate(SIZES):
        (root / f"c{i % 2}").mkdir(exist_ok=True)
        (root / f"c{i % 2}" / f"{i}.png").write_bytes(png(h, w, i))
    return start_server_module({"pics": {"format": "image-folder", "source": str(root)}})


def test_batches_are_padded_to_their_largest_image(server: ServerProcess) -> None:
    with RemoteLoader(server.address, "pics", batch_size=3, shuffle=True, seed=4,
                      drop_last=False, output="numpy", timeout=60) as loader:
        assert [tuple(f.shape) for f in loader.describe().fields if f.name == "image"] == [
            (3, -1, -1)]
        batches = [{k: v.copy() for k, v in b.items()} for b in loader]
    keys = sorted(f"c{i % 2}/{i}.png" for i in range(len(SIZES)))  # the dataset's order
    seen = []
    for b in batches:
        sizes = b["image_size"]
        assert b["image"].shape[2:] == tuple(sizes.max(axis=0))  # the batch's largest
        for image, (h, w), i in zip(b["image"], sizes, b["sample_index"].tolist(), strict=True):
            n = int(Path(keys[i]).stem)
            assert (h, w) == SIZES[n]
            want = np.asarray(Image.open(io.BytesIO(png(h, w, n)))).transpose(2, 0, 1)
            assert np.array_equal(image[:, :h, :w], want)
            assert not image[:, h:].any() and not image[:, :, w:].any()
            seen.append(i)
    assert sorted(seen) == list(range(len(SIZES)))


def test_a_size_field_may_not_collide_with_a_configured_field(tmp_path: Path) -> None:
    from stoker.server.formats.tar_config import TarDataset

    cfg = TarDataset.model_validate({"format": "tar", "source": str(tmp_path), "fields": {
        "image": {"ext": "png", "decode": "image"}, "image_size": {"ext": "cls",
                                                                   "decode": "int"}}})
    with pytest.raises(ValueError, match="output field names collide"):
        Tar(cfg, None)  # type: ignore[arg-type]  # refused before the storage is used
