"""Images in conversations (`format: chat` with `images:`), as a model's vision tower takes
them: the server sends each row's images padded to the batch's largest count,
`pixel_values` [B, K, 3, H, W] (rows are built alone, by any worker); the loader hands out
the flat [total images, 3, H, W], row by row, image by image, beside `image_counts` [B] and
`image_positions` [B, K] (where each image's block of tokens starts).

Threading: the loop's thread (a batch as it is handed out), numpy arrays or torch tensors.
"""

from __future__ import annotations

from typing import Any

import numpy as np

PADDED = "pixel_values"
COUNTS = "image_counts"


def flat_images(batch: dict[str, Any]) -> dict[str, Any]:
    """`batch` with its padded pixel_values made flat (a new array or tensor), or as it is
    when it has none. The mask is made where the counts are (host or device)."""
    padded, counts = batch.get(PADDED), batch.get(COUNTS)
    if padded is None or counts is None or padded.ndim != 5:
        return batch
    slots = padded.shape[1]
    if isinstance(counts, np.ndarray):
        keep = np.arange(slots)[None, :] < counts[:, None]
    else:  # torch, on the device the batch is on
        import torch

        keep = torch.arange(slots, device=counts.device)[None, :] < counts[:, None]
    return {**batch, PADDED: padded[keep]}
