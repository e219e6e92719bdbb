"""The server's YAML config, validated with pydantic.

A bad config is reported as `config error in FILE: FIELD.PATH: what was expected` for each
problem, and the server exits non-zero before opening any port.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

# Frames must stay well under the client's receive limit (see stoker.client).
MAX_FRAME_BYTES = 32 << 20


class ConfigError(Exception):
    """A config that cannot be served; the message names the file and the field path."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PythonDataset(_Strict):
    """The user's own map-style dataset: `factory` returns an object with __len__ and
    __getitem__(i) -> dict of numpy arrays or numbers."""

    format: Literal["python"]
    factory: str = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$",
                         description='"module:callable", importable on the server')
    options: dict[str, Any] = Field(default_factory=dict)


class ImageFolderDataset(_Strict):
    """One sub-folder per class under `source` (class index = sorted folder order)."""

    format: Literal["image-folder"]
    source: Path
    size: tuple[int, int] = Field(description="output [height, width], or one int for square")
    layout: Literal["chw", "hwc"] = "chw"

    @field_validator("size", mode="before")
    @classmethod
    def _square(cls, v: Any) -> Any:
        return (v, v) if isinstance(v, int) and not isinstance(v, bool) else v

    @field_validator("size")
    @classmethod
    def _positive(cls, v: tuple[int, int]) -> tuple[int, int]:
        if min(v) < 1:
            raise ValueError("sizes must be >= 1")
        return v

    @field_validator("source")
    @classmethod
    def _is_dir(cls, v: Path) -> Path:
        if not v.is_dir():
            raise ValueError(f"not a directory: {v}")
        return v


DatasetConfig = Annotated[PythonDataset | ImageFolderDataset, Field(discriminator="format")]


class ServerSettings(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(50051, ge=0, le=65535)
    http_port: int = Field(8080, ge=0, le=65535)
    workers: int | None = Field(None, ge=1, description="worker processes; default one per core")
    # Credits one stream may hold at once: with the batch size, this bounds server memory.
    max_credits: int = Field(64, ge=1, le=4096)
    # 4 MiB less room for the frame's header: a frame then fits the 4 MiB receive limit that
    # gRPC clients have by default, so any gRPC client can read the stream unconfigured.
    frame_bytes: int = Field((4 << 20) - (64 << 10), ge=4096, le=MAX_FRAME_BYTES)
    grace_seconds: float = Field(10.0, ge=0)

    @property
    def worker_count(self) -> int:
        return self.workers or len(os.sched_getaffinity(0))


class Config(_Strict):
    server: ServerSettings = Field(default_factory=ServerSettings)
    datasets: dict[str, DatasetConfig] = Field(min_length=1)


def _resolve_sources(raw: Any, base: Path) -> Any:
    """Relative `source:` paths are relative to the config file, not the working directory."""
    datasets = raw.get("datasets") if isinstance(raw, dict) else None
    if isinstance(datasets, dict):
        for ds in datasets.values():
            if isinstance(ds, dict) and isinstance(ds.get("source"), str):
                src = Path(ds["source"]).expanduser()
                ds["source"] = str(src if src.is_absolute() else base / src)
    return raw


def load_config(path: str | os.PathLike[str], **overrides: Any) -> Config:
    """Read and validate a config file; `overrides` (not None) replace `server:` settings."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(f"config error in {path}: cannot read: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config error in {path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config error in {path}: expected a mapping with `datasets:` at the top")
    raw = _resolve_sources(raw, path.resolve().parent)
    server = dict(raw.get("server") or {})
    server.update({k: v for k, v in overrides.items() if v is not None})
    raw["server"] = server
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        lines = [f"config error in {path}:"]
        for err in e.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
            got = repr(err.get("input"))
            got = got if len(got) <= 80 else got[:77] + "..."
            lines.append(f"  {loc}: {err['msg']} (got {got})")
        raise ConfigError("\n".join(lines)) from None
