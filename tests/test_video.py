"""`format: video` through real servers: every served frame at the native size equals, byte for
byte, the frame with the same timestamp decoded from the file's start without seeking (H.264
with B-frames, HEVC, VP9, AV1, a variable-frame-rate file; clips by stride and by fps, with and
without skipping non-reference frames); the same batches from 1 worker and 3, from one server
and another; mid-epoch resume and elastic resume (4 -> 3 ranks) exact; bad files fail their
sample naming the file while another client's epoch completes."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

av = pytest.importorskip("av")

import video_files  # noqa: E402

from stoker.client import RemoteError, RemoteLoader  # noqa: E402
from stoker.server import ServerProcess  # noqa: E402

from conftest import StartServer  # noqa: E402

pytestmark = pytest.mark.timeout(180)

CODECS = [c for c, (enc, _, _) in video_files.CODECS.items() if video_files.available(enc)]
FRAMES = 48  # per test video: 2 s at 24 fps, keyframes every 24


@pytest.fixture(scope="module")
def videos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two class folders: every codec the wheel encodes, and a variable-frame-rate H.264."""
    root = tmp_path_factory.mktemp("videos")
    for i, codec in enumerate(CODECS):
        (root / f"c{i % 2}").mkdir(exist_ok=True)
        video_files.write_video(root / f"c{i % 2}" / codec, codec, frames=FRAMES, seed=i)
    video_files.write_video(root / "c1" / "vfr", "h264", frames=40, vfr=True, seed=9)
    return root


def reference(path: Path) -> dict[float, np.ndarray]:
    """time (s) -> frame: decoded from the start, no seek, FFmpeg's rgb24 conversion."""
    with av.open(str(path)) as f:
        stream = f.streams.video[0]
        return {float(fr.pts * stream.time_base): fr.to_ndarray(format="rgb24")
                for fr in f.decode(stream)}


STRIDE = {"clip": {"frames": 6, "stride": 2}}
FPS = {"clip": {"frames": 5, "fps": 10}}


@pytest.fixture(scope="module")
def server(videos: Path, start_server_module: StartServer) -> ServerProcess:
    source = {"format": "video", "source": str(videos)}
    crop = {"transforms": [{"random_resized_crop": {"size": 24}}, {"horizontal_flip": {}}]}
    return start_server_module({
        "stride": {**source, **STRIDE},
        "fps": {**source, **FPS},
        "all": {**source, **STRIDE, "clips": "all"},
        "noskip": {**source, **STRIDE, "skip_nonref": False},
        "crop": {**source, **STRIDE, **crop, "layout": "cthw"},
        "u12": {**source, **STRIDE, "clips": {"uniform": 12}},
        "sized": {**source, **FPS, "size": [20, 30], "layout": "thwc"},
    }, workers=3)


def epochs(address: str | list[str], dataset: str, n: int, **kw: Any
           ) -> list[dict[str, np.ndarray]]:
    out = []
    with RemoteLoader(address, dataset, batch_size=kw.pop("batch_size", 5), seed=3,
                      output="numpy", timeout=120, **kw) as loader:
        for epoch in range(n):
            loader.set_epoch(epoch)
            out += [{k: v.copy() for k, v in b.items()} for b in loader]
    return out


def files_by_time(videos: Path) -> list[dict[float, np.ndarray]]:
    return [reference(p) for p in sorted(videos.glob("*/*"))]


def check_exact(batches: list[dict[str, np.ndarray]], refs: list[dict[float, np.ndarray]]
                ) -> int:
    """Each clip's frames against the file its first frame matches; the clips checked."""
    clips = 0
    for batch in batches:
        for video, times, size in zip(batch["video"], batch["timestamps"],
                                      batch["video_size"], strict=True):
            h, w = size
            frames = video.transpose(0, 2, 3, 1)[:, :h, :w]
            matches = [r for r in refs if all(t in r for t in times)
                       and all(np.array_equal(f, r[t]) for f, t in zip(frames, times,
                                                                       strict=True))]
            assert matches, f"clip at {times.tolist()} equals no file's frames"
            clips += 1
    return clips


@pytest.mark.parametrize("dataset", ["stride", "fps", "noskip"])
def test_every_frame_equals_the_frame_decoded_from_the_start(
        server: ServerProcess, videos: Path, dataset: str) -> None:
    n = len(CODECS) + 1
    batches = epochs(server.address, dataset, 200 // n + 1, batch_size=n)
    assert check_exact(batches, files_by_time(videos)) >= 200
    assert {len(b["timestamps"][0]) for b in batches} == {6 if dataset != "fps" else 5}


def test_clips_all_covers_each_video_with_non_overlapping_clips(server: ServerProcess,
                                                                videos: Path) -> None:
    batches = epochs(server.address, "all", 1, batch_size=1, shuffle=False, drop_last=False)
    n = len(CODECS) * (FRAMES // 11) + 40 // 11  # clips of 11 frames' span per video
    assert len(batches) == n
    assert check_exact(batches, files_by_time(videos)) == n
    firsts = [b["timestamps"][0][0] for b in batches]
    assert firsts[:FRAMES // 11] == pytest.approx([k * 11 / 24 for k in range(FRAMES // 11)])


def test_size_is_ffmpegs_scaler_on_the_same_frames(server: ServerProcess, videos: Path) -> None:
    refs = []
    for path in sorted(videos.glob("*/*")):
        with av.open(str(path)) as f:
            stream = f.streams.video[0]
            refs.append({float(fr.pts * stream.time_base): fr.to_ndarray(
                width=30, height=20, format="rgb24", interpolation="AREA")
                for fr in f.decode(stream)})
    clips = 0
    for batch in epochs(server.address, "sized", 2):
        assert "video_size" not in batch and batch["video"].shape[1:] == (5, 20, 30, 3)
        for video, times in zip(batch["video"], batch["timestamps"], strict=True):
            assert any(all(t in r and np.array_equal(f, r[t]) for f, t in zip(video, times,
                                                                             strict=True))
                       for r in refs), times
            clips += 1
    assert clips == 2 * len(refs)


def test_fps_clips_step_by_the_asked_rate(server: ServerProcess) -> None:
    for batch in epochs(server.address, "fps", 2):
        for times in batch["timestamps"]:
            # the frame shown at start + k/10: never after it, and less than a frame before
            grid = times[0] + np.arange(5) / 10
            assert np.all(times <= grid + 1e-9) and np.all(grid - times < 1 / 12 + 1e-9)


def digest(batches: list[dict[str, np.ndarray]]) -> list[str]:
    return [hashlib.sha256(b"".join(np.ascontiguousarray(b[k]).tobytes() for k in sorted(b))
                           ).hexdigest() for b in batches]


def test_the_same_batches_from_one_worker_and_three_and_from_one_server_or_two(
        server: ServerProcess, videos: Path, start_server: StartServer) -> None:
    crop = {"transforms": [{"random_resized_crop": {"size": 24}}, {"horizontal_flip": {}}]}
    one = start_server({"crop": {"format": "video", "source": str(videos), **STRIDE, **crop,
                                 "layout": "cthw"}}, workers=1)
    a = epochs(server.address, "crop", 3, batch_size=2)
    b = epochs(one.address, "crop", 3, batch_size=2)
    both = epochs([server.address, one.address], "crop", 3, batch_size=2)  # from two at once
    assert digest(a) == digest(b) == digest(both)
    assert a[0]["video"].shape[1:] == (3, 6, 24, 24)  # cthw
    # a random clip per epoch: the epochs differ
    assert digest(epochs(server.address, "crop", 1, batch_size=2)) == digest(a[:2])
    assert {b["timestamps"].tobytes() for b in a[:2]} != {b["timestamps"].tobytes()
                                                          for b in a[2:4]}


def sample_digests(batches: list[dict[str, np.ndarray]]) -> list[str]:
    return [hashlib.sha256(v.tobytes() + t.tobytes()).hexdigest()
            for b in batches for v, t in zip(b["video"], b["timestamps"], strict=True)]


def test_mid_epoch_resume_and_elastic_resume_are_exact(server: ServerProcess, videos: Path,
                                                       start_server: StartServer,
                                                       ledger) -> None:
    source = {"format": "video", "source": str(videos), **STRIDE}
    other = start_server({"all": {**source, "clips": "all"},
                          "u12": {**source, "clips": {"uniform": 12}}}, workers=2)

    def loader(address: str, rank: int, world: int, name: str = "all") -> RemoteLoader:
        return RemoteLoader(address, name, batch_size=1, seed=5, rank=rank, world_size=world,
                            output="numpy", timeout=120)

    # Mid-epoch resume at the same size: the rest equals an unstopped run's rest.
    with loader(server.address, 0, 1) as ld:
        whole = [{k: v.copy() for k, v in b.items()} for b in ld]
    with loader(server.address, 0, 1) as ld:
        head = []
        for b in ld:
            head.append({k: v.copy() for k, v in b.items()})
            if len(head) == 5:
                break
        state = ld.state_dict()
    with loader(other.address, 0, 1) as ld:
        ld.load_state_dict(state)
        rest = [{k: v.copy() for k, v in b.items()} for b in ld]
    assert digest(head + rest) == digest(whole)
    # Elastic: 4 ranks take 3 batches each, 3 ranks on another server take the rest (12
    # clips per video: 60, and 48 left, multiples of both sizes: no rank remainder is cut).
    with loader(server.address, 0, 1, "u12") as ld:
        reference = sample_digests(list(ld))
    assert len(reference) == 12 * (len(CODECS) + 1)
    used, states = [], []
    for rank in range(4):
        with loader(server.address, rank, 4, "u12") as ld:
            for n, b in enumerate(ld, 1):
                used += sample_digests([b])
                if n == 3:
                    break
            states.append(ld.state_dict())
    for rank in range(3):
        with loader(other.address, rank, 3, "u12") as ld:
            ld.load_state_dict(states[-1])
            used += sample_digests(list(ld))
    lost, duplicated = ledger.compare(used, reference)
    ledger.record("clients", "video clips ({uniform: 12}): resume a state saved at 4 ranks at 3, "
                  "on another server", lost=lost, duplicated=duplicated,
                  detail=f"{len(used)} clips of the epoch's {len(reference)}")
    assert (lost, duplicated) == (0, 0)


# -- bad input: each in a folder of two good videos, sorted last (sample 2) -------------------
def _good(path: Path) -> bytes:
    return video_files.write_video(path.with_name("tmp"), "h264", frames=24).read_bytes()


def truncated(path: Path) -> None:
    data = _good(path)
    path.write_bytes(data[: len(data) // 2])


def zero_bytes(path: Path) -> None:
    path.write_bytes(b"")


def text_file(path: Path) -> None:
    path.write_bytes(b"not a video, a text file named .mp4\n" * 20)


def no_video_stream(path: Path) -> None:
    video_files.write_audio(path.with_name("sound"), ".m4a").rename(path)


def unsupported_codec(path: Path) -> None:
    path.write_bytes(_good(path).replace(b"avc1", b"zzzz"))  # a codec tag FFmpeg does not know


def too_short(path: Path) -> None:
    video_files.write_video(path.with_name("short"), "h264", frames=8).rename(path)


# case: (make the bad file, what the error says besides its name)
BAD = {
    "truncated file": (truncated, "FFmpeg cannot open it: Invalid data"),
    "zero bytes": (zero_bytes, "FFmpeg cannot open it"),
    "a text file named .mp4": (text_file, "FFmpeg cannot open it: Invalid data"),
    "no video stream": (no_video_stream, "no video stream"),
    "unsupported codec": (unsupported_codec, "no decoder for its codec"),
    "short: error on a short video": (too_short, "shorter than its clip of 6 frames"),
}


def slug(case: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in case)


@pytest.fixture(scope="module")
def bad_server(tmp_path_factory: pytest.TempPathFactory,
               start_server_module: StartServer) -> ServerProcess:
    root = tmp_path_factory.mktemp("bad")
    datasets: dict[str, Any] = {}
    for case, (make, _) in BAD.items():
        folder = root / slug(case) / "a"
        folder.mkdir(parents=True)
        for i in range(2):
            video_files.write_video(folder / f"good{i}", "h264", frames=24, seed=i)
        make(folder / "zbad.mp4")
        for f in folder.glob("tmp*"):
            f.unlink()
        for policy in ("raise", "skip"):
            datasets[f"{slug(case)}-{policy}"] = {
                "format": "video", "source": str(root / slug(case)), "on_error": policy,
                "clip": {"frames": 6, "stride": 2}, "short": "error"}
    datasets["good"] = {"format": "video", "source": str(root / slug("zero bytes")),
                        "manifest": "good.csv", "clip": {"frames": 4, "stride": 2}}
    (root / slug("zero bytes") / "good.csv").write_text("path,label\na/good0.mp4,0\n"
                                                        "a/good1.mp4,1\n")
    return start_server_module(datasets, workers=2)


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_file_fails_its_sample_naming_it_and_the_server_keeps_serving(
        bad_server: ServerProcess, ledger, case: str) -> None:
    said = BAD[case][1]
    got = []
    with pytest.raises(RemoteError) as info:
        with RemoteLoader(bad_server.address, f"{slug(case)}-raise", batch_size=1,
                          shuffle=False, output="numpy", timeout=60) as loader:
            for batch in loader:
                got.append(batch["label"].tolist())
    message = str(info.value)
    assert "a/zbad.mp4" in message and said in message, message
    assert "sample 2" in message and len(got) == 2
    # Another client's epoch completes, and the skip policy fills the epoch in.
    good = epochs(bad_server.address, "good", 2, batch_size=1)
    assert len(good) == 4
    skipped = epochs(bad_server.address, f"{slug(case)}-skip", 1, batch_size=1,
                     shuffle=False)
    assert len(skipped) == 3
    ledger.record("corrupt input", f"video: {case}", detail=f"DATA_LOSS naming the file and "
                  f"'{said}'; another client's 2 epochs and the skip policy's epoch complete")


def test_inspect_grid_draws_each_clip_as_a_row_of_frames(server: ServerProcess,
                                                         tmp_path: Path) -> None:
    import subprocess
    import sys

    from PIL import Image

    picture = tmp_path / "clips.png"
    out = subprocess.run([sys.executable, "-m", "stoker.server", "inspect", server.address,
                          "sized", "--batch-size", "2", "--grid", str(picture)],
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    assert "2 clips of 5 frames, one clip per row" in out.stdout
    grid = np.asarray(Image.open(picture))
    # two rows of five 20x30 frames, 2-pixel gaps, a 7-pixel caption strip under each row
    assert grid.shape == (2 * (20 + 7 + 2) - 2, 5 * 32 - 2, 3)


def test_the_prefix_cache_keeps_uniform_clips_and_changes_no_byte(
        server: ServerProcess, videos: Path, start_server: StartServer) -> None:
    import urllib.request

    crop = {"transforms": [{"resize": {"size": 40}}, {"random_resized_crop": {"size": 24}},
                           {"horizontal_flip": {}}]}
    datasets = {"u3": {"format": "video", "source": str(videos), **STRIDE,
                       "clips": {"uniform": 3}, **crop},
                "r": {"format": "video", "source": str(videos), **STRIDE, **crop}}
    cached = start_server(datasets, workers=2, cache={"decoded_bytes": "64MiB"})
    plain = start_server(datasets, workers=1)
    for name in datasets:
        assert digest(epochs(cached.address, name, 3)) == digest(epochs(plain.address, name, 3))
    with urllib.request.urlopen(cached.http_url + "/metrics", timeout=10) as r:
        metrics = r.read().decode()
    hits = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("stoker_prefix_cache_hits_total"))
    n = 3 * (len(CODECS) + 1)
    assert hits >= 2 * n  # epochs 1 and 2 of u3 from the cache; random clips never are


@pytest.mark.parametrize("table", ["parquet", "jsonl"])
def test_frames_at_given_times_from_a_table(tmp_path: Path, start_server: StartServer,
                                            table: str) -> None:
    """The robot-learning layout: rows name an episode's video and a time; the field is the
    frames shown at that time plus each offset (the last frame starting at or before it).
    From a parquet table (columns) or jsonl records (dotted keys)."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "videos").mkdir()
    paths = [video_files.write_video(tmp_path / "videos" / f"ep{e}", "h264", frames=36,
                                     seed=e, vfr=e == 1) for e in range(2)]
    rng = np.random.default_rng(0)
    rows = [(e, float(t)) for e in range(2) for t in rng.uniform(0, 1.4, 10)]
    if table == "parquet":
        pq.write_table(pa.table({
            "video": [f"videos/{paths[e].name}" for e, _ in rows],
            "timestamp": [t for _, t in rows], "episode": [e for e, _ in rows]}),
            tmp_path / "frames.parquet", row_group_size=8)
        cam = {"column": "video", "time_column": "timestamp"}
    else:
        (tmp_path / "frames.jsonl").write_text("".join(
            json.dumps({"obs": {"video": f"videos/{paths[e].name}", "t": t}, "episode": e})
            + "\n" for e, t in rows))
        cam = {"path": "obs.video", "time_column": "obs.t"}
    server = start_server({"robot": {
        "format": table, "source": str(tmp_path),
        "fields": {"cam": {**cam, "decode": "video_frames", "offsets": [-0.1, 0.0]},
                   "episode": {}}}}, workers=2)
    refs = [reference(p) for p in paths]
    with RemoteLoader(server.address, "robot", batch_size=4, shuffle=False, output="numpy",
                      timeout=60) as loader:
        batches = list(loader)
    got = [(b["episode"][i], b["cam"][i], b["cam_timestamps"][i])
           for b in batches for i in range(len(b["episode"]))]
    assert len(got) == len(rows)
    for (episode, frames, times), (e, t) in zip(got, rows, strict=True):
        assert episode == e
        ref = refs[e]
        starts = np.array(sorted(ref))
        for frame, shown, want in zip(frames, times, (t - 0.1, t), strict=True):
            expected = starts[max(np.searchsorted(starts, want, "right") - 1, 0)]
            assert shown == expected
            h, w = ref[shown].shape[:2]
            assert np.array_equal(frame.transpose(1, 2, 0)[:h, :w], ref[shown])


def test_jsonl_video_frames_names_the_line_and_checks_its_options(
        tmp_path: Path, start_server: StartServer) -> None:
    import json

    from pydantic import ValidationError

    from stoker.server.formats.jsonl_config import JsonField

    with pytest.raises(ValidationError, match="needs time_column"):
        JsonField(decode="video_frames")
    with pytest.raises(ValidationError, match="dtype: not with decode: video_frames"):
        JsonField(decode="video_frames", time_column="t", dtype="float32")
    with pytest.raises(ValidationError, match="offsets: only with decode: video_frames"):
        JsonField(offsets=[0.0])
    path = video_files.write_video(tmp_path / "ep", "h264", frames=24)
    good = {"video": f"v/{path.name}", "t": 0.2}  # the first: the server probes it at start
    tables = {"a": [good, {"video": f"v/{path.name}", "t": "x"}],
              "b": [good, {"video": "v/missing.mp4", "t": 0.1}]}
    for name, records in tables.items():
        (tmp_path / name / "v").mkdir(parents=True)
        (tmp_path / name / "v" / path.name).write_bytes(path.read_bytes())
        (tmp_path / name / "f.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cam = {"path": "video", "decode": "video_frames", "time_column": "t"}
    server = start_server({name: {"format": "jsonl", "source": str(tmp_path / name),
                                  "fields": {"cam": cam}} for name in tables})
    for name, line, said in (("a", 2, "expected seconds"), ("b", 2, "missing.mp4")):
        with pytest.raises(RemoteError) as info:
            with RemoteLoader(server.address, name, batch_size=1, shuffle=False,
                              output="numpy", timeout=60) as loader:
                list(loader)
        message = str(info.value)
        assert f"f.jsonl line {line}" in message and said in message, message


def test_audio_of_a_clip_is_its_span_of_the_track(tmp_path: Path,
                                                  start_server: StartServer) -> None:
    (tmp_path / "a").mkdir()
    path = video_files.write_video(tmp_path / "a" / "talk", "h264", frames=48, audio=True)
    server = start_server({"av": {"format": "video", "source": str(tmp_path), **STRIDE,
                                  "audio": {"sample_rate": 8000, "channels": 1}}})
    resampler = av.AudioResampler(format="fltp", layout="mono", rate=8000)
    parts = []
    with av.open(str(path)) as f:
        for frame in f.decode(f.streams.audio[0]):
            parts += [r.to_ndarray() for r in resampler.resample(frame)]
    track = np.concatenate(parts, axis=1)
    for batch in epochs(server.address, "av", 4, batch_size=1):
        times = batch["timestamps"][0]
        n = int(batch["audio_length"][0])
        a = round(times[0] * 8000)
        assert n == round((times[-1] + 1 / 24) * 8000) - a  # through the last frame's end
        assert np.array_equal(batch["audio"][0][:, :n], track[:, a:a + n])


def test_a_clip_of_each_tar_member_and_parquet_cell(tmp_path: Path,
                                                    start_server: StartServer) -> None:
    import io
    import tarfile

    import pyarrow as pa
    import pyarrow.parquet as pq

    data = [video_files.write_video(tmp_path / f"v{i}", codec, frames=30, seed=i).read_bytes()
            for i, codec in enumerate(CODECS[:2] * 2)]
    (tmp_path / "shards").mkdir()
    with tarfile.open(tmp_path / "shards" / "s0.tar", "w") as tf:
        for i, blob in enumerate(data):
            for name, payload in ((f"k{i}.mp4", blob), (f"k{i}.cls", b"%d" % i)):
                info = tarfile.TarInfo(name)
                info.size = len(payload)
                tf.addfile(info, io.BytesIO(payload))
    (tmp_path / "table").mkdir()
    pq.write_table(pa.table({"clip": data, "label": list(range(len(data)))}),
                   tmp_path / "table" / "t.parquet", row_group_size=2)
    server = start_server({
        "clips": {"format": "tar", "source": str(tmp_path / "shards"),
                  "fields": {"clip": {"ext": "mp4", "decode": "video", **STRIDE},
                             "label": {"ext": "cls", "decode": "int"}}},
        "rows": {"format": "parquet", "source": str(tmp_path / "table"),
                 "fields": {"clip": {"decode": "video", **STRIDE}, "label": {}}}})
    refs = []
    for blob in data:
        with av.open(io.BytesIO(blob)) as f:
            s = f.streams.video[0]
            refs.append({float(fr.pts * s.time_base): fr.to_ndarray(format="rgb24")
                         for fr in f.decode(s)})
    seen = 0
    tar = epochs(server.address, "clips", 3, batch_size=2, shuffle=False)
    rows = epochs(server.address, "rows", 3, batch_size=2, shuffle=False)
    for batch in tar + rows:
        for clip, times, label in zip(batch["clip"], batch["clip_timestamps"],
                                      batch["label"], strict=True):
            for frame, t in zip(clip, times, strict=True):
                assert np.array_equal(frame.transpose(1, 2, 0), refs[label][t])
            seen += 1
    assert seen == 2 * 3 * len(data)
