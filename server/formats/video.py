"""`format: video`: clips of video files, decoded in the workers with FFmpeg's libraries (PyAV).

Samples are clips. `clips: random` makes one sample per video, its start drawn from the
generator of (seed, epoch, sample index); `{uniform: K}` K samples per video, evenly spaced;
`all` every non-overlapping clip, counted at open (each file's packets are read then, not
decoded). Where a clip starts and which frames it keeps is planned on the file's frame table
(formats/_video.py) alone, so a sample is a pure function of (file, index, key), wherever it
is built. Frames are named by their presentation time; at the native size each is FFmpeg's
own RGB conversion of the frame shown there (`VideoFrame.to_ndarray(format="rgb24")`).

Fields: `video` (uint8 [T, 3, H, W] by `layout`, float32 once normalized), `timestamps`
(float64 [T], each frame's presentation time in seconds), `label` (int64) and, at the native
size, `video_size` (int64 [height, width]: videos of different sizes are zero-padded to the
batch's largest).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..images import ImagePipeline, resize_pipeline
from ..order.sampling import EpochKey
from ..sources import Storage
from ._clips import ClipPlan, read_video_manifest
from ._folders import class_folders
from ._video import (
    FrameTable,
    FrameTables,
    VideoError,
    _rgb,
    decode_frames,
    frame_table,
    open_video,
)
from .samples import padded

PREFIX_VERSION = 1  # part of every prefix cache key: a change to what a cached clip holds
# layout -> the transpose from the stacked frames: uint8 frames are HWC, normalized ones CHW
_FROM_HWC = {"tchw": (0, 3, 1, 2), "cthw": (3, 0, 1, 2), "thwc": (0, 1, 2, 3)}
_FROM_CHW = {"tchw": (0, 1, 2, 3), "cthw": (1, 0, 2, 3), "thwc": (0, 2, 3, 1)}


def clip_pipeline(cfg: Any) -> ImagePipeline:
    """The image pipeline every frame goes through, uint8 output in HWC."""
    if cfg.transforms is not None:
        from .image_config import transform_steps

        return ImagePipeline(transform_steps(cfg.transforms), "hwc")
    if cfg.size is not None:
        return resize_pipeline(cfg.size, "hwc")
    return ImagePipeline([], "hwc")


def prefix_frames(path: str | bytes, table: FrameTable, positions: np.ndarray,
                  pipeline: ImagePipeline, size: Any, skip: bool) -> np.ndarray:
    """The frames at `positions` of the table, each as the pipeline's prefix leaves it (with
    `size`: scaled by FFmpeg in the RGB conversion's pass), stacked (T, H, W, 3)."""
    if size is not None:
        height, width = size

        def convert(frame: Any) -> np.ndarray:
            # One pass of FFmpeg's scaler: resized (area-averaged) and made RGB at once, a
            # third of the cost of RGB at full size and then a resize.
            return _rgb(frame, width, height)
    else:

        def convert(frame: Any) -> np.ndarray:
            return pipeline.pixels_prefix(_rgb(frame))

    frames = decode_frames(path, table, positions, skip, convert)
    return np.stack([frames[int(p)] for p in positions])


def write_clip(out: dict[str, Any], name: str, prefix: np.ndarray, pipeline: ImagePipeline,
               size: Any, layout: str, rng: np.random.Generator) -> None:
    """`out[name]`: the clip from its prefix frames, the pipeline's random steps drawn once
    for all its frames, in `layout` (tchw, cthw, thwc); at the native size also
    `out[name + "_size"]` (the frames are padded to the batch's largest)."""
    if size is not None or not (pipeline.tail or pipeline.normalize):
        stacked = prefix
    else:
        # One draw for the clip's transforms: every frame gets the same crop and flip.
        seed = int(rng.integers(0, 2**63))
        stacked = np.stack([np.asarray(pipeline.rest(f, np.random.default_rng(seed)))
                            for f in prefix])
    order = (_FROM_CHW if pipeline.normalize else _FROM_HWC)[layout]
    out[name] = np.ascontiguousarray(stacked.transpose(order))
    if not pipeline.fixed_size and size is None:
        h, w = stacked.shape[2:4] if pipeline.normalize else stacked.shape[1:3]
        out[name] = padded(out[name], tuple(i for i, a in enumerate(layout) if a in "hw"))
        out[f"{name}_size"] = np.array([h, w], np.int64)


class ClipOfBytes:
    """`decode: video` of a tar member or a parquet cell: one clip of the video those bytes
    hold, its start drawn from the sample's generator. Thread-safe: nothing mutable."""

    def __init__(self, cfg: Any) -> None:
        self.plan = ClipPlan(cfg)
        self.pipeline = clip_pipeline(cfg)
        self.size = cfg.size if cfg.transforms is None else None
        self.layout = "tchw" if cfg.layout == "chw" else "thwc"

    def output_names(self, name: str) -> list[str]:
        sized = self.pipeline.fixed_size or self.size is not None
        return [name, f"{name}_timestamps"] + ([] if sized else [f"{name}_size"])

    def write(self, out: dict[str, Any], name: str, data: bytes,
              rng: np.random.Generator) -> None:
        container, stream = open_video(data)
        try:
            table = frame_table(container, stream)
        finally:
            container.close()
        positions = self.plan.positions(table, 0, rng)
        prefix = prefix_frames(data, table, positions, self.pipeline, self.size, True)
        write_clip(out, name, prefix, self.pipeline, self.size, self.layout, rng)
        out[f"{name}_timestamps"] = table.seconds(positions)


class FramesAt:
    """`decode: video_frames`: the frames shown at a row's time plus each offset, from the
    video file the row names (a key under the source). Thread-safe, as Video."""

    def __init__(self, cfg: Any) -> None:
        self.offsets = np.asarray(cfg.offsets, np.float64)
        self.pipeline = clip_pipeline(cfg)
        self.size = cfg.size if cfg.transforms is None else None
        self.layout = "tchw" if cfg.layout == "chw" else "thwc"
        self.tables = FrameTables()

    def output_names(self, name: str) -> list[str]:
        sized = self.pipeline.fixed_size or self.size is not None
        return [name, f"{name}_timestamps"] + ([] if sized else [f"{name}_size"])

    def write(self, out: dict[str, Any], name: str, storage: Storage, key: str, time: float,
              rng: np.random.Generator) -> None:
        try:
            path = str(storage.local_path(key.removeprefix("./")))
            table = self.tables.get(path)
            positions = table.shown_at(time + self.offsets)
            prefix = prefix_frames(path, table, positions, self.pipeline, self.size, True)
        except VideoError as e:
            raise VideoError(f"{storage.where(key)}: {e}") from None
        write_clip(out, name, prefix, self.pipeline, self.size, self.layout, rng)
        out[f"{name}_timestamps"] = table.seconds(positions)


class Video:
    """Thread-safe: the frame tables' cache is; the rest is immutable."""

    @property
    def threaded_samples(self) -> bool:
        """Its samples spend their time in FFmpeg, which releases the GIL: a worker with cores
        to spare (fewer workers than cores) decodes several of a batch's clips at once
        (pool/batch.py in_order). Not with the prefix cache, whose handle is one thread's."""
        return self.cache is None

    def __init__(self, cfg: Any, storage: Storage, pattern: str | None = None) -> None:
        self.storage = storage
        self.labelled = True
        if cfg.manifest is not None:
            rows = read_video_manifest(storage, cfg.manifest)
            listed = {o.key for o in storage.list(pattern)}
            missing = [r[0] for r in rows if r[0] not in listed]
            if missing:
                raise ValueError(f"{storage.where(cfg.manifest)}: no file {missing[0]!r} under "
                                 f"{storage.url}")
            keys = [r[0] for r in rows]
            labels = [r[1] for r in rows]
            bounds = [(r[2], r[3]) for r in rows]
        else:
            keys, labels = class_folders(storage, pattern, tuple(cfg.extensions))
            bounds = [(None, None)] * len(keys)
        # Fixed-width numpy arrays, not lists of str: no per-item refcounts to copy on write.
        self.keys = np.array(keys)
        self.labels = np.array(labels, dtype=np.int64)
        self.bounds = np.array([(np.nan if a is None else a, np.nan if b is None else b)
                                for a, b in bounds], np.float64)
        self.plan = ClipPlan(cfg)
        self.pipeline = clip_pipeline(cfg)
        self.layout = cfg.layout
        # `size:` alone is resized by FFmpeg's scaler as the frame becomes RGB (see convert)
        self.size = cfg.size if cfg.transforms is None else None
        self.skip = cfg.skip_nonref
        self.audio = cfg.audio
        self.cache: Any = None  # a _prefix_cache.Scope, given by use_prefix_cache
        self._tables = FrameTables()
        mode = self.plan.mode
        if mode == "all":
            counts = [self._count(v) for v in range(len(keys))]
        else:
            counts = [mode if isinstance(mode, int) else 1] * len(keys)  # random: one
        # starts[v]: video v's first sample; sample i is clip i - starts[v] of video v.
        self.starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self.length = int(self.starts[-1])

    def _count(self, video: int) -> int:
        """Its clips under `clips: all`; an unreadable file counts one, which fails (or is
        skipped) when read, so the dataset opens and says which file is bad per sample."""
        try:
            return self.plan.count(self.table(video), *self._bounds(video))
        except (VideoError, OSError):
            return 1

    def _bounds(self, video: int) -> tuple[float | None, float | None]:
        a, b = self.bounds[video]
        return (None if np.isnan(a) else float(a)), (None if np.isnan(b) else float(b))

    def table(self, video: int) -> FrameTable:
        return self._tables.get(str(self.storage.local_path(str(self.keys[video]))))

    def __len__(self) -> int:
        return self.length

    def locate(self, index: int) -> tuple[int, int]:
        """(video, clip number) of sample `index`."""
        if not 0 <= index < self.length:
            raise IndexError(f"sample {index} of {self.length}")
        video = int(np.searchsorted(self.starts, index, "right")) - 1
        return video, index - int(self.starts[video])

    def use_prefix_cache(self, scope: Any) -> None:
        """Keep decoded clips where a clip is a function of its index alone (`uniform`,
        `all`): each frame as the pipeline's prefix leaves it (decoded, RGB, and resized or
        cropped by the steps before the first random one), with the clip's timestamps."""
        if self.plan.mode != "random":
            spec = (PREFIX_VERSION, self.plan.frames, self.plan.stride, str(self.plan.fps),
                    self.plan.short, self.size, self.pipeline.prefix_spec)
            self.cache = scope("clip", repr(spec))

    def _prefix(self, index: int, video: int, clip: int, rng: np.random.Generator
                ) -> tuple[np.ndarray, np.ndarray]:
        """The clip's frames as the pipeline's prefix leaves them, stacked (T, H, W, 3), and
        their timestamps: from the prefix cache, or decoded (and then kept there)."""
        hit = None if self.cache is None else self.cache.get(index)
        if hit is not None:
            return hit["frames"], hit["timestamps"]
        table = self.table(video)
        positions = self.plan.positions(table, clip, rng, *self._bounds(video))
        path = str(self.storage.local_path(str(self.keys[video])))
        stacked = prefix_frames(path, table, positions, self.pipeline, self.size, self.skip)
        times = table.seconds(positions)
        if self.cache is not None:
            self.cache.put(index, {"frames": stacked, "timestamps": times})
        return stacked, times

    def sample(self, index: int, key: EpochKey) -> dict[str, Any]:
        video, clip = self.locate(index)
        rng = key.rng(index)  # a random clip's start, then the clip's transforms
        try:
            prefix, times = self._prefix(index, video, clip, rng)
        except VideoError as e:
            raise VideoError(f"{self.source_of(index)}: {e}") from None
        out: dict[str, Any] = {}
        write_clip(out, "video", prefix, self.pipeline, self.size, self.layout, rng)
        out["timestamps"] = np.array(times, np.float64)
        if self.audio is not None:
            try:
                self._write_audio(out, video, out["timestamps"])
            except VideoError as e:
                raise VideoError(f"{self.source_of(index)}: audio: {e}") from None
        if self.labelled:
            out["label"] = self.labels[video]
        return out

    def _write_audio(self, out: dict[str, Any], video: int, times: np.ndarray) -> None:
        """`audio` (float32 [channels, n], zero-padded to the batch's longest) and
        `audio_length`: the audio track from the clip's first frame's time to the end of its
        last frame (its next frame's time), resampled as format: audio does (sample k of the
        track is at k / sample_rate seconds; a late clip's from a seek, audio.decode_span)."""
        from .audio import decode_span

        seconds = self.table(video).seconds(np.arange(len(self.table(video))))
        after = int(np.searchsorted(seconds, times[-1], "right"))
        if after < len(seconds):
            end = float(seconds[after])
        else:  # the video's last frame: as long as a typical frame
            end = times[-1] + (float(np.median(np.diff(seconds))) if len(seconds) > 1 else 0)
        rate = self.audio.sample_rate
        a = round(times[0] * rate)
        b = max(round(end * rate), a + 1)
        path = str(self.storage.local_path(str(self.keys[video])))
        sound = decode_span(path, rate, self.audio.channels, a, b)
        if sound.shape[1] < b - a:  # the track ends before the clip: zeros after
            sound = np.pad(sound, ((0, 0), (0, b - a - sound.shape[1])))
        out["audio"] = padded(np.ascontiguousarray(sound), (1,))
        out["audio_length"] = np.int64(b - a)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.sample(index, EpochKey())

    def source_of(self, index: int) -> str:
        video, clip = self.locate(index)
        return f"{self.storage.where(str(self.keys[video]))} clip {clip}"

    def place_of(self, index: int) -> dict[str, Any]:
        """Its file (the provenance message has no field for the clip: source_of says it)."""
        video, _ = self.locate(index)
        return {"file": self.storage.where(str(self.keys[video]))}

    def objects_of(self, indices: np.ndarray) -> list[str]:
        videos = np.searchsorted(self.starts, np.asarray(indices), "right") - 1
        return [str(k) for k in self.keys[np.unique(videos)]]
