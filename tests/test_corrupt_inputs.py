"""Corrupt inputs end to end, under both error policies, through one real server.

Each kind of bad input sits in a small dataset of N good samples with one bad one:
- `on_error: raise`: the batch holding it fails in band with DATA_LOSS naming the sample and
  its source, and the stream goes on: every other batch arrives;
- `on_error: skip`: it is replaced by the same stand-in on every run, and the epoch is whole.
A token file of the wrong size is refused when the server starts, under either policy.
(Unit tests of each format's messages: test_formats_*.py, test_image_folder.py.)
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from epochs import epoch
from PIL import Image

from stoker.client import RemoteLoader
from stoker.server import ServerProcess, write_config
from stoker.server.pool.batch import replacement
from stoker.v1 import stoker_pb2 as pb

from conftest import StartServer, server_env

pytestmark = pytest.mark.timeout(90)

N, BS = 8, 2


def jpeg(i: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), 20 * i, np.uint8)).save(out, format="JPEG")
    return out.getvalue()


def _images(root: Path, bad: bytes) -> None:
    (root / "a").mkdir(parents=True)
    for i in range(N):
        (root / "a" / f"{i}.jpg").write_bytes(bad if i == 5 else jpeg(i))


def truncated_jpeg(root: Path) -> None:
    _images(root, jpeg(5)[: len(jpeg(5)) // 2])


def garbage_bytes(root: Path) -> None:
    _images(root, np.random.default_rng(5).bytes(700))


def _jsonl(root: Path, bad: bytes) -> None:
    root.mkdir(parents=True)
    lines = [b'{"x": %d, "t": "s%d"}' % (i, i) for i in range(N)]
    lines[5] = bad
    (root / "a.jsonl").write_bytes(b"\n".join(lines) + b"\n")


def bad_json_line(root: Path) -> None:
    _jsonl(root, b'{"x": 5, "t": "s5"')


def bad_utf8(root: Path) -> None:
    _jsonl(root, b'{"x": 5, "t": "s\xff\xfe"}')


def truncated_tar_member(root: Path) -> None:
    root.mkdir(parents=True)
    path = root / "a.tar"
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for i in range(N):
            for name, data in ((f"{i}.jpg", jpeg(i)), (f"{i}.cls", b"%d" % i)):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    raw = path.read_bytes()
    # The last sample's image is cut short: the shard ends in the middle of that member.
    path.write_bytes(raw[: raw.rindex(jpeg(N - 1)) + len(jpeg(N - 1)) // 2])


IMAGES = {"format": "image-folder", "size": 4}
JSONL = {"format": "jsonl", "fields": {"x": {"dtype": "int64"},
                                       "t": {"dtype": "utf8", "max_bytes": 8}}}
TAR = {"format": "tar", "fields": {"image": {"ext": "jpg", "decode": "image", "size": 4},
                                   "label": {"ext": "cls", "decode": "int"}}}
# name: (make the data, the dataset block, the bad sample, what the error names)
CASES: dict[str, tuple[Any, dict[str, Any], int, str]] = {
    "truncated JPEG": (truncated_jpeg, IMAGES, 5, "a/5.jpg"),
    "garbage bytes for an image": (garbage_bytes, IMAGES, 5, "a/5.jpg"),
    "bad JSON line": (bad_json_line, JSONL, 5, "a.jsonl line 6"),
    "bad UTF-8 in a text field": (bad_utf8, JSONL, 5, "a.jsonl line 6"),
    "truncated tar member": (truncated_tar_member, TAR, N - 1, "a.tar"),
}


def slug(case: str) -> str:
    return case.replace(" ", "_").replace("-", "_")


@pytest.fixture(scope="module")
def corrupt_server(start_server_module: StartServer,
                   tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    root = tmp_path_factory.mktemp("corrupt")
    datasets = {}
    for case, (make, block, _, _) in CASES.items():
        make(root / slug(case))
        for policy in ("raise", "skip"):
            datasets[f"{slug(case)}-{policy}"] = {**block, "source": str(root / slug(case)),
                                                  "on_error": policy}
    return start_server_module(datasets, workers=1)


def coords(dataset: str) -> pb.Coordinates:
    return pb.Coordinates(dataset=dataset, seed=0, epoch=0, shuffle=False, rank=0,
                          world_size=1, batch_size=BS, drop_last=True)


@pytest.mark.parametrize("case", list(CASES))
def test_raise_fails_the_batch_in_band_naming_the_sample_and_the_stream_goes_on(
        corrupt_server: ServerProcess, ledger, case: str) -> None:
    _, _, bad, where = CASES[case]
    name = f"{slug(case)}-raise"
    batches = N // BS
    with grpc.insecure_channel(corrupt_server.address) as channel:
        call = channel.stream_stream("/stoker.v1.DataService/StreamBatches",
                                     request_serializer=pb.StreamRequest.SerializeToString)
        frames = [pb.BatchFrame.FromString(f) for f in call(iter([pb.StreamRequest(
            coordinates=coords(name), batch_indices=list(range(batches)))]), timeout=60)]
    failed = {f.batch_index: f.error for f in frames if f.HasField("error")}
    answered = {f.batch_index for f in frames}
    assert answered == set(range(batches))  # every credit answered: the stream went on
    assert list(failed) == [bad // BS]
    err = failed[bad // BS]
    assert err.code == grpc.StatusCode.DATA_LOSS.value[0]
    assert f"sample {bad}" in err.message and where in err.message, err.message
    # Through the loader: the batches before it intact, then the error.
    got: list[int] = []
    with pytest.raises(Exception) as info:
        with RemoteLoader(corrupt_server.address, name, batch_size=BS, shuffle=False,
                          output="numpy", timeout=60) as loader:
            for batch in loader:
                got += batch["sample_index"].tolist()
    assert info.value.code == grpc.StatusCode.DATA_LOSS  # type: ignore[attr-defined]
    lost, dup = ledger.compare(got, list(range(bad - bad % BS)))
    ledger.record("corrupt input", f"{case}, on_error: raise", lost=lost, duplicated=dup,
                  detail=f"DATA_LOSS in band naming sample {bad} and {where}; the other "
                         f"{batches - 1} batches of the stream arrived")
    assert lost == dup == 0


def stand_in(i: int, bad: int) -> int:
    """What on_error: skip delivers for sample i (see _batch.fetch_or_replace)."""
    attempt = 0
    while i == bad:
        attempt += 1
        i = replacement(i, attempt, N)
    return i


@pytest.mark.parametrize("case", list(CASES))
def test_skip_replaces_the_bad_sample_the_same_way_every_time(
        corrupt_server: ServerProcess, ledger, case: str) -> None:
    _, _, bad, _ = CASES[case]
    read = {"batch_size": BS, "shuffle": False}
    first, second = (epoch(corrupt_server, f"{slug(case)}-skip", **read),
                     epoch(corrupt_server, f"{slug(case)}-skip", **read))
    got = np.concatenate([b["sample_index"] for b in first]).tolist()
    expected = [stand_in(i, bad) for i in range(N)]
    lost, dup = ledger.compare(got, expected)
    ledger.record("corrupt input", f"{case}, on_error: skip", lost=lost, duplicated=dup,
                  detail=f"sample {bad} replaced by sample {expected[bad]}, the same in two "
                         "epochs")
    assert lost == dup == 0 and got == expected
    for a, b in zip(first, second, strict=True):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_a_token_file_of_the_wrong_size_stops_the_server_naming_it(tmp_path: Path, ledger,
                                                                   policy: str) -> None:
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "good.bin").write_bytes(np.arange(64, dtype=np.uint16).tobytes())
    (tmp_path / "tok" / "bad.bin").write_bytes(np.arange(64, dtype=np.uint16).tobytes()[:-1])
    config = write_config(tmp_path / "config.yaml", {"datasets": {"t": {
        "format": "tokens", "source": str(tmp_path / "tok"), "seq_len": 4,
        "on_error": policy}}})
    server = ServerProcess(config, workers=1, env=server_env())
    with pytest.raises(Exception) as info:
        server.start()
    server.stop()
    message = f"{info.value}\n{server.stderr}"
    assert "bad.bin" in message and "127 bytes" in message, message
    ledger.record("corrupt input", f"token file of the wrong size, on_error: {policy}",
                  detail="the server refuses to start, naming the file and its size")
