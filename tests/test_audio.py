"""`format: audio` through a real server: at 16 kHz mono every crop equals PyAV's own decode and
resample of the whole file at the same position (wav, flac, mp3, opus, aac); uniform crops;
whole files padded to the batch's longest with their length; the same crops from any server."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

av = pytest.importorskip("av")

import video_files  # noqa: E402

from stoker.client import RemoteLoader  # noqa: E402
from stoker.server import ServerProcess  # noqa: E402
from stoker.server.formats import audio as audio_format  # noqa: E402

from conftest import StartServer  # noqa: E402

pytestmark = pytest.mark.timeout(120)

SUFFIXES = [s for s, (enc, _) in video_files.AUDIO.items() if video_files.available(enc)]
RATE = 16000
SEEKS_FROM = round((audio_format.SETTLE + audio_format.PREROLL) * RATE)  # crops from a seek


@pytest.fixture(scope="module")
def sounds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sounds")
    for i, suffix in enumerate(SUFFIXES):
        (root / f"c{i % 2}").mkdir(exist_ok=True)
        video_files.write_audio(root / f"c{i % 2}" / f"s{i}", suffix, seconds=1.5 + 0.25 * i)
    return root


@pytest.fixture(scope="module")
def server(sounds: Path, start_server_module: StartServer) -> ServerProcess:
    base = {"format": "audio", "source": str(sounds), "sample_rate": RATE, "channels": 1}
    return start_server_module({
        "crops": {**base, "duration": 0.5},
        "uniform": {**base, "duration": 0.5, "crops": {"uniform": 3}},
        "whole": base,
    }, workers=2)


def reference(path: Path) -> np.ndarray:
    """PyAV's own: the whole file decoded and resampled to 16 kHz mono, float32 [1, n]."""
    resampler = av.AudioResampler(format="fltp", layout="mono", rate=RATE)
    parts = []
    with av.open(str(path)) as f:
        for frame in f.decode(f.streams.audio[0]):
            parts += [r.to_ndarray() for r in resampler.resample(frame)]
    parts += [r.to_ndarray() for r in resampler.resample(None)]
    return np.concatenate(parts, axis=1)


def load(address: str, dataset: str, epochs: int, **kw) -> list[dict[str, np.ndarray]]:
    out = []
    with RemoteLoader(address, dataset, batch_size=1, seed=2, shuffle=False, output="numpy",
                      timeout=60, **kw) as loader:
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            out += [{k: v.copy() for k, v in b.items()} for b in loader]
    return out


@pytest.mark.parametrize("dataset", ["crops", "uniform"])
def test_each_crop_equals_pyav_decode_and_resample(server: ServerProcess, sounds: Path,
                                                   dataset: str) -> None:
    files = sorted(sounds.glob("*/*"))
    refs = [reference(p) for p in files]
    batches = load(server.address, dataset, 3 if dataset == "crops" else 1)
    per_file = 1 if dataset == "crops" else 3
    assert len(batches) == len(files) * per_file * (3 if dataset == "crops" else 1)
    starts = set()
    for n, batch in enumerate(batches):
        ref = refs[(n % (len(files) * per_file)) // per_file]
        audio = batch["audio"][0]
        assert audio.shape == (1, RATE // 2) and audio.dtype == np.float32
        start = round(float(batch["audio_start"][0]) * RATE)
        starts.add((n % len(files), start))
        # Past the file's end (its header counts Opus pre-skip and MP3/AAC padding): zeros.
        want = np.pad(ref, ((0, 0), (0, RATE)))[:, start:start + RATE // 2]
        assert np.max(np.abs(audio[:, 64:] - want[:, 64:])) <= 1e-3
        if not (start >= SEEKS_FROM and files[(n % (len(files) * per_file)) // per_file]
                .suffix == ".opus"):  # Opus after a seek: within 2e-7, not bit-exact
            assert np.array_equal(audio, want)
    assert len(starts) > len(files)  # random crops move between epochs


def test_whole_files_are_padded_with_their_length(server: ServerProcess, sounds: Path) -> None:
    files = sorted(sounds.glob("*/*"))
    with RemoteLoader(server.address, "whole", batch_size=len(files), shuffle=False,
                      output="numpy", timeout=60) as loader:
        (batch,) = list(loader)
    for audio, length, path in zip(batch["audio"], batch["length"], files, strict=True):
        ref = reference(path)
        assert length == ref.shape[1]
        assert np.array_equal(audio[:, :length], ref) and not audio[:, length:].any()


def test_a_bad_sound_file_fails_its_sample_naming_it_and_the_server_keeps_serving(
        sounds: Path, tmp_path: Path, start_server: StartServer, ledger) -> None:
    from stoker.client import RemoteError

    (tmp_path / "a").mkdir()
    video_files.write_audio(tmp_path / "a" / "good", ".wav", seconds=0.5)
    (tmp_path / "a" / "zbad.wav").write_bytes(b"RIFF, but not really a wave file" * 4)
    server = start_server({
        "bad": {"format": "audio", "source": str(tmp_path), "duration": 0.25},
        "good": {"format": "audio", "source": str(sounds), "duration": 0.25}})
    with pytest.raises(RemoteError) as info:
        load(server.address, "bad", 1)
    assert "a/zbad.wav" in str(info.value) and "sample 1" in str(info.value), info.value
    assert len(load(server.address, "good", 1)) == len(SUFFIXES)
    ledger.record("corrupt input", "audio: a text file named .wav",
                  detail="DATA_LOSS naming the file; another client's epoch completes")


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_a_late_crop_decoded_from_a_seek_equals_the_decode_from_the_start(
        tmp_path: Path, suffix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A crop late in a file is decoded from a seek PREROLL seconds before it, not from the
    file's start (checked: the whole-file path is never taken), and equals the decode from
    the start within 1e-3 (in fact exact but for Opus, within 2e-7)."""
    path = str(video_files.write_audio(tmp_path / "long", suffix, seconds=8.0))
    whole = audio_format.decode_audio(path, RATE, 1, None)
    from_start = []
    real = audio_format.decode_audio
    monkeypatch.setattr(audio_format, "decode_audio",
                        lambda *a: (from_start.append(a), real(*a))[1])
    crop = RATE // 2
    for start in range(SEEKS_FROM, whole.shape[1] - crop, 4999):
        got = audio_format.decode_span(path, RATE, 1, start, start + crop)
        assert got.shape == (1, crop) and got.dtype == np.float32
        assert np.max(np.abs(got - whole[:, start:start + crop])) <= 1e-3, start
    assert from_start == []
    early = audio_format.decode_span(path, RATE, 1, 100, 100 + crop)  # before SEEKS_FROM
    assert len(from_start) == 1 and np.array_equal(early, whole[:, 100:100 + crop])


def test_the_audio_track_of_a_video_from_a_seek_equals_its_decode_from_the_start(
        tmp_path: Path) -> None:
    """`audio:` on a video dataset reads the track through decode_span too (MP4 with AAC)."""
    path = str(video_files.write_video(tmp_path / "talk", "h264", frames=240, audio=True))
    whole = audio_format.decode_audio(path, 8000, 1, None)
    seeks_from = round((audio_format.SETTLE + audio_format.PREROLL) * 8000)
    for start in range(seeks_from, whole.shape[1] - 2000, 1333):
        got = audio_format.decode_span(path, 8000, 1, start, start + 2000)
        assert np.array_equal(got, whole[:, start:start + 2000]), start
