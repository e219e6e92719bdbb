"""Small test videos and sounds, made with PyAV's own encoders: H.264 with B-frames (MP4),
HEVC (MP4), VP9 (WebM), AV1 (MKV), a variable-frame-rate H.264 file, and audio files in
wav, flac, mp3, ogg/opus and m4a/aac. Pictures are smooth gradients that move plus noise, so
that every frame differs and chroma rounds differently between conversions."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import av
import numpy as np

# name -> (encoder, container suffix, options): the files test_video.py checks exactly.
CODECS = {
    "h264": ("libx264", ".mp4", {"bf": "3", "g": "24", "preset": "ultrafast",
                                 "x264-params": "bframes=3:b-pyramid=normal:scenecut=0"}),
    "hevc": ("libx265", ".mp4", {"preset": "ultrafast", "g": "24",
                                 "x265-params": "log-level=none:bframes=3:keyint=24"}),
    "vp9": ("libvpx-vp9", ".webm", {"deadline": "realtime", "cpu-used": "8", "g": "24",
                                    "lag-in-frames": "0"}),
    "av1": ("libsvtav1", ".mkv", {"preset": "12", "g": "24", "svtav1-params": "lp=1"}),
}


def available(encoder: str) -> bool:
    try:
        av.codec.Codec(encoder, "w")
    except Exception:
        return False
    return True


def picture(h: int, w: int, n: int, seed: int) -> np.ndarray:
    yy, xx = np.mgrid[0:h, 0:w]
    smooth = np.stack([(xx + 3 * n) * 255 // w, (yy + 2 * n) * 255 // h,
                       (xx + yy + 5 * n) * 255 // (h + w)], -1)
    noise = np.random.default_rng([seed, n]).integers(0, 24, (h, w, 3))
    return ((smooth + noise) % 256).astype(np.uint8)


def write_video(path: Path, codec: str = "h264", frames: int = 48, fps: int = 24,
                size: tuple[int, int] = (48, 64), seed: int = 0,
                vfr: bool = False, audio: bool = False) -> Path:
    """A video of `frames` frames (size: height, width). `vfr`: frame durations vary (1 to 3
    ticks of 1/(2*fps)), in an MP4 with a 1/1000 time base."""
    encoder, suffix, options = CODECS[codec]
    path = path.with_suffix(suffix)
    with av.open(str(path), "w") as out:
        stream = out.add_stream(encoder, rate=fps, options=dict(options))
        stream.height, stream.width = size
        stream.pix_fmt = "yuv420p"
        if vfr:
            stream.codec_context.time_base = Fraction(1, 1000)
        sound = None
        if audio:
            sound = out.add_stream("aac", rate=16000)
            sound.layout = "mono"
        ticks = 0
        steps = np.random.default_rng(seed).integers(1, 4, frames)
        for n in range(frames):
            frame = av.VideoFrame.from_ndarray(picture(*size, n, seed), format="rgb24")
            if vfr:
                frame.pts = int(ticks * 1000 / (2 * fps))
                frame.time_base = Fraction(1, 1000)
                ticks += int(steps[n])
            else:
                frame.pts = n
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
        if sound is not None:
            _write_tone(out, sound, frames / fps, 16000, 1)
    return path


def tone(seconds: float, rate: int, channels: int, seed: int = 0) -> np.ndarray:
    """float32 [channels, samples]: two sines and a little noise per channel."""
    t = np.arange(int(seconds * rate)) / rate
    rng = np.random.default_rng(seed)
    rows = [0.4 * np.sin(2 * np.pi * (220 + 110 * c) * t) + 0.2 * np.sin(2 * np.pi * 1250 * t)
            + 0.01 * rng.standard_normal(len(t)) for c in range(channels)]
    return np.asarray(rows, np.float32)


def _write_tone(out: av.container.OutputContainer, stream: av.AudioStream, seconds: float,
                rate: int, channels: int) -> None:
    data = tone(seconds, rate, channels)
    fmt = stream.codec_context.codec.audio_formats[0].name
    layout = "mono" if channels == 1 else "stereo"
    resampler = av.AudioResampler(format=fmt, layout=layout, rate=stream.rate)
    for s in range(0, data.shape[1], 1024):
        chunk = np.ascontiguousarray(data[:, s:s + 1024].T.reshape(1, -1))  # packed flt
        frame = av.AudioFrame.from_ndarray(chunk, format="flt", layout=layout)
        frame.sample_rate = rate
        frame.pts = s
        for f in resampler.resample(frame):
            out.mux(stream.encode(f))
    for f in resampler.resample(None):
        out.mux(stream.encode(f))
    out.mux(stream.encode(None))


# suffix -> (encoder, sample rate the file is written at)
AUDIO = {".wav": ("pcm_s16le", 22050), ".flac": ("flac", 22050), ".mp3": ("libmp3lame", 22050),
         ".opus": ("libopus", 48000), ".m4a": ("aac", 22050)}


def write_audio(path: Path, suffix: str, seconds: float = 2.0, channels: int = 2) -> Path:
    encoder, rate = AUDIO[suffix]
    path = path.with_suffix(suffix)
    options = {"format": "ogg"} if suffix == ".opus" else {}
    with av.open(str(path), "w", **options) as out:
        stream = out.add_stream(encoder, rate=rate)
        stream.layout = "mono" if channels == 1 else "stereo"
        _write_tone(out, stream, seconds, rate, channels)
    return path
