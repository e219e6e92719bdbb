"""Video decoding with FFmpeg's libraries (PyAV): a file's frame table, and the frames at given
presentation timestamps, decoded from the keyframe before them.

A frame is named by its presentation timestamp (pts, in the stream's time base): the frame
table lists every frame's pts in presentation order, read from the container's packets
without decoding (a packet is one frame for H.264, HEVC, VP9 and AV1). What `decode_frames`
returns for a pts is, byte for byte, what decoding the file from its start without seeking and
converting with `VideoFrame.to_ndarray(format="rgb24")` gives for the frame with that pts:
decoding starts at a keyframe, from which decoders produce the same frames, and any doubt
(the seek landed after the wanted frames, a wanted frame never came out) is settled by
decoding again from the start, not by guessing.

`skip: True` decodes only what the kept frames need: a packet whose frame is not wanted is
sent with the decoder's `skip_frame = NONREF`, so that a frame no other frame refers to (most
B-frames) is dropped unparsed, while reference frames are still decoded. Only for the codecs
in `SKIPS_NONREF`, whose decoders read the setting per picture: dav1d (AV1) reads it once at
open and then drops frames that are wanted (measured: half the clips fell back to a full
decode), and VP9 gains nothing: every frame libvpx makes refreshes a reference slot (all of
the benchmark's VP9 frames are references, against 52% of its H.264 ones), so a VP9 clip
costs every frame from the keyframe before it to its last.

Workers are processes, one per core: decoders run on one thread each (no frame threads, whose
delay would also hold frames back). Not thread-safe: one container per call.
"""

from __future__ import annotations

import bisect
import io
import threading
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from .._lru import LRU

try:
    import av
except ImportError as e:  # the server opens a video or audio dataset without the extra
    raise ImportError("format: video and format: audio need PyAV: pip install "
                      "'stoker[server,video]'") from e

from av.video.reformatter import VideoReformatter  # after the check above

av.logging.set_level(av.logging.PANIC)  # FFmpeg's own warnings: errors are raised, with text


SKIPS_NONREF = frozenset({"h264", "hevc"})


class VideoError(ValueError):
    """The file is not a video stoker can decode: the message says what FFmpeg said."""


@dataclass(frozen=True)
class FrameTable:
    """A video stream's frames: `pts` (int64, ascending, presentation order) and each
    keyframe's position in it (`keys`), in `time_base` seconds per tick."""

    pts: np.ndarray
    keys: np.ndarray
    time_base: Fraction

    def __len__(self) -> int:
        return len(self.pts)

    def seconds(self, positions: np.ndarray) -> np.ndarray:
        """Presentation times in seconds, each the float nearest pts * time_base (one
        rounding: what `float(pts * stream.time_base)` gives)."""
        ticks = self.pts[positions] * self.time_base.numerator  # exact below 2**53
        return ticks.astype(np.float64) / self.time_base.denominator

    def shown_at(self, seconds: np.ndarray) -> np.ndarray:
        """The position of the frame shown at each time: the last frame starting at or before
        it (the first frame for times before it). A thousandth of a tick of tolerance, so that
        a time written as a float of a frame's own pts finds that frame."""
        ticks = np.floor(np.asarray(seconds, np.float64) / float(self.time_base) + 1e-3)
        return np.maximum(np.searchsorted(self.pts, ticks.astype(np.int64), "right") - 1, 0)


# Opening a file, FFmpeg's probe (avformat_find_stream_info) opens a decoder of its own and
# decodes the first frames to learn what the header leaves out: the pixel format, H.264's
# reordering delay. Nothing here needs them before decoding (the decoder finds them in the
# bitstream; frames are matched by pts, not by output order), and it cost a ninth of a VP9
# clip's CPU: 2.8 ms per open against 0.15 ms (480x360 WebM: its first frame decoded twice),
# 0.85 against 0.25 ms in MP4/H.264. Allowing the demuxer no decoder skips it; the decoder
# PyAV opens is its own and takes no container option. The same bytes come out
# (tests/test_video.py, tests/test_video_decode.py).
_NO_PROBE_DECODER = {"codec_whitelist": "none"}


def _open(source: str | bytes, options: dict[str, str] | None) -> Any:
    try:
        return av.open(io.BytesIO(source) if isinstance(source, bytes) else source, "r",
                       container_options=options)
    except av.FFmpegError as e:
        raise VideoError(f"FFmpeg cannot open it: {e.strerror or e}") from None


def _sized(container: Any) -> bool:
    """Whether its first video stream's picture size is known (from the header alone)."""
    ctx = container.streams.video[0].codec_context if container.streams.video else None
    return bool(ctx is not None and ctx.width)


def open_video(source: str | bytes) -> tuple[Any, Any]:
    """(container, its first video stream) of a file's path or of a file's bytes (a tar
    member, a parquet cell), or VideoError naming what FFmpeg said."""
    try:
        container = _open(source, _NO_PROBE_DECODER)
    except VideoError:
        container = None  # its own error, if any, comes from the plain open below
    if container is None or not _sized(container):
        # Neither the header nor the demuxer's parser gave the picture's size: opened again
        # the usual way, FFmpeg's probe decoding the first frames to find it.
        if container is not None:
            container.close()
        container = _open(source, None)
    if not container.streams.video:
        container.close()
        raise VideoError("no video stream")
    stream = container.streams.video[0]
    ctx = stream.codec_context
    if ctx is None or ctx.codec is None:
        container.close()
        raise VideoError("no decoder for its codec")
    ctx.thread_count = 1
    return container, stream


def frame_table(container: Any, stream: Any) -> FrameTable:
    """Every frame's pts from the packets (no decoding); the container is read to its end."""
    pts, key = [], []
    try:
        for packet in container.demux(stream):
            if packet.size == 0 or packet.pts is None:
                continue  # the demuxer's last empty packet; a frame without pts is not named
            pts.append(packet.pts)
            key.append(packet.is_keyframe)
    except av.FFmpegError as e:
        raise VideoError(f"FFmpeg cannot read it: {e.strerror or e}") from None
    if not pts:
        raise VideoError("the video stream has no frames")
    order = np.argsort(np.asarray(pts, np.int64), kind="stable")
    sorted_pts = np.asarray(pts, np.int64)[order]
    if np.any(np.diff(sorted_pts) == 0):
        raise VideoError("two frames have the same presentation timestamp")
    is_key = np.asarray(key, bool)[order]
    is_key[0] = True  # decoding from the start always works: the start is a place to begin
    keys = np.flatnonzero(is_key)
    return FrameTable(sorted_pts, keys, Fraction(stream.time_base))


class FrameTables:
    """Frame tables by file path, the least recently used out first beyond `kept` (a few
    KiB each). Thread-safe: `_lock` guards `_tables`; two threads missing the same file both
    read it, and the second's equal table replaces the first's."""

    def __init__(self, kept: int = 4096) -> None:
        self._tables: LRU[str, FrameTable] = LRU(max_items=kept)
        self._lock = threading.Lock()

    def get(self, path: str) -> FrameTable:
        with self._lock:
            found = self._tables.get(path)
            if found is not None:
                return found
        container, stream = open_video(path)
        try:
            table = frame_table(container, stream)
        finally:
            container.close()
        with self._lock:
            self._tables.put(path, table)
        return table


# One FFmpeg scaler per thread, kept from frame to frame. `VideoFrame.to_ndarray(...)` made
# a new one for every frame before PyAV 17, and setting up its filters cost more than the
# scaling itself: 0.84 ms a frame against 0.25 ms kept, 480x360 to 112x112 (the same bytes).
_scalers = threading.local()
# On one thread: workers are processes, one per core, and since PyAV 17 the scaler splits
# each frame over threads on every core by default, which cost 20% more CPU a frame here
# (0.18 against 0.15 ms, 480x360 to 112x112 RGB; the same bytes).
_ONE_THREAD: dict[str, Any] = ({"threads": 1} if int(av.__version__.split(".")[0]) >= 17
                               else {})


def _reformat(frame: Any, **how: Any) -> Any:
    scaler = getattr(_scalers, "scaler", None)
    if scaler is None:
        scaler = _scalers.scaler = VideoReformatter()
    return scaler.reformat(frame, **how, **_ONE_THREAD)


def _rgb(frame: Any, width: int | None = None, height: int | None = None) -> np.ndarray:
    """FFmpeg's own RGB conversion of the frame (at width x height: scaled in the same pass,
    area-averaging), rotated as its display matrix says."""
    turn = int(getattr(frame, "rotation", 0) or 0) % 360
    if width is None:
        pixels = _reformat(frame, format="rgb24").to_ndarray()
    else:
        if turn in (90, 270):  # scaled before it is turned
            width, height = height, width
        pixels = _reformat(frame, width=width, height=height, format="rgb24",
                           interpolation="AREA").to_ndarray()
    if turn:  # counter-clockwise degrees, as FFmpeg's display matrix gives them
        pixels = np.ascontiguousarray(np.rot90(pixels, turn // 90))
    return pixels


def decode_frames(path: str | bytes, table: FrameTable, positions: np.ndarray, skip: bool = True,
                  convert: Any = _rgb) -> dict[int, Any]:
    """{position: convert(frame)} for each wanted position of the table (each converted once,
    however often it repeats). Raises VideoError naming what went wrong."""
    wanted = sorted({int(p) for p in positions})
    first = wanted[0]
    k = bisect.bisect_right(table.keys.tolist(), first) - 1  # the keyframe at or before it
    out = _decode(path, table, wanted, k, skip, convert)
    if out is None and skip:
        out = _decode(path, table, wanted, k, False, convert)
    if out is None and k > 0:
        out = _decode(path, table, wanted, 0, False, convert)  # from the start, no seek
    if out is None:
        raise VideoError(f"frames at pts {[int(table.pts[p]) for p in wanted][:4]} were not "
                         "decoded (a truncated or damaged file?)")
    return out


def _decode(path: str | bytes, table: FrameTable, wanted: list[int], k: int, skip: bool,
            convert: Any) -> dict[int, Any] | None:
    """The wanted frames decoded from keyframe `k` of the table, or None when one of them
    did not come out (the caller tries a safer way)."""
    by_pts = {int(table.pts[p]): p for p in wanted}
    first = int(table.pts[wanted[0]])
    out: dict[int, Any] = {}
    container, stream = open_video(path)
    ctx = stream.codec_context
    skip = skip and ctx.codec.name in SKIPS_NONREF
    try:
        if k > 0:
            # By the keyframe's pts: MP4's index, asked for a keyframe's dts, lands a whole
            # GOP earlier (measured). Landing early costs time only; late is caught below.
            container.seek(int(table.pts[table.keys[k]]), stream=stream, backward=True,
                           any_frame=False)
        started = False
        unsent = set(by_pts)  # wanted frames whose packet is still to come
        for packet in container.demux(stream):
            if packet.pts is not None:
                unsent.discard(packet.pts)
                if skip:
                    ctx.skip_frame = "DEFAULT" if packet.pts in by_pts else "NONREF"
            # Once every wanted packet is in, the decoder is drained (None) instead of fed
            # more: the frames it holds back for reordering come out without decoding the
            # packets after them, which no wanted frame refers to (decode order).
            batches = [packet, None] if not unsent and packet.size else [packet]
            for sent in batches:
                for frame in ctx.decode(sent):
                    if frame.pts is None:
                        continue
                    if not started:
                        started = True
                        if frame.pts > first:
                            return None  # the seek landed after the first wanted frame
                    p = by_pts.get(frame.pts)
                    if p is not None:
                        out[p] = convert(frame)
            if len(out) == len(by_pts) or not unsent:
                break
    except av.FFmpegError as e:
        raise VideoError(f"FFmpeg cannot decode it: {e.strerror or e}") from None
    finally:
        container.close()
    return out if len(out) == len(by_pts) else None
