"""`format: image-folder`: one sub-folder per class, JPEG/PNG files, decoded to RGB and resized.

Yields `image` (uint8, CHW or HWC as configured) and `label` (int64, the class's position in
the sorted folder names).
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
from PIL import Image

from ..sources import Storage

EXTENSIONS = (".jpg", ".jpeg", ".png")


def decode_image(data: bytes, size: tuple[int, int], layout: str) -> np.ndarray:
    """JPEG/PNG bytes -> uint8 RGB resized to size (height, width), CHW or HWC."""
    height, width = size
    with Image.open(io.BytesIO(data)) as img:
        rgb = img.convert("RGB").resize((width, height), Image.Resampling.BILINEAR)
        image = np.array(rgb, dtype=np.uint8)  # writable: torch warns on read-only arrays
    return image.transpose(2, 0, 1) if layout == "chw" else image


class ImageFolder:
    """Thread-safe: __getitem__ reads only immutable numpy arrays."""

    def __init__(self, cfg: Any, storage: Storage, pattern: str | None = None) -> None:
        self.storage = storage
        keys = [o.key for o in storage.list(pattern)
                if o.key.lower().endswith(EXTENSIONS) and o.key.count("/") == 1]
        self.classes = sorted({k.split("/", 1)[0] for k in keys})
        if not keys:
            raise ValueError(f"{storage.url}: no {'/'.join(EXTENSIONS)} files in class "
                             "sub-folders")
        index = {name: i for i, name in enumerate(self.classes)}
        # Fixed-width numpy arrays, not lists of str: no per-item refcounts to copy on write.
        self.keys = np.array(keys)
        self.labels = np.array([index[k.split("/", 1)[0]] for k in keys], dtype=np.int64)
        self.size = tuple(cfg.size)
        self.layout = cfg.layout

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, index: int) -> dict[str, np.ndarray | np.int64]:
        image = decode_image(self.storage.read(str(self.keys[index])), self.size, self.layout)
        return {"image": image, "label": self.labels[index]}

    def source_of(self, index: int) -> str:
        return self.storage.where(str(self.keys[index]))

    def objects_of(self, indices: np.ndarray) -> list[str]:
        return [str(k) for k in self.keys[indices]]
