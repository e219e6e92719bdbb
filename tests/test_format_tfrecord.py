"""format: tfrecord and format: array_record.

Interop: files written by TensorFlow's own TFRecordWriter (plain, GZIP, ZLIB) and by
array_record's ArrayRecordWriter read back equal to what `tf.io.parse_single_example` returns
(images: equal to stoker's image pipeline on the same bytes). TensorFlow runs in its own venv
(.venv-tf, `make install-tf`), running tests/tfrecord_files.py; without it those tests skip,
saying so. The rest write their files with that module's writer without TensorFlow: errors
that name the file and the record, the offsets index kept in the cache folder, block shuffle
by file, and mid-epoch resume, elastic resume and exactly-once under a killed server for both
formats (ledger rows).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from stoker.client import RemoteLoader
from stoker.server import ServerProcess, write_config
from stoker.server._config import Config
from stoker.server.formats import open_dataset
from stoker.server.images import image_pipeline
from stoker.server.order.sampling import EpochKey

import s3_endpoint as s3
from conftest import StartServer, server_env
from s3_endpoint import moto_endpoint_fixture  # noqa: F401  (the moto_endpoint fixture)
from tfrecord_files import example, frame, write_array_record, write_tfrecord

pytest.importorskip("array_record")

ROOT = Path(__file__).resolve().parents[1]
TF_PYTHON = Path(os.environ.get("STOKER_TF_PYTHON", ROOT / ".venv-tf" / "bin" / "python"))

FEATURES = {"idx": {"kind": "int64"}, "label": {"kind": "int64"},
            "box": {"kind": "float", "shape": [4]}, "ids": {"kind": "int64", "shape": [2, 3]},
            "image": {"kind": "bytes", "key": "image/encoded", "decode": "image",
                      "transforms": [{"random_resized_crop": {"size": 16}},
                                     {"horizontal_flip": None}]},
            "caption": {"kind": "bytes", "decode": "utf8", "max_bytes": 96}}


def dataset(block: dict[str, Any], cache_dir: Path | None = None) -> Any:
    config = Config.model_validate({"cache": {"dir": str(cache_dir)} if cache_dir else {},
                                    "datasets": {"d": block}})
    return open_dataset("d", config)


# -- interop: TensorFlow's writer and parser ------------------------------------------------
@pytest.fixture(scope="module")
def tf_written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    if not TF_PYTHON.exists():
        pytest.skip(f"no TensorFlow venv at {TF_PYTHON} (make install-tf)")
    out = tmp_path_factory.mktemp("tf")
    subprocess.run([str(TF_PYTHON), str(ROOT / "tests" / "tfrecord_files.py"), str(out)],
                   check=True, timeout=300, capture_output=True,
                   env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""})
    return out, json.loads((out / "parsed.json").read_text())


def check_against_tf(sample: dict[str, Any], theirs: dict[str, Any], index: int,
                     key: EpochKey) -> None:
    assert sample["idx"] == theirs["idx"] == index
    assert sample["label"].dtype == np.int64 and sample["label"] == theirs["label"]
    assert sample["box"].dtype == np.float32
    assert np.array_equal(sample["box"], np.array(theirs["box"], np.float32))
    assert np.array_equal(sample["ids"], np.array(theirs["ids"]))
    caption = bytes.fromhex(theirs["caption"])
    n = int(sample["caption_length"])
    assert bytes(sample["caption"][:n]) == caption and n == len(caption)
    # The image: stoker's pipeline on the bytes TensorFlow parsed, the same random draws.
    pipeline = image_pipeline(Config.model_validate({"datasets": {"d": {
        "format": "tfrecord", "source": ".", "features": FEATURES}}}).datasets["d"]
        .features["image"])
    want = pipeline(bytes.fromhex(theirs["image/encoded"]), key.rng(index))
    assert np.array_equal(sample["image"], want)


@pytest.mark.parametrize("name", ["plain.tfrecord", "gzip.tfrecord.gz", "zlib.tfrecord.zz"])
def test_tensorflows_records_read_as_tf_io_parse_single_example_reads_them(
        tf_written, tmp_path: Path, name: str) -> None:
    folder, parsed = tf_written
    ds = dataset({"format": "tfrecord", "source": str(folder / name), "features": FEATURES},
                 tmp_path / "cache")
    assert len(ds) == len(parsed["examples"]) == 12
    key = EpochKey(seed=3, epoch=1, shuffle=True)
    for i, theirs in enumerate(parsed["examples"]):
        check_against_tf(ds.sample(i, key), theirs, i, key)


def test_sequence_example_context_as_tensorflow_parses_it(tf_written) -> None:
    folder, parsed = tf_written
    ds = dataset({"format": "tfrecord", "source": str(folder / "context.tfrecord"),
                  "record": "sequence_example",
                  "features": {"idx": {"kind": "int64"}, "length": {"kind": "int64"},
                               "name": {"kind": "bytes", "decode": "utf8", "max_bytes": 8}}})
    assert len(ds) == len(parsed["context"])
    for i, theirs in enumerate(parsed["context"]):
        s = ds[i]
        assert (s["idx"], s["length"]) == (theirs["idx"], theirs["length"])
        assert bytes(s["name"][: int(s["name_length"])]) == bytes.fromhex(theirs["name"])


def test_array_records_of_tensorflow_examples_read_record_for_record(tf_written) -> None:
    folder, parsed = tf_written
    ds = dataset({"format": "array_record", "source": str(folder / "examples.array_record"),
                  "features": FEATURES})
    key = EpochKey(seed=5, epoch=0, shuffle=True)
    assert len(ds) == len(parsed["examples"])
    for i in reversed(range(len(ds))):  # random access: any order
        check_against_tf(ds.sample(i, key), parsed["examples"][i], i, key)


def test_raw_array_records_read_record_for_record(tmp_path: Path) -> None:
    arrays = [np.arange(i + 1, dtype=np.float32) * i for i in range(3)] + [
        np.full((2, 2), i, np.int16) for i in range(3)]
    npy = []
    for a in arrays:
        buf = io.BytesIO()
        np.save(buf, a)
        npy.append(buf.getvalue())
    write_array_record(tmp_path / "npy" / "a.array_record", npy[:4])
    write_array_record(tmp_path / "npy" / "b.array_record", npy[4:])
    ds = dataset({"format": "array_record", "source": str(tmp_path / "npy"), "decode": "npy",
                  "field": "x"})
    assert len(ds) == 6
    for i, a in enumerate(arrays):
        assert ds[i]["x"].dtype == a.dtype and np.array_equal(ds[i]["x"], a)
    blobs = [bytes(range(i)) for i in range(9)]
    write_array_record(tmp_path / "raw.array_record", blobs)
    ds = dataset({"format": "array_record", "source": str(tmp_path / "raw.array_record"),
                  "max_bytes": 4})
    for i, b in enumerate(blobs):
        s = ds[i]
        n = int(s["record_length"])
        assert bytes(s["record"][:n]) == b[:4] and not s["record"][n:].any()


# -- the index, the files' order, shuffle by file ----------------------------------------------
def numbered(n: int, start: int = 0) -> list[bytes]:
    return [example(idx=start + i, x=[float(start + i), 0.5]) for i in range(n)]


IDX = {"idx": {"kind": "int64"}, "x": {"kind": "float", "shape": [2]}}


def test_the_offsets_index_is_kept_in_the_cache_folder_and_read_on_restart(
        tmp_path: Path) -> None:
    write_tfrecord(tmp_path / "d" / "b.tfrecord", numbered(5, 3))
    write_tfrecord(tmp_path / "d" / "a.tfrecord.gz", numbered(3), "gzip")
    (tmp_path / "d" / "notes.txt").write_text("not a record file")
    block = {"format": "tfrecord", "source": str(tmp_path / "d"), "features": IDX}
    ds = dataset(block, tmp_path / "cache")
    assert [int(ds[i]["idx"]) for i in range(len(ds))] == list(range(8))  # sorted by name
    assert ds.place_of(4) == {"file": str(tmp_path / "d" / "b.tfrecord"), "record": 1,
                              "offset": len(frame(numbered(1, 3)[0])), "nbytes":
                              len(frame(numbered(2, 3)[1]))}
    folder = tmp_path / "cache" / "tfrecord"
    indexes = sorted(folder.glob("*.index.npy"))
    assert len(indexes) == 2 and len(list(folder.glob("*.tfrecord"))) == 1  # the gunzipped
    inodes = [p.stat().st_ino for p in indexes]
    # A restart reads the index it kept (not made again: the same files)...
    again = dataset(block, tmp_path / "cache")
    assert [p.stat().st_ino for p in sorted(folder.glob("*.index.npy"))] == inodes
    assert [int(again[i]["idx"]) for i in range(8)] == list(range(8))
    # A decompressed copy the disk cache evicted is made again when read.
    for copy in folder.glob("*.tfrecord"):
        copy.unlink()
    evicted = dataset(block, tmp_path / "cache")
    assert [int(evicted[i]["idx"]) for i in range(8)] == list(range(8))
    # ...and a file that changed gets a new index.
    write_tfrecord(tmp_path / "d" / "b.tfrecord", numbered(6, 3))
    assert len(dataset(block, tmp_path / "cache")) == 9
    assert len(list(folder.glob("*.index.npy"))) == 3


def test_block_shuffle_reads_whole_files_in_sequence(start_server: StartServer,
                                                     tmp_path: Path) -> None:
    for f in range(4):
        write_tfrecord(tmp_path / f"s{f}.tfrecord", numbered(6, 6 * f))
    server = start_server({"t": {"format": "tfrecord", "source": str(tmp_path),
                                 "features": IDX, "shuffle_window": 1}},
                          cache={"dir": str(tmp_path / "cache")})
    with RemoteLoader(server.address, "t", batch_size=3, seed=1, shuffle=True,
                      output="numpy", timeout=60) as loader:
        order = [int(i) for b in loader for i in b["idx"]]
    assert sorted(order) == list(range(24)) and order != list(range(24))
    files = [i // 6 for i in order]
    runs = [f for k, f in enumerate(files) if k == 0 or files[k - 1] != f]
    assert sorted(runs) == [0, 1, 2, 3]  # each file once, read through before the next


def test_tfrecord_and_array_record_files_on_s3_are_served(moto_endpoint: s3.MotoServer,
                                                          tmp_path: Path) -> None:
    datasets = both_formats(tmp_path / "local")
    client = s3.s3_client(moto_endpoint.url)
    bucket = s3.new_bucket(client)
    s3.put_objects(client, bucket, {f"{kind}/{p.name}": p.read_bytes() for kind in ("tfr", "ar")
                                    for p in (tmp_path / "local" / kind).iterdir()})
    for name, kind in (("tfrecord", "tfr"), ("array_record", "ar")):
        datasets[name]["source"] = f"s3://{bucket}/{kind}"
    config = write_config(tmp_path / "c.yaml", {
        "s3": {"endpoint_url": moto_endpoint.url, "region": "us-east-1"},
        "cache": {"dir": str(tmp_path / "cache")}, "datasets": datasets})
    with ServerProcess(config, workers=1, env={**server_env(), **s3.s3_env()}) as server:
        for name in datasets:
            with RemoteLoader(server.address, name, batch_size=5, shuffle=False,
                              drop_last=False, output="numpy", timeout=60) as loader:
                got = [int(i) for b in loader for i in b["idx"]]
            assert got == list(range(N)), name
    assert list((tmp_path / "cache" / "tfrecord").glob("*.index.npy"))


# -- errors name the file and the record --------------------------------------------------------
def corrupt_files(root: Path) -> dict[str, tuple[dict[str, Any], int, str]]:
    """name -> (dataset block, the bad sample, what the error names)."""
    good = numbered(8)
    framed = [frame(r) for r in good]
    crc = bytearray(b"".join(framed))
    at = sum(map(len, framed[:5])) + 12 + 3  # record 5's data
    crc[at] ^= 0xFF
    (root / "crc").mkdir()
    (root / "crc" / "a.tfrecord").write_bytes(bytes(crc))
    (root / "cut").mkdir()
    (root / "cut" / "a.tfrecord").write_bytes(b"".join(framed)[:-6])  # record 7's data
    write_tfrecord(root / "kind" / "a.tfrecord",
                   [*good[:5], example(idx=b"5", x=[5.0, 0.5]), *good[6:]])
    block = {"format": "tfrecord", "features": IDX}
    return {"a data CRC that does not match": ({**block, "source": str(root / "crc")}, 5,
                                               "a.tfrecord record 5"),
            "a file cut inside its last record": ({**block, "source": str(root / "cut")}, 7,
                                                  "a.tfrecord record 7"),
            "a feature of the wrong kind": ({**block, "source": str(root / "kind")}, 5,
                                            "a.tfrecord record 5")}


@pytest.fixture(scope="module")
def corrupt(start_server_module, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("corrupt")
    cases = corrupt_files(root)
    datasets = {f"c{k}": block for k, (block, _, _) in enumerate(cases.values())}
    datasets.update({f"s{k}": {**block, "on_error": "skip"}
                     for k, (block, _, _) in enumerate(cases.values())})
    return start_server_module(datasets, cache={"dir": str(root / "cache")}), cases


@pytest.mark.parametrize("case", range(3))
def test_a_bad_record_fails_its_batch_naming_the_file_and_the_record(corrupt, ledger,
                                                                       case: int) -> None:
    server, cases = corrupt
    name, (_, bad, where) = list(cases.items())[case]
    got: list[int] = []
    with pytest.raises(Exception) as info:
        with RemoteLoader(server.address, f"c{case}", batch_size=2, shuffle=False,
                          output="numpy", timeout=60) as loader:
            for batch in loader:
                got += batch["idx"].tolist()
    assert info.value.code == grpc.StatusCode.DATA_LOSS  # type: ignore[attr-defined]
    message = str(info.value)
    assert f"sample {bad}" in message and where in message, message
    if "kind" in name:
        assert "feature 'idx' is a bytes_list, the config says kind int64" in message
    lost, dup = ledger.compare(got, list(range(bad - bad % 2)))
    ledger.record("corrupt input", f"TFRecord: {name}, on_error: raise", lost=lost,
                  duplicated=dup, detail=f"DATA_LOSS naming sample {bad} and {where}")
    assert lost == dup == 0


@pytest.mark.parametrize("case", range(3))
def test_on_error_skip_replaces_a_bad_record_the_same_way_every_time(corrupt, ledger,
                                                                     case: int) -> None:
    server, cases = corrupt
    name, (_, bad, _) = list(cases.items())[case]
    runs = []
    for _ in range(2):
        with RemoteLoader(server.address, f"s{case}", batch_size=2, shuffle=False,
                          output="numpy", timeout=60) as loader:
            runs.append([(int(i), int(x)) for b in loader
                         for i, x in zip(b["sample_index"], b["idx"], strict=True)])
    assert runs[0] == runs[1]  # the same stand-in on every run
    got = runs[0]
    assert all(i == x for i, x in got)  # a stand-in is a whole other record
    stand_in = got[bad][0]
    assert stand_in != bad and 0 <= stand_in < 8
    want = [stand_in if i == bad else i for i in range(8)]
    lost, dup = ledger.compare([i for i, _ in got], want)
    ledger.record("corrupt input", f"TFRecord: {name}, on_error: skip", lost=lost,
                  duplicated=dup, detail=f"sample {bad} replaced by record {stand_in}, "
                                         "the same on two runs; the epoch whole")
    assert lost == dup == 0


def test_what_cannot_be_indexed_is_named_at_open(tmp_path: Path, ledger) -> None:
    framed = b"".join(frame(r) for r in numbered(4))
    (tmp_path / "head").mkdir()
    (tmp_path / "head" / "a.tfrecord").write_bytes(framed + frame(b"x")[:7])
    with pytest.raises(ValueError, match=r"a.tfrecord: truncated: record 4 at byte \d+ has 7 "
                                         r"of its 12 header bytes"):
        dataset({"format": "tfrecord", "source": str(tmp_path / "head"), "features": IDX})
    bad = bytearray(framed)
    bad[len(frame(numbered(1)[0])) + 2] ^= 1  # record 1's length
    (tmp_path / "len").mkdir()
    (tmp_path / "len" / "a.tfrecord").write_bytes(bytes(bad))
    with pytest.raises(ValueError, match=r"record 1 at byte \d+: the length's CRC does "
                                         r"not match"):
        dataset({"format": "tfrecord", "source": str(tmp_path / "len"), "features": IDX})
    write_tfrecord(tmp_path / "gz" / "a.tfrecord", numbered(3), "gzip")  # no .gz
    with pytest.raises(ValueError, match="gzip data: set compression: gzip"):
        dataset({"format": "tfrecord", "source": str(tmp_path / "gz"), "features": IDX})
    assert len(dataset({"format": "tfrecord", "source": str(tmp_path / "gz"),
                        "compression": "gzip", "features": IDX})) == 3
    ledger.record("corrupt input", "TFRecord: a file cut inside a header, a length CRC that "
                  "does not match, gzip data not said to be", tried=3,
                  detail="refused at open, naming the file, the record and its byte")


def test_a_missing_feature_or_a_count_that_does_not_fit_the_shape_is_named(
        tmp_path: Path) -> None:
    write_tfrecord(tmp_path / "a.tfrecord", [example(idx=0, x=[1.0, 2.0, 3.0]),
                                             example(other=1)])
    ds = dataset({"format": "tfrecord", "source": str(tmp_path), "features": IDX})
    with pytest.raises(ValueError, match=r"field 'x': feature 'x' has 3 values; shape \[2\] "
                                         r"needs 2"):
        ds[0]
    with pytest.raises(ValueError, match=r"feature 'idx' is missing \(the record has: "
                                         r"other\)"):
        ds[1]
    assert ds.source_of(1) == f"{tmp_path / 'a.tfrecord'} record 1"


@pytest.mark.parametrize(("block", "match"), [
    ({"kind": "int64", "decode": "image", "size": 4}, "decode applies to kind bytes only"),
    ({"kind": "bytes"}, "max_bytes is required"),
    ({"kind": "bytes", "shape": [2], "decode": "npy"}, "shape must be"),
    ({"kind": "float", "max_bytes": 3}, "max_bytes applies"),
    ({"kind": "bytes", "decode": "utf8", "max_bytes": 3, "size": 4}, "size, transforms"),
    ({"kind": "str"}, "kind"),
])
def test_feature_options_that_do_not_fit_are_refused(block: dict[str, Any], match: str
                                                     ) -> None:
    with pytest.raises(ValueError, match=match):
        Config.model_validate({"datasets": {"d": {"format": "tfrecord", "source": ".",
                                                  "features": {"f": block}}}})


# -- resume, elastic resume, exactly-once, for both formats ------------------------------------
N = 48  # samples in 4 files


def both_formats(root: Path) -> dict[str, dict[str, Any]]:
    for f in range(4):
        records = numbered(N // 4, N // 4 * f)
        write_tfrecord(root / "tfr" / (f"part-{f}.tfrecord" + (".gz" if f % 2 else "")),
                       records, "gzip" if f % 2 else "none")
        write_array_record(root / "ar" / f"part-{f}.array_record", records)
    return {"tfrecord": {"format": "tfrecord", "source": str(root / "tfr"), "features": IDX},
            "array_record": {"format": "array_record", "source": str(root / "ar"),
                             "features": IDX}}


@pytest.fixture(scope="module")
def two_servers(start_server_module, tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("both")
    datasets = both_formats(root)
    cache = {"dir": str(root / "cache")}
    return (start_server_module(datasets, cache=cache).address,
            start_server_module(datasets, cache=cache).address)


def run(address: str | list[str], name: str, world_size: int = 1, batch_size: int = 4,
        steps: int | None = None, state: dict | None = None, **kw: Any
        ) -> tuple[list[int], list[dict]]:
    used, states = [], []
    for rank in range(world_size):
        with RemoteLoader(address, name, batch_size=batch_size, rank=rank,
                          world_size=world_size, seed=7, shuffle=True, drop_last=True,
                          output="numpy", timeout=60, **kw) as loader:
            if state is not None:
                loader.load_state_dict(state)
            for n, batch in enumerate(loader, 1):
                assert np.array_equal(batch["idx"], batch["sample_index"])  # record i is i
                used += batch["idx"].tolist()
                if n == steps:
                    break
            states.append(loader.state_dict())
    return used, states


@pytest.mark.parametrize("name", ["tfrecord", "array_record"])
def test_mid_epoch_resume_on_another_server(two_servers, ledger, name: str) -> None:
    a, b = two_servers
    reference, _ = run(a, name)
    first, states = run(a, name, steps=5)
    rest, _ = run(b, name, state=states[0])
    assert first + rest == reference
    lost, dup = ledger.compare(first + rest, reference)
    ledger.record("clients", f"{name}: resume mid-epoch on another server", lost=lost,
                  duplicated=dup, detail=f"stopped after 5 of {N // 4} batches")


@pytest.mark.parametrize("name", ["tfrecord", "array_record"])
def test_elastic_resume_at_another_world_size(two_servers, ledger, name: str) -> None:
    a, b = two_servers
    reference, _ = run(a, name, world_size=2, batch_size=4)
    first, states = run(a, name, world_size=2, batch_size=4, steps=2)
    rest, _ = run(b, name, world_size=4, batch_size=2, state=states[-1])
    lost, dup = ledger.compare(first + rest, reference)
    ledger.record("clients", f"{name}: resume at world_size 2 -> 4 (batch_size 4 -> 2)",
                  lost=lost, duplicated=dup, detail=f"{len(first + rest)} samples of {N}")
    assert (lost, dup) == (0, 0)


@pytest.mark.parametrize("name", ["tfrecord", "array_record"])
def test_a_server_killed_mid_epoch_loses_and_repeats_nothing(tmp_path: Path, ledger,
                                                             name: str) -> None:
    datasets = both_formats(tmp_path)
    config = write_config(tmp_path / "config.yaml", {"cache": {"dir": str(tmp_path / "c")},
                                                     "datasets": datasets})
    procs = [ServerProcess(config, workers=1, env=server_env()).start() for _ in range(2)]
    try:
        reference, _ = run(procs[1].address, name)
        got = []
        with RemoteLoader([p.address for p in procs], name, batch_size=4, seed=7,
                          shuffle=True, drop_last=True, output="numpy", timeout=60,
                          prefetch=2) as loader:
            for k, batch in enumerate(loader):
                got += batch["idx"].tolist()
                if k == 3:
                    procs[0].proc.kill()
    finally:
        for p in procs:
            p.stop()
    lost, dup = ledger.compare(got, reference)
    ledger.record("servers", f"{name}: kill -9 one of 2 mid-epoch", lost=lost, duplicated=dup,
                  detail="the sequence equals the failure-free run's")
    assert got == reference


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
