"""The loader hands out a conversation batch's images flat (client/delivery/images.py):
numpy and torch, rows with none, and batches without images untouched."""

from __future__ import annotations

import numpy as np
import pytest

from stoker.client.delivery.images import flat_images


def padded(counts: list[int]) -> dict[str, np.ndarray]:
    k = max(counts) if counts else 0
    pv = np.zeros((len(counts), k, 3, 2, 2), np.float32)
    for b, n in enumerate(counts):
        for i in range(n):
            pv[b, i] = 10 * b + i  # image i of row b
    return {"pixel_values": pv, "image_counts": np.asarray(counts, np.int64)}


@pytest.mark.parametrize("counts", [[2, 0, 3], [0, 0], [1]])
def test_images_made_flat_row_by_row(counts: list[int]) -> None:
    flat = flat_images(padded(counts))["pixel_values"]
    want = [10 * b + i for b, n in enumerate(counts) for i in range(n)]
    assert flat.shape == (sum(counts), 3, 2, 2)
    assert flat[:, 0, 0, 0].tolist() == want


def test_torch_tensors_too_and_other_batches_untouched() -> None:
    torch = pytest.importorskip("torch")
    batch = {k: torch.from_numpy(v) for k, v in padded([1, 2]).items()}
    flat = flat_images(batch)["pixel_values"]
    assert isinstance(flat, torch.Tensor) and flat[:, 0, 0, 0].tolist() == [0, 10, 11]
    plain = {"x": np.zeros((2, 3))}
    assert flat_images(plain) is plain
