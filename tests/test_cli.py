"""`stoker datasets` and `stoker inspect` against a real server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

pytestmark = pytest.mark.timeout(120)


def stoker(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stoker.server", *args], capture_output=True,
                          text=True, timeout=100)


@pytest.fixture(scope="module")
def server(start_server_module, tmp_path_factory):
    root = tmp_path_factory.mktemp("pics")
    for c, rgb in enumerate([(255, 0, 0), (0, 0, 255)]):
        (root / f"c{c}").mkdir()
        for i in range(5):
            Image.new("RGB", (20 + i, 16), rgb).save(root / f"c{c}" / f"{i}.png")
    return start_server_module({
        "pics": {"format": "image-folder", "source": str(root), "size": 12},
        "toy": {"format": "python", "factory": "toy_datasets:toy", "options": {"n": 30}}})


def test_datasets_lists_name_format_and_size(server) -> None:
    out = stoker("datasets", server.address)
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines()[1:]]
    assert rows == [["pics", "image-folder", "10"], ["toy", "python", "30"]]


def test_inspect_summarises_a_batch_and_draws_its_images(server, tmp_path: Path) -> None:
    picture = tmp_path / "grid.png"
    out = stoker("inspect", server.address, "pics", "--batch-size", "6", "--no-shuffle",
                 "--grid", str(picture))
    assert out.returncode == 0, out.stderr
    assert "pics: format image-folder, 10 samples, 2 batches of 6 per epoch" in out.stdout
    image_row = next(line for line in out.stdout.splitlines() if line.startswith("image"))
    assert image_row.split()[:3] == ["image", "uint8", "[3,"]
    assert "samples [0, 1, 2, 3, 4, 5]" in out.stdout
    grid = np.asarray(Image.open(picture))
    # six 12x12 images in a row, 2-pixel gaps, a 7-pixel strip of captions under them
    assert grid.shape == (12 + 7, 6 * 14 - 2, 3)
    assert tuple(grid[6, 6]) == (255, 0, 0)  # the first class is red


def test_inspect_errors_are_one_line_and_exit_1(server) -> None:
    out = stoker("inspect", server.address, "nope")
    assert out.returncode == 1 and "NOT_FOUND" in out.stderr and "pics" in out.stderr
    out = stoker("inspect", server.address, "toy", "--grid", "x.png")
    assert out.returncode == 1 and "no image field" in out.stderr
