"""The config model of `format: audio` (read by formats/audio.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .config_base import Sourced, Strict, Suffixes


class UniformCrops(Strict):
    """`crops: {uniform: K}`: K evenly spaced crops per file, each a sample.

    Attributes:
        uniform: Evenly spaced crops per file.
    """

    uniform: int = Field(ge=1, le=1 << 20, description="evenly spaced crops per file")


class AudioDataset(Sourced):
    """Audio files under `source`: one sub-folder per class (class index = sorted folder
    order), or the files a `manifest` lists (`path`, `label`). Decoded, resampled to
    `sample_rate` and mixed to `channels` by FFmpeg's resampler; `duration` seconds of it per
    sample, or the whole file. See docs/configuration.md.

    Attributes:
        format: `"audio"`: selects this model (the key every dataset gives).
        sample_rate: 1000 to 384000 Hz: FFmpeg's resampler (swresample) converts to it.
        channels: 1 to 8: mixed by the resampler (1 `mono`, 2 `stereo`, ...).
        duration: A crop of this many seconds per sample; null: the whole file, zero-padded to the
            batch's longest, with a `length` field.
        crops: With `duration`: one crop per file per epoch, its start drawn from (seed, epoch,
            sample index), or K evenly spaced crops per file, each a sample.
        manifest: A CSV (`path,label`) or JSON lines file under `source`.
        extensions: The files taken from class sub-folders (any case).
    """

    format: Literal["audio"]
    sample_rate: int = Field(16000, ge=1000, le=384000)
    channels: int = Field(1, ge=1, le=8)
    duration: float | None = Field(
        None, gt=0, description="seconds per sample; None: the whole file, padded to the "
                                "batch's longest, with a `length` field")
    crops: Literal["random"] | UniformCrops = Field(
        "random", description="random: one crop per file per epoch, its start drawn from "
                              "(seed, epoch, index); {uniform: K}: K evenly spaced crops")
    manifest: str | None = Field(
        None, description="key under source of a CSV (path,label) or JSON lines file")
    extensions: Suffixes = (".wav", ".flac", ".mp3", ".ogg", ".opus", ".m4a", ".aac")
