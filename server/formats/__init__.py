"""Dataset formats: each turns a `format:` block of the config into a map-style dataset,
an object with `__len__` and `__getitem__(i) -> dict[str, numpy array | number]`."""

from __future__ import annotations

from typing import Any, Protocol


class MapDataset(Protocol):
    def __len__(self) -> int: ...
    def __getitem__(self, index: int) -> dict[str, Any]: ...


def open_dataset(cfg: Any) -> MapDataset:
    """Open the dataset a validated config block describes (in the calling process)."""
    if cfg.format == "python":
        from .python import open_python

        return open_python(cfg)
    if cfg.format == "image-folder":
        from .image_folder import ImageFolder

        return ImageFolder(cfg.source, cfg.size, cfg.layout)
    raise ValueError(f"unknown format {cfg.format!r}")
