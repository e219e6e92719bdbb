"""The config model of `format: video` (read by formats/video.py), and the clip settings it
shares with `decode: video` elsewhere."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from .config_base import Sourced, Strict, Suffixes
from .image_config import ImageSize, Transforms, size_or_transforms


class Clip(Strict):
    """T frames: every `stride`-th decoded frame, or the frames shown at start + k / `fps`.

    Attributes:
        frames: T, 1-4096: frames per clip.
        stride: Every S-th decoded frame (S >= 1); one of `stride`, `fps`.
        fps: Instead: the frames shown at start + k / F seconds (F > 0).
    """

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
    """`clips: {uniform: K}`: K evenly spaced clips per video, each a sample.

    Attributes:
        uniform: Evenly spaced clips per video.
    """

    uniform: int = Field(ge=1, le=1 << 20, description="evenly spaced clips per video")


class ClipAudio(Strict):
    """The clip's span of the file's audio track, resampled as `format: audio` does.

    Attributes:
        sample_rate: 1000 to 384000 Hz, the audio's rate after resampling.
        channels: 1 to 8, mixed by the resampler.
    """

    sample_rate: int = Field(16000, ge=1000, le=384000)
    channels: int = Field(1, ge=1, le=8)


class VideoDataset(Sourced):
    """Video files under `source`: one sub-folder per class (class index = sorted folder
    order), or the files a `manifest` lists (`path`, `label`, optional `start`/`end` seconds
    bounding where clips are taken). A sample is a clip: see docs/configuration.md.

    Attributes:
        format: `"video"`: selects this model (the key every dataset gives).
        clip: `frames` (T >= 1) and exactly one of `stride` (every S-th decoded frame, S >= 1) or
            `fps` (the frames shown at start + k / F seconds, F > 0).
        clips: `random`: one clip per video, its start drawn from (seed, epoch, sample index);
            `{uniform: K}`: K evenly spaced clips per video, each its own sample; `all`: every
            non-overlapping clip, counted when the dataset opens.
        short: A video shorter than its clip: its last frame repeated to T frames, or the sample
            fails (DATA_LOSS naming the file).
        size: A plain resize of every frame, by FFmpeg's scaler (area-averaging) in the same pass as
            the RGB conversion.
        transforms: The image transforms, one random draw per clip: every frame of a clip gets the
            same crop and flip.
        layout: The `video` field's axes; uint8, or float32 after `normalize`.
        manifest: A CSV (`path,label[,start,end]`) or JSON lines file under `source`; `start`/`end`
            (seconds) bound where that video's clips are taken.
        extensions: The files taken from class sub-folders (any case).
        audio: `{sample_rate: 16000, channels: 1}`: also the clip's span of the audio track, from
            its first frame's time to the end of its last frame, decoded and resampled as format:
            audio does (`audio` float32 `[channels, n]`, zero-padded to the batch's longest, and
            `audio_length`).
        skip_nonref: H.264 and HEVC: frames no kept frame depends on are not decoded (the same
            pixels, fewer decoded frames); false: every frame from the keyframe on.
    """

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
