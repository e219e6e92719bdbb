"""Which frames a clip keeps (`ClipPlan`: a pure function of a video's frame table, the clip's
number and the sample's generator), and the video manifest (`path,label[,start,end]`) that
format: video and format: audio read."""

from __future__ import annotations

import csv
import io
import json
import math
from fractions import Fraction
from typing import Any, Literal

import numpy as np

from ..sources import Storage
from ._video import FrameTable, VideoError


def _bound(value: Any, where: str, name: str) -> float | None:
    if value is None or value == "":
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: {name} must be seconds (a number), got {value!r}") from None


def read_video_manifest(storage: Storage, manifest: str) -> list[tuple[str, int, Any, Any]]:
    """(key, label, start, end) rows of a CSV (header `path,label[,start,end]`) or JSON lines
    manifest; start and end are seconds or None."""
    where = storage.where(manifest)
    text = storage.read(manifest).decode("utf-8-sig")
    rows: list[dict[str, Any]] = []
    if manifest.lower().endswith(".csv"):
        rows = [{k.strip(): (v or "").strip() for k, v in r.items() if k}
                for r in csv.DictReader(io.StringIO(text, newline=""))]
    elif manifest.lower().endswith((".jsonl", ".json")):
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where} line {n}: not JSON: {e}") from None
    else:
        raise ValueError(f"{where}: a manifest must end in .csv, .jsonl or .json")
    out = []
    for n, row in enumerate(rows, 1):
        if not isinstance(row, dict) or not row.get("path") or "label" not in row:
            raise ValueError(f"{where} row {n}: expected `path` and `label`")
        key = str(row["path"]).removeprefix("./")
        if key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"{where} row {n}: path {key!r} must stay under the source")
        try:
            label = int(row["label"])
        except (TypeError, ValueError):
            raise ValueError(f"{where} row {n}: label must be an integer, got "
                             f"{row['label']!r}") from None
        start, end = (_bound(row.get(b), f"{where} row {n}", b) for b in ("start", "end"))
        if start is not None and end is not None and end <= start:
            raise ValueError(f"{where} row {n}: end {end} is not after start {start}")
        out.append((key, label, start, end))
    if not out:
        raise ValueError(f"{where}: the manifest lists no videos")
    return out


class ClipPlan:
    """Which frames of a video each clip keeps: a pure function of the frame table, the clip
    number and the sample's generator. Immutable; any thread."""

    def __init__(self, cfg: Any) -> None:
        self.frames = cfg.clip.frames
        self.stride = cfg.clip.stride
        self.fps = None if cfg.clip.fps is None else Fraction(str(cfg.clip.fps))
        self.short = cfg.short
        # "random", "all" or K; a clip of a tar member or parquet cell: one random clip
        self.mode: Literal["random", "all"] | int = getattr(cfg, "clips_per_video", "random")

    def _window(self, table: FrameTable, start: float | None, end: float | None
                ) -> tuple[int, int]:
        """[lo, hi): the frames shown from `start` up to `end` seconds."""
        seconds = table.seconds(np.arange(len(table)))
        lo = 0 if start is None else int(np.searchsorted(seconds, start - 1e-9, "left"))
        hi = len(table) if end is None else int(np.searchsorted(seconds, end - 1e-9, "left"))
        if hi <= lo:
            raise VideoError(f"no frame between start {start} and end {end} seconds")
        return lo, hi

    def _step(self, table: FrameTable) -> Fraction:
        assert self.fps is not None
        return 1 / (self.fps * table.time_base)  # ticks between the clip's frames

    def count(self, table: FrameTable, start: float | None, end: float | None) -> int:
        """Clips of this video under `clips: all` (at least one: a short video's one clip
        repeats its last frame, or fails under `short: error`)."""
        lo, hi = self._window(table, start, end)
        if self.stride is not None:
            return max((hi - lo) // ((self.frames - 1) * self.stride + 1), 1)
        step = self._step(table)
        room = int(table.pts[hi - 1] - table.pts[lo]) - (self.frames - 1) * step
        return int(room // (self.frames * step)) + 1 if room >= 0 else 1

    def positions(self, table: FrameTable, clip: int, rng: np.random.Generator,
                  start: float | None = None, end: float | None = None) -> np.ndarray:
        """The table positions of clip `clip`'s frames (int64 [T]); `rng` draws a random
        clip's start."""
        lo, hi = self._window(table, start, end)
        k = np.arange(self.frames, dtype=np.int64)
        if self.stride is not None:
            room = (hi - lo) - ((self.frames - 1) * self.stride + 1)
            first = lo + self._offset(room, clip, rng, (self.frames - 1) * self.stride + 1)
            return np.minimum(first + k * self.stride, hi - 1)
        step = self._step(table)
        span = (self.frames - 1) * step
        room_f = table.pts[hi - 1] - table.pts[lo] - span
        room = int(np.floor(room_f)) if room_f >= 0 else -1
        if self.mode == "random" and room >= 0:
            # A random clip starts at a frame: the one shown at its start is its first.
            last_start = int(np.searchsorted(table.pts, table.pts[lo] + room, "right")) - 1
            first = int(table.pts[lo + int(rng.integers(0, last_start - lo + 1))])
        else:
            first = int(table.pts[lo]) + self._offset(room, clip, rng, self.frames * step)
        ticks = np.array([first + math.floor(i * step) for i in range(self.frames)], np.int64)
        found = np.searchsorted(table.pts, ticks, "right") - 1
        return np.clip(found, lo, hi - 1)

    def _offset(self, room: int, clip: int, rng: np.random.Generator, length: Any) -> int:
        """Where the clip starts after the window's first frame (frames or ticks), given the
        `room` there is beyond one clip (negative: the video is shorter than the clip)."""
        if room < 0:
            if self.short == "error":
                raise VideoError(f"shorter than its clip of {self.frames} frames "
                                 "(short: error)")
            return 0
        if self.mode == "random":
            return int(rng.integers(0, room + 1))
        if self.mode == "all":
            return int(np.floor(clip * length))
        assert isinstance(self.mode, int)  # K clips a video, evenly spaced
        if self.mode == 1:
            return room // 2
        return round(clip * room / (self.mode - 1))
