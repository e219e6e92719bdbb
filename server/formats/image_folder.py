"""`format: image-folder`: one sub-folder per class, JPEG/PNG files, decoded to RGB and resized.

Yields `image` (uint8, CHW or HWC as configured) and `label` (int64, the class's position in
the sorted folder names).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

EXTENSIONS = (".jpg", ".jpeg", ".png")


class ImageFolder:
    """Thread-safe: __getitem__ reads only immutable numpy arrays."""

    def __init__(self, root: Path, size: tuple[int, int], layout: str = "chw") -> None:
        self.root = Path(root)
        self.classes = sorted(p.name for p in self.root.iterdir() if p.is_dir())
        paths, labels = [], []
        for label, name in enumerate(self.classes):
            for f in sorted((self.root / name).iterdir()):
                if f.suffix.lower() in EXTENSIONS and f.is_file():
                    paths.append(f"{name}/{f.name}")
                    labels.append(label)
        if not paths:
            raise ValueError(f"{self.root}: no {'/'.join(EXTENSIONS)} files in class sub-folders")
        # Fixed-width numpy arrays, not lists of str: no per-item refcounts to copy on write.
        self.paths = np.array(paths)
        self.labels = np.array(labels, dtype=np.int64)
        self.height, self.width = size
        self.layout = layout

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> dict[str, np.ndarray | np.int64]:
        path = self.root / str(self.paths[index])
        with Image.open(path) as img:
            rgb = img.convert("RGB").resize((self.width, self.height), Image.Resampling.BILINEAR)
            image = np.array(rgb, dtype=np.uint8)  # writable: torch warns on read-only arrays
        if self.layout == "chw":
            image = image.transpose(2, 0, 1)
        return {"image": image, "label": self.labels[index]}

    def source_of(self, index: int) -> str:
        return str(self.root / str(self.paths[index]))
