"""`format: audio`: sound files decoded, resampled and mixed by FFmpeg's libraries (PyAV).

A sample is `duration` seconds of a file at `sample_rate` Hz and `channels` channels, starting
at a sample drawn from the generator of (seed, epoch, sample index) (`crops: random`, one
sample per file), or at K evenly spaced places (`{uniform: K}`, K samples per file); without
`duration`, the whole file, zero-padded to the batch's longest, with its `length`.

Every value is what decoding the file from its start with PyAV and resampling it with
`av.AudioResampler(format="fltp", layout=..., rate=...)` gives at that position, within the
issue's bound. A crop that starts early in the file (below) is decoded from the start
(exactly the reference). A later one seeks to PREROLL seconds before the crop and decodes
from the packet the demuxer lands on: the codec's state (MDCT overlap, MP3's bit reservoir,
Opus' pre-roll) and the resampler's filter history settle within that time, and the first
decoded frame is cut so that resampling starts on the same phase as the whole file's (a
multiple of src / gcd(src, rate) source samples), so the output samples sit at the same
positions. The frame's place is its pts less the first frame's. Should the seek land after
the crop, or a frame have no pts, the crop is decoded from the start instead. Crops that
start within SETTLE + PREROLL seconds of the file's start are decoded from its start:
FFmpeg's AAC decoder differs there after any seek (see SETTLE).

Fields: `audio` float32 [channels, samples], `audio_start` (float64 seconds into the file),
`label` (int64), and, for whole files, `length` (int64: samples before padding).
"""

from __future__ import annotations

from math import gcd
from typing import Any

import numpy as np

from ..order.sampling import EpochKey
from ..sources import Storage
from ._clips import read_video_manifest
from ._folders import class_folders
from ._video import VideoError, av
from .samples import padded

PREROLL = 0.5  # seconds decoded before a crop's start when seeking (Opus asks for 80 ms)
# A seek lands no earlier than this into the file: FFmpeg's AAC decoder gives different
# samples for the first ~0.84 s (18432 samples at 22.05 kHz) after a seek than from the
# file's start, even a seek to 0; from there on they agree after one frame.
SETTLE = 1.0
LAYOUTS = {1: "mono", 2: "stereo", 3: "2.1", 4: "quad", 5: "5.0", 6: "5.1", 7: "6.1", 8: "7.1"}


def file_seconds(path: str) -> float:
    """The audio stream's duration from the container's header (no decoding)."""
    with av.open(path) as container:
        if not container.streams.audio:
            raise VideoError("no audio stream")
        stream = container.streams.audio[0]
        if stream.duration is not None and stream.time_base is not None:
            return float(stream.duration * stream.time_base)
        if container.duration is not None:
            return container.duration / av.time_base
    raise VideoError("its duration is not in its header")


def _first_audio(container: Any) -> Any:
    """The container's first audio stream, decoded on one thread (a worker is one core)."""
    if not container.streams.audio:
        raise VideoError("no audio stream")
    stream = container.streams.audio[0]
    stream.codec_context.thread_count = 1
    return stream


def decode_audio(path: str, rate: int, channels: int, stop: int | None) -> np.ndarray:
    """float32 [channels, samples]: the file from its start, resampled, up to sample `stop`
    (None: to its end)."""
    parts: list[np.ndarray] = []
    have = 0
    try:
        with av.open(path) as container:
            stream = _first_audio(container)
            resampler = av.AudioResampler(format="fltp", layout=LAYOUTS[channels], rate=rate)

            def take(frames: list[Any]) -> None:
                nonlocal have
                for f in frames:
                    parts.append(f.to_ndarray())
                    have += parts[-1].shape[1]

            for frame in container.decode(stream):
                take(resampler.resample(frame))
                if stop is not None and have >= stop:
                    break
            else:
                take(resampler.resample(None))
    except av.FFmpegError as e:
        raise VideoError(f"FFmpeg cannot decode it: {e.strerror or e}") from None
    if not parts:
        raise VideoError("no audio decoded")
    out = np.concatenate(parts, axis=1)
    return out if stop is None else out[:, :stop]


def _cut(frame: Any, drop: int) -> Any:
    """The frame without its first `drop` samples."""
    arr = frame.to_ndarray()
    per = 1 if frame.format.is_planar else len(frame.layout.channels)  # packed: interleaved
    cut = av.AudioFrame.from_ndarray(np.ascontiguousarray(arr[:, drop * per:]),
                                     format=frame.format.name, layout=frame.layout.name)
    cut.sample_rate = frame.sample_rate
    cut.time_base = frame.time_base
    cut.pts = frame.pts + round(drop / frame.sample_rate / frame.time_base)
    return cut


def decode_span(path: str, rate: int, channels: int, start: int, stop: int) -> np.ndarray:
    """float32 [channels, <= stop - start]: samples [start, stop) of the file as decode_audio
    gives them, from a seek PREROLL seconds before `start` (see the module's docstring)."""
    if start < (SETTLE + PREROLL) * rate:
        return decode_audio(path, rate, channels, stop)[:, start:]
    parts: list[np.ndarray] = []
    try:
        with av.open(path) as container:
            stream = _first_audio(container)
            first = next(iter(container.decode(stream)), None)
            if first is None or first.pts is None or stream.time_base is None:
                return decode_audio(path, rate, channels, stop)[:, start:]
            tb, src = stream.time_base, first.sample_rate
            step = src // gcd(src, rate)  # source samples per whole cycle of output phases
            target = first.pts + int((start / rate - PREROLL) / tb)
            container.seek(target, stream=stream, backward=True)
            resampler = av.AudioResampler(format="fltp", layout=LAYOUTS[channels], rate=rate)
            at = None  # the output index of the first resampled sample
            have = 0
            for frame in container.decode(stream):
                if at is None:
                    if frame.pts is None:
                        return decode_audio(path, rate, channels, stop)[:, start:]
                    s0 = round((frame.pts - first.pts) * tb * src)
                    drop = -s0 % step
                    if drop >= frame.samples:
                        continue
                    at = (s0 + drop) * rate // src
                    if s0 < 0 or at > start:  # landed after the crop: from the start
                        return decode_audio(path, rate, channels, stop)[:, start:]
                    frame = _cut(frame, drop) if drop else frame
                for f in resampler.resample(frame):
                    parts.append(f.to_ndarray())
                    have += parts[-1].shape[1]
                if at + have >= stop:
                    break
            else:
                parts += [f.to_ndarray() for f in resampler.resample(None)]
    except av.FFmpegError as e:
        raise VideoError(f"FFmpeg cannot decode it: {e.strerror or e}") from None
    if not parts or at is None:
        raise VideoError("no audio decoded")
    return np.concatenate(parts, axis=1)[:, start - at: stop - at]


class Audio:
    """Thread-safe: immutable after open."""

    def __init__(self, cfg: Any, storage: Storage, pattern: str | None = None) -> None:
        self.storage = storage
        if cfg.manifest is not None:
            rows = read_video_manifest(storage, cfg.manifest)
            keys, labels = [r[0] for r in rows], [r[1] for r in rows]
        else:
            keys, labels = class_folders(storage, pattern, tuple(cfg.extensions))
        self.keys = np.array(keys)
        self.labels = np.array(labels, dtype=np.int64)
        self.rate = cfg.sample_rate
        self.channels = cfg.channels
        self.crop = None if cfg.duration is None else round(cfg.duration * cfg.sample_rate)
        self.per_file = 1 if cfg.crops == "random" or self.crop is None else cfg.crops.uniform
        self.length = len(keys) * self.per_file

    def __len__(self) -> int:
        return self.length

    def _start(self, path: str, index: int, key: EpochKey) -> int:
        """The crop's first sample: a pure function of the file's header, index and key."""
        assert self.crop is not None
        room = int(file_seconds(path) * self.rate) - self.crop
        if room <= 0:
            return 0
        if self.per_file == 1:
            return int(key.rng(index).integers(0, room + 1))
        k = index % self.per_file
        return round(k * room / (self.per_file - 1)) if self.per_file > 1 else room // 2

    def sample(self, index: int, key: EpochKey) -> dict[str, Any]:
        if not 0 <= index < self.length:
            raise IndexError(f"sample {index} of {self.length}")
        file = index // self.per_file
        path = str(self.storage.local_path(str(self.keys[file])))
        try:
            if self.crop is None:
                audio = decode_audio(path, self.rate, self.channels, None)
                return {"audio": padded(audio, (1,)), "audio_start": np.float64(0.0),
                        "length": np.int64(audio.shape[1]), "label": self.labels[file]}
            start = self._start(path, index, key)
            audio = decode_span(path, self.rate, self.channels, start, start + self.crop)
        except VideoError as e:
            raise VideoError(f"{self.source_of(index)}: {e}") from None
        if audio.shape[1] < self.crop:  # the header said more than there was: zeros after
            audio = np.pad(audio, ((0, 0), (0, self.crop - audio.shape[1])))
        return {"audio": np.ascontiguousarray(audio), "audio_start": np.float64(start / self.rate),
                "label": self.labels[file]}

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.sample(index, EpochKey())

    def source_of(self, index: int) -> str:
        return self.storage.where(str(self.keys[index // self.per_file]))

    def place_of(self, index: int) -> dict[str, Any]:
        return {"file": self.source_of(index)}

    def objects_of(self, indices: np.ndarray) -> list[str]:
        return [str(k) for k in self.keys[np.unique(np.asarray(indices) // self.per_file)]]
