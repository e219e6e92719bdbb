"""format: tar and format: parquet, served for real: every sample of an epoch, in order and
shuffled, equals what was written; bad shards and rows fail naming where they are."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from epochs import epoch
from PIL import Image

from stoker.client import RemoteError
from stoker.server import ServerProcess, write_config
from stoker.server.pool.batch import replacement

from conftest import StartServer

H, W = 6, 5
MAX_BYTES = 16


def png(rgb: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue()


def npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


def write_tar(path: Path, members: list[tuple[str, bytes]], extra_dir: str | None = None) -> None:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        if extra_dir:
            info = tarfile.TarInfo(extra_dir)
            info.type = tarfile.DIRTYPE
            tf.addfile(info)
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))




def fail(server: ServerProcess, name: str) -> RemoteError:
    with pytest.raises(RemoteError) as info:
        epoch(server, name, shuffle=False, batch_size=1, drop_last=False)
    assert info.value.code == grpc.StatusCode.DATA_LOSS
    return info.value


def start_fails(tmp_path: Path, dataset: dict[str, Any]) -> str:
    config = write_config(tmp_path / "bad.yaml", {"datasets": {"bad": dataset}})
    with pytest.raises(RuntimeError) as info:
        ServerProcess(config, workers=1).start()
    assert "cannot start" in str(info.value)
    return str(info.value)


# ---------------------------------------------------------------------------------- tar

TAR_FIELDS = {
    "image": {"ext": "png", "decode": "image", "size": [H, W], "layout": "hwc"},
    "label": {"ext": "cls", "decode": "int"},
    "weight": {"ext": "w.txt", "decode": "float"},  # an extension with a dot in it
    "emb": {"ext": "npy", "decode": "npy"},
    "caption": {"ext": "txt", "decode": "utf8", "max_bytes": MAX_BYTES},
}


@pytest.fixture(scope="module")
def tar_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    """Three shards of 5, 4 and 6 samples; the second keeps its samples in a folder."""
    root = tmp_path_factory.mktemp("tar")
    rng = np.random.default_rng(0)
    expected: dict[str, list[Any]] = {k: [] for k in (*TAR_FIELDS, "caption_length")}
    n = 0
    for s, count in enumerate([5, 4, 6]):
        members = []
        for _ in range(count):
            key = f"train/{n:06d}" if s == 1 else f"{n:06d}"
            image = rng.integers(0, 256, (H, W, 3), dtype=np.uint8)
            emb = rng.standard_normal((2, 3)).astype(np.float32)
            text = "é" * (n % 11)  # 2 bytes a character: longer ones are cut at 16 bytes
            members += [(f"{key}.png", png(image)), (f"{key}.cls", f"{n * 7}\n".encode()),
                        (f"{key}.w.txt", f" {n / 4}".encode()), (f"{key}.npy", npy(emb)),
                        (f"{key}.txt", text.encode())]
            if n == 2:
                members.append((f"{key}.json", b"{}"))  # not a field: ignored
            kept = text.encode()[:MAX_BYTES]
            expected["image"].append(image)
            expected["label"].append(n * 7)
            expected["weight"].append(n / 4)
            expected["emb"].append(emb)
            expected["caption"].append(np.frombuffer(kept.ljust(MAX_BYTES, b"\0"), np.uint8))
            expected["caption_length"].append(len(kept))
            n += 1
        write_tar(root / f"shard-{s:02d}.tar", members, extra_dir="train" if s == 1 else None)
    (root / "notes.txt").write_text("not a shard")
    return root, {k: np.array(v) for k, v in expected.items()}


@pytest.fixture(scope="module")
def bad_tars(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("badtar")
    good = png(np.zeros((H, W, 3), np.uint8))
    for name in ("corrupt", "truncated", "skippy"):
        (root / name).mkdir()
    write_tar(root / "corrupt" / "a.tar", [("0.png", good), ("0.cls", b"1"),
                                           ("1.png", b"\x89PNG not really"), ("1.cls", b"2")])
    write_tar(root / "truncated" / "a.tar", [("0.png", good), ("0.cls", b"1"),
                                             ("1.cls", b"2"), ("1.png", good)])
    data = (root / "truncated" / "a.tar").read_bytes()
    (root / "truncated" / "a.tar").write_bytes(data[: data.index(good, 1024) + len(good) // 2])
    # Sample 1 has no .cls: under on_error: skip it is replaced like any bad sample.
    write_tar(root / "skippy" / "a.tar",
              [(f"{i}.{ext}", good if ext == "png" else b"5") for i in range(6)
               for ext in ("png", "cls") if (i, ext) != (1, "cls")])
    return root


@pytest.fixture(scope="module")
def tar_server(start_server_module: StartServer, tar_data, bad_tars: Path) -> ServerProcess:
    root, _ = tar_data
    image_only = {"image": {"ext": "png", "decode": "image", "size": 4},
                  "label": {"ext": "cls", "decode": "int"}}
    return start_server_module({
        "shards": {"format": "tar", "source": str(root), "fields": TAR_FIELDS},
        "corrupt": {"format": "tar", "source": str(bad_tars / "corrupt"), "fields": image_only},
        "truncated": {"format": "tar", "source": str(bad_tars / "truncated"),
                      "fields": image_only},
        "skippy": {"format": "tar", "source": str(bad_tars / "skippy" / "*.tar"),
                   "fields": image_only, "on_error": "skip"},
    }, workers=2)


def whole_epoch_order(got: dict[str, np.ndarray], n: int, shuffle: bool) -> np.ndarray:
    """The epoch's sample order, checked: every sample once, in index order unshuffled."""
    order = got["sample_index"]
    assert sorted(order.tolist()) == list(range(n))
    if not shuffle:
        assert order.tolist() == list(range(n))
    return order


@pytest.mark.parametrize("shuffle", [False, True])
def test_tar_epoch_equals_what_was_written(tar_server: ServerProcess, tar_data,
                                           shuffle: bool) -> None:
    _, expected = tar_data
    got = epoch(tar_server, "shards", shuffle=shuffle, batch_size=4, drop_last=False).arrays()
    order = whole_epoch_order(got, 15, shuffle)
    assert got["image"].dtype == np.uint8 and got["image"].shape == (15, H, W, 3)
    assert got["label"].dtype == np.int64 and got["weight"].dtype == np.float64
    assert got["emb"].dtype == np.float32 and got["emb"].shape == (15, 2, 3)
    assert got["caption"].dtype == np.uint8 and got["caption_length"].dtype == np.int64
    for name, want in expected.items():
        assert np.array_equal(got[name], want[order]), name
    for caption, length, i in zip(got["caption"], got["caption_length"], order, strict=True):
        assert bytes(caption[:length]).decode() == ("é" * (i % 11))[: MAX_BYTES // 2]


def test_a_corrupt_member_is_data_loss_naming_shard_and_member(tar_server: ServerProcess,
                                                              bad_tars: Path) -> None:
    err = fail(tar_server, "corrupt")
    assert "sample 1" in err.details and "(a.tar member 1.*)" in err.details  # relative
    assert str(bad_tars) not in err.details
    assert "'1.png'" in err.details and "cannot decode image" in err.details


def test_a_truncated_member_is_data_loss_naming_shard_and_member(tar_server: ServerProcess,
                                                                bad_tars: Path) -> None:
    err = fail(tar_server, "truncated")
    assert "sample 1" in err.details and "(a.tar member 1.*)" in err.details  # relative
    assert str(bad_tars) not in err.details
    assert "'1.png'" in err.details and "truncated" in err.details


def test_a_sample_missing_a_field_is_skipped_under_on_error_skip(tar_server) -> None:
    got = epoch(tar_server, "skippy", shuffle=False, batch_size=4, drop_last=False).arrays()
    want = np.arange(6)
    want[1] = replacement(1, 1, 6)
    assert want[1] != 1
    assert np.array_equal(got["sample_index"], want)
    assert np.all(got["label"] == 5)


def test_a_damaged_tar_header_stops_the_start_naming_the_shard(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    shard = tmp_path / "data" / "a.tar"
    write_tar(shard, [("0.cls", b"1"), ("1.cls", b"2"), ("2.cls", b"3")])
    data = bytearray(shard.read_bytes())
    second = data.index(b"1.cls")  # the second member's header starts with its name
    data[second + 100 : second + 108] = b"garbage!"  # its mode: the checksum fails
    shard.write_bytes(bytes(data))
    message = start_fails(tmp_path, {"format": "tar", "source": str(tmp_path / "data"),
                                     "fields": {"label": {"ext": "cls", "decode": "int"}}})
    assert str(shard) in message and "damaged tar header" in message


# ------------------------------------------------------------------------------ parquet

@pytest.fixture(scope="module")
def parquet_data(tmp_path_factory: pytest.TempPathFactory
                 ) -> tuple[Path, dict[str, np.ndarray]]:
    """a.parquet: 25 rows in groups of 10, 10, 5; b.parquet: 7 rows; c.parquet: no rows."""
    root = tmp_path_factory.mktemp("parquet")
    rng = np.random.default_rng(1)
    parts = []
    for name, rows, group in (("a", 25, 10), ("b", 7, 100), ("c", 0, 10)):
        start = sum(len(p["id"]) for p in parts)
        ids = np.arange(start, start + rows, dtype=np.int64)
        part = {"id": ids, "x": rng.standard_normal(rows),
                "vec": rng.standard_normal((rows, 3)).astype(np.float32),
                "seq": rng.integers(0, 1000, (rows, 4)).astype(np.int32),
                "flag": ids % 3 == 0}
        table = pa.table({
            "id": part["id"], "x": part["x"], "flag": part["flag"],
            "vec": pa.FixedSizeListArray.from_arrays(pa.array(part["vec"].ravel()), 3),
            "seq": pa.array(list(part["seq"]), type=pa.list_(pa.int32())),
            "unused": pa.array([f"row {i}" for i in ids], type=pa.string()),
        })
        pq.write_table(table, root / f"{name}.parquet", row_group_size=group)
        parts.append(part)
    nulls = pa.table({"v": pa.array([1.0, 2.0, None, 4.0]),
                      "big": pa.array([1, 2, 3, 300], type=pa.int64())})
    (root / "nulls").mkdir()
    # No statistics: a null they would show stops the start (tests/test_hub_parquet.py); one
    # they do not show fails its sample when read.
    pq.write_table(nulls, root / "nulls" / "n.parquet", row_group_size=2,
                   write_statistics=False)
    expected = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    return root, expected


PARQUET_FIELDS = {
    "id": {}, "x": {"dtype": "float32"}, "vec": {}, "flag": {},
    "tokens": {"column": "seq", "dtype": "int64"},
}


@pytest.fixture(scope="module")
def parquet_server(start_server_module: StartServer, parquet_data) -> ServerProcess:
    root, _ = parquet_data
    return start_server_module({
        "table": {"format": "parquet", "source": str(root / "*.parquet"),
                  "fields": PARQUET_FIELDS, "shuffle_window": 2},
        "nulls": {"format": "parquet", "source": str(root / "nulls"),
                  "fields": {"v": {}}},
        "narrow": {"format": "parquet", "source": str(root / "nulls"),
                   "fields": {"big": {"dtype": "uint8"}}},
    }, workers=2)


@pytest.mark.parametrize("shuffle", [False, True])
def test_parquet_epoch_equals_what_was_written(parquet_server: ServerProcess, parquet_data,
                                               shuffle: bool) -> None:
    _, expected = parquet_data
    got = epoch(parquet_server, "table", shuffle=shuffle, batch_size=3, drop_last=False).arrays()
    order = whole_epoch_order(got, 32, shuffle)
    assert got["id"].dtype == np.int64 and np.array_equal(got["id"], order)
    assert got["x"].dtype == np.float32
    assert np.array_equal(got["x"], expected["x"][order].astype(np.float32))
    assert got["vec"].dtype == np.float32 and np.array_equal(got["vec"], expected["vec"][order])
    assert got["tokens"].dtype == np.int64
    assert np.array_equal(got["tokens"], expected["seq"][order])
    assert got["flag"].dtype == np.bool_ and np.array_equal(got["flag"], expected["flag"][order])


def test_parquet_block_shuffle_mixes_two_whole_row_groups_at_a_time(parquet_server) -> None:
    # Row groups [0, 10) [10, 20) [20, 25) [25, 32) (c.parquet has none); shuffle_window: 2.
    order = epoch(parquet_server, "table", shuffle=True, batch_size=3,
                  drop_last=False).arrays()["sample_index"]
    groups = [set(range(a, b)) for a, b in [(0, 10), (10, 20), (20, 25), (25, 32)]]
    windows = [a | b for i, a in enumerate(groups) for b in groups[i + 1:]]
    assert any(set(order[: len(w)].tolist()) == w for w in windows), order
    assert order.tolist() != sorted(order.tolist())


def test_a_null_is_data_loss_naming_file_row_group_and_row(parquet_server,
                                                           parquet_data) -> None:
    root, _ = parquet_data
    err = fail(parquet_server, "nulls")
    assert "sample 2" in err.details
    assert "n.parquet row group 1 row 0" in err.details  # relative to the dataset's root
    assert str(root) not in err.details
    assert "null" in err.details


def test_a_value_that_does_not_fit_the_dtype_is_data_loss(parquet_server) -> None:
    err = fail(parquet_server, "narrow")
    assert "sample 3" in err.details and "row group 1 row 1" in err.details
    assert "does not fit uint8" in err.details


def test_a_missing_column_stops_the_start_naming_file_and_columns(parquet_data,
                                                                  tmp_path: Path) -> None:
    root, _ = parquet_data
    message = start_fails(tmp_path, {"format": "parquet", "source": str(root / "*.parquet"),
                                     "fields": {"id": {}, "label": {}}})
    assert str(root / "a.parquet") in message and "no column 'label'" in message
    assert "'id'" in message and "'vec'" in message  # the columns it does have
