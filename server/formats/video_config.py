"""The config model of `format: video` (read by formats/video.py), and the clip settings it
shares with `decode: video` elsewhere."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from .config_base import Sourced, Strict, Suffixes
from .image_config import ImageSize, Transforms, size_or_transforms


class Clip(Strict):
    """T frames: every `stride`-th decoded frame, or the frames shown at start + k / `fps`."""

    frames: int = Field(ge=1, le=4096)
    stride: int | None = Field(None, ge=1)
    fps: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _one_spacing(self) -> Clip:
        if (self.stride is None) == (self.fps is None):
            raise ValueError("give either stride (every S-th frame) or fps (frames per second "
                             "of the clip), not both")
        return self


class Uniform(Strict):
    uniform: int = Field(ge=1, le=1 << 20, description="evenly spaced clips per video")


class ClipAudio(Strict):
    """The clip's span of the file's audio track, resampled as `format: audio` does."""

    sample_rate: int = Field(16000, ge=1000, le=384000)
    channels: int = Field(1, ge=1, le=8)


class VideoDataset(Sourced):
    """Video files under `source`: one sub-folder per class (class index = sorted folder
    order), or the files a `manifest` lists (`path`, `label`, optional `start`/`end` seconds
    bounding where clips are taken). A sample is a clip: see docs/configuration.md."""

    format: Literal["video"]
    clip: Clip
    clips: Literal["random", "all"] | Uniform = Field(
        "random", description="random: one clip per video per epoch; {uniform: K}: K evenly "
                              "spaced clips per video; all: every non-overlapping clip")
    short: Literal["repeat_last", "error"] = Field(
        "repeat_last", description="a video shorter than its clip: repeat its last frame, or "
                                   "fail the sample")
    size: ImageSize | None = None
    transforms: Transforms | None = Field(
        None, description="the image transforms, one random draw per clip")
    layout: Literal["tchw", "cthw", "thwc"] = "tchw"
    manifest: str | None = Field(
        None, description="key under source of a CSV (path,label[,start,end]) or JSON lines "
                          "file; paths relative to source")
    extensions: Suffixes = Field(
        (".mp4", ".mkv", ".webm", ".mov", ".avi", ".m4v"),
        description="files taken from class sub-folders (ignoring case)")
    audio: ClipAudio | None = Field(
        None, description="also the clip's span of the audio track: `audio`, `audio_length`")
    skip_nonref: bool = Field(
        True, description="do not decode frames no kept frame depends on (same pixels)")

    @model_validator(mode="after")
    def _one_geometry(self) -> VideoDataset:
        size_or_transforms(self.size, self.transforms)
        return self

    @property
    def clips_per_video(self) -> Any:
        return self.clips.uniform if isinstance(self.clips, Uniform) else self.clips
