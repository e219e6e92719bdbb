"""format: jsonl, tokens and memmap, served for real and compared element for element."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from stoker.client import RemoteError, RemoteLoader
from stoker.server import Config, ServerProcess, write_config
from stoker.server.formats import open_dataset
from stoker.server.formats.memmap import read_header, write_array

from conftest import server_env

# -- data: written once per module, with what each sample must be ---------------------------


def jsonl_data(root: Path) -> dict[str, np.ndarray]:
    """Two files, blank lines, CRLF, a last line without newline, nested paths, utf8."""
    rng = np.random.default_rng(1)
    texts = ["", "a", "héllo wörld", "日本語のテキスト", "exactly8", "x" * 30]
    expected: dict[str, list[Any]] = {"vec": [], "label": [], "first": [], "text": [],
                                      "text_length": []}
    for name, n, newline in [("a.jsonl", 13, "\n"), ("b.jsonl", 8, "\r\n")]:
        lines = []
        for _ in range(n):
            vec = rng.normal(size=3).astype(np.float32)
            label = int(rng.integers(-(2**40), 2**40))
            text = texts[len(expected["label"]) % len(texts)]
            record = {"feat": {"vec": vec.tolist()}, "meta": {"label": label, "text": text},
                      "ignored": [1, "two", None]}
            lines.append(json.dumps(record, ensure_ascii=len(lines) % 2 == 0))
            data = text.encode()[:8]
            while True:  # cut at a character boundary
                try:
                    data.decode()
                    break
                except UnicodeDecodeError:
                    data = data[:-1]
            expected["vec"].append(vec)
            expected["first"].append(np.float64(vec[0]))
            expected["label"].append(label)
            expected["text"].append(np.frombuffer(data.ljust(8, b"\0"), np.uint8))
            expected["text_length"].append(len(data))
        lines.insert(5, "")  # a blank line is no record
        (root / name).write_bytes(newline.join(lines).encode())  # no newline after the last
    return {k: np.array(v) for k, v in expected.items()}


JSONL_FIELDS = {"vec": {"path": "feat.vec", "shape": [3]},
                "label": {"path": "meta.label", "dtype": "int64"},
                "first": {"path": "feat.vec.0", "dtype": "float64"},
                "text": {"path": "meta.text", "dtype": "utf8", "max_bytes": 8}}


def tokens_data(root: Path, dtype: str, header: int, lengths: list[int]) -> np.ndarray:
    """Files of random tokens; returns the expected windows of seq_len + 1 = 9 tokens."""
    rng = np.random.default_rng(len(lengths) + header)
    windows = []
    for k, n in enumerate(lengths):
        # uint32: ids of a large vocabulary (2**20); ids above 2**24 are refused as not ids
        high = min(np.iinfo(dtype).max, 1 << 20)
        tokens = rng.integers(0, high, size=n, dtype=dtype)
        little = tokens.astype(tokens.dtype.newbyteorder("<"))
        (root / f"{k:02d}.bin").write_bytes(b"H" * header + little.tobytes())
        windows += [tokens[s : s + 9] for s in range(0, n - 8, 8)]
    (root / "meta.pkl").write_bytes(b"not tokens")  # not *.bin: ignored
    return np.array(windows, dtype=np.int64)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("records")
    for sub in ("jsonl", "bad", "tok16", "tok32", "npy", "raw"):
        (root / sub).mkdir()
    out: dict[str, Any] = {"root": root}
    out["jsonl"] = jsonl_data(root / "jsonl")
    (root / "bad" / "a.jsonl").write_text('{"x": 1}\n{"x": 2}\n')
    (root / "bad" / "b.jsonl").write_text('{"x": 3}\n\n{"x": 4}\n{"x": 5,,}\n{"x": 6}\n')
    # 3 windows, a file too short for one (no samples), 2 windows, 1 window exactly (n = 9).
    out["tok16"] = tokens_data(root / "tok16", "uint16", 0, [30, 5, 17, 9])
    out["tok32"] = tokens_data(root / "tok32", "uint32", 16, [41, 12])
    rng = np.random.default_rng(3)
    image = rng.integers(0, 256, size=(12, 2, 3), dtype=np.uint8)
    label = np.arange(12, dtype=np.int64) * 7
    np.save(root / "npy" / "img_0.npy", image[:7])
    np.save(root / "npy" / "img_1.npy", np.asfortranarray(image[7:]))
    np.save(root / "npy" / "label.npy", label)
    out["npy"] = {"image": image, "label": label}
    x = rng.normal(size=(10, 4)).astype(np.float32)
    y = np.arange(10, dtype=">i2") - 5  # big-endian in: little-endian out
    for k, (a, b) in enumerate([(0, 4), (4, 4), (4, 10)]):  # the middle file has no rows
        write_array(root / "raw" / f"x_{k}.arr", x[a:b])
    write_array(root / "raw" / "y.arr", y)
    out["raw"] = {"x": x, "y": y.astype(np.int16)}
    return out


def configs(root: Path) -> dict[str, Any]:
    return {
        "records": {"format": "jsonl", "source": str(root / "jsonl" / "*.jsonl"),
                    "fields": JSONL_FIELDS},
        "bad": {"format": "jsonl", "source": str(root / "bad"), "fields": {"x": {}}},
        "tok16": {"format": "tokens", "source": str(root / "tok16"), "seq_len": 8},
        "tok32": {"format": "tokens", "source": str(root / "tok32" / "*.bin"), "seq_len": 8,
                  "dtype": "uint32", "header_bytes": 16, "output_dtype": "int32"},
        "npy": {"format": "memmap", "source": str(root / "npy"),
                "fields": {"image": "img_*.npy", "label": "label.npy"}},
        "raw": {"format": "memmap", "source": str(root / "raw"),
                "fields": {"x": "x_*.arr", "y": "y.arr"}},
    }


@pytest.fixture(scope="module")
def server(start_server_module, data: dict[str, Any]) -> ServerProcess:
    return start_server_module(configs(data["root"]), workers=2)


def read_epoch(server: ServerProcess, name: str, shuffle: bool,
               batch_size: int = 4) -> dict[str, np.ndarray]:
    with RemoteLoader(server.address, name, batch_size=batch_size, shuffle=shuffle,
                      drop_last=False, output="numpy", timeout=60) as loader:
        batches = list(loader)
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def check(got: dict[str, np.ndarray], expected: dict[str, np.ndarray], shuffle: bool) -> None:
    index = got.pop("sample_index")
    n = len(next(iter(expected.values())))
    if shuffle:
        assert not np.array_equal(index, np.arange(n)) and np.array_equal(np.sort(index),
                                                                          np.arange(n))
    else:
        assert np.array_equal(index, np.arange(n))
    assert list(got) == list(expected)
    for k, want in expected.items():
        assert got[k].dtype == want.dtype, k
        assert np.array_equal(got[k], want[index]), k


# -- served for real -----------------------------------------------------------------------


@pytest.mark.parametrize("shuffle", [False, True])
def test_jsonl_records_from_two_files(server, data, shuffle: bool) -> None:
    want = data["jsonl"]
    expected = {"vec": want["vec"].astype(np.float32), "label": want["label"],
                "first": want["first"], "text": want["text"],
                "text_length": want["text_length"].astype(np.int64)}
    got = read_epoch(server, "records", shuffle, batch_size=5)
    check(got, expected, shuffle)
    texts = [bytes(t[:n]).decode() for t, n in zip(got["text"], got["text_length"],
                                                   strict=True)]
    # Cut to 8 bytes at a character boundary: "ö" would straddle it, 3-byte kanji too.
    assert {"", "a", "héllo w", "日本", "exactly8", "x" * 8} == set(texts)


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize(("name", "dtype"), [("tok16", np.int64), ("tok32", np.int32)])
def test_token_windows(server, data, name: str, dtype: type, shuffle: bool) -> None:
    windows = data[name]
    got = read_epoch(server, name, shuffle)
    check(got, {"input_ids": windows[:, :-1].astype(dtype),
                "labels": windows[:, 1:].astype(dtype)}, shuffle)


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("name", ["npy", "raw"])
def test_memmap_rows(server, data, name: str, shuffle: bool) -> None:
    check(read_epoch(server, name, shuffle, batch_size=3), data[name], shuffle)


def test_a_bad_json_line_is_data_loss_naming_file_and_line(server, data) -> None:
    with RemoteLoader(server.address, "bad", batch_size=2, shuffle=False, drop_last=False,
                      output="numpy", timeout=60) as loader:
        got = []
        with pytest.raises(RemoteError) as info:
            for batch in loader:
                got.append(batch["x"].copy())
    assert np.concatenate(got).tolist() == [1, 2, 3, 4]  # the batches before it arrive
    err = info.value
    assert err.code == grpc.StatusCode.DATA_LOSS
    assert "sample 4" in err.details and "not valid JSON" in err.details
    assert "b.jsonl line 4" in err.details  # the blank line counts; relative to the root
    assert str(data["root"]) not in err.details


def test_a_raw_array_with_a_wrong_magic_stops_the_start(tmp_path: Path) -> None:
    write_array(tmp_path / "x.arr", np.zeros((3, 2), np.float32))
    with open(tmp_path / "x.arr", "r+b") as f:
        f.write(b"NOTMAGIC")
    config = write_config(tmp_path / "c.yaml", {"datasets": {"m": {
        "format": "memmap", "source": str(tmp_path), "fields": {"x": "*.arr"}}}})
    with pytest.raises(RuntimeError) as info:
        ServerProcess(config, workers=1, env=server_env()).start()
    assert "dataset 'm': ValueError" in str(info.value)
    assert f"{tmp_path / 'x.arr'}: not a stoker array" in str(info.value)


# -- opened in this process: open errors, record errors, memory ------------------------------


def dataset(name: str, **cfg: Any) -> Any:
    return open_dataset(name, Config.model_validate({"datasets": {name: cfg}}))


def test_raw_header_round_trip(tmp_path: Path) -> None:
    for arr in [np.arange(24, dtype=">f8").reshape(2, 3, 4), np.array([True, False]),
                np.zeros((0, 5), np.uint16), np.arange(7, dtype=np.int8)]:
        h = write_array(tmp_path / "a.arr", arr)
        assert read_header(tmp_path / "a.arr") == h
        assert h.shape == arr.shape and h.dtype == arr.dtype.newbyteorder("<")
        assert h.offset % 64 == 0 and h.dtype.str[0] in "<|"
        assert (tmp_path / "a.arr").stat().st_size == h.offset + arr.nbytes
        back = np.memmap(tmp_path / "a.arr", h.dtype, "r", h.offset, h.shape)
        assert np.array_equal(back, arr)
    with pytest.raises(ValueError, match="ndim"):
        write_array(tmp_path / "b.arr", np.float32(1))
    with pytest.raises(ValueError, match="not bool, int or float"):
        write_array(tmp_path / "b.arr", np.array(["text"]))


def nothing(d: Path) -> None:
    pass


def blank_lines(d: Path) -> None:
    (d / "a.jsonl").write_text("\n\r\n\n")


def one_record(d: Path) -> None:
    (d / "a.jsonl").write_text("{}\n")


def odd_bytes(d: Path) -> None:
    (d / "a.bin").write_bytes(b"\0" * 7)


def two_tokens(d: Path) -> None:
    (d / "a.bin").write_bytes(b"\0" * 4)


def lengths_3_and_4(d: Path) -> None:
    write_array(d / "x.arr", np.zeros(3))
    write_array(d / "y.arr", np.zeros(4))


def rows_2_and_3(d: Path) -> None:
    write_array(d / "x.arr", np.zeros((3, 2)))
    write_array(d / "z.arr", np.zeros((3, 3)))


def truncated(d: Path) -> None:
    write_array(d / "x.arr", np.zeros(3))
    (d / "x.arr").write_bytes((d / "x.arr").read_bytes()[:-1])


def strings_npy(d: Path) -> None:
    np.save(d / "x.npy", np.array(["a"]))


@pytest.mark.parametrize(("setup", "cfg", "message"), [
    (nothing, {"format": "jsonl", "fields": {"x": {}}}, "no files match '**/*.jsonl'"),
    (blank_lines, {"format": "jsonl", "fields": {"x": {}}}, "no records in 1 file(s)"),
    (one_record, {"format": "jsonl", "fields": {"t": {"dtype": "utf8"}}},
     "fields.t\n  Value error, max_bytes is required for utf8 text"),
    (one_record, {"format": "jsonl", "fields": {"t": {"max_bytes": 3}}},
     "fields.t\n  Value error, max_bytes applies to utf8 text only"),
    (one_record, {"format": "jsonl", "fields": {"t": {"dtype": "utf8", "max_bytes": 3},
                                                "t_length": {}}}, "clashes"),
    (odd_bytes, {"format": "tokens", "seq_len": 2},
     "a.bin: 7 bytes is not header_bytes (0) plus whole uint16 tokens"),
    (odd_bytes, {"format": "tokens", "seq_len": 2, "header_bytes": 8},
     "a.bin: 7 bytes is not header_bytes (8) plus whole uint16 tokens"),
    (two_tokens, {"format": "tokens", "seq_len": 2}, "no file holds seq_len + 1 = 3 tokens"),
    (lengths_3_and_4, {"format": "memmap", "fields": {"x": "x.arr", "y": "y.arr"}},
     "fields have different lengths: {'x': 3, 'y': 4}"),
    (rows_2_and_3, {"format": "memmap", "fields": {"x": "*.arr"}},
     "z.arr: rows are <f8[3], but"),
    (truncated, {"format": "memmap", "fields": {"x": "x.arr"}},
     "x.arr: 87 bytes, but its header says 88 (<f8[3])"),
    (strings_npy, {"format": "memmap", "fields": {"x": "x.npy"}},
     "dtype <U1 is not bool, int or float"),
    (nothing, {"format": "memmap", "fields": {"x": "*.npy"}}, "field 'x': no files match"),
])
def test_what_cannot_open_is_a_value_error_naming_it(tmp_path: Path, setup, cfg: dict,
                                                     message: str) -> None:
    setup(tmp_path)
    with pytest.raises(ValueError) as info:
        dataset("d", source=str(tmp_path), **cfg)
    assert message in str(info.value)


@pytest.mark.parametrize(("record", "field", "message"), [
    ('{"a": {"b": 1}}', {"path": "a.c"}, "field 'x': no 'a.c' in the record"),
    ('{"a": 5}', {"path": "a.c"}, "field 'x': 'a.c': a int has no keys"),
    ('{"a": [1, 2]}', {"path": "a.2"}, "field 'x': 'a.2': list has 2 items"),
    ('{"x": [1, 2]}', {"shape": [3]}, "field 'x': shape [2], expected [3]"),
    ('{"x": "1.5"}', {"dtype": "float32"}, "field 'x': expected float32 numbers, got str"),
    ('{"x": null}', {"dtype": "float32"}, "field 'x': a null (set the field's fill"),
    ('{"x": [1, [2]]}', {"shape": [2]}, "field 'x': ragged lists"),
    ('{"x": 300}', {"dtype": "uint8"}, "field 'x': 300 does not fit uint8"),
    ('{"x": 1.5}', {"dtype": "int32"}, "field 'x': 1.5 does not fit int32"),
    ('{"x": 1e300}', {}, "does not fit float32"),
    ('{"x": 7}', {"dtype": "utf8", "max_bytes": 4}, "field 'x': expected a string, got int"),
    ('[1, 2', {}, "not valid JSON: Expecting ',' delimiter at column 6"),
    (b'{"x": "\xff"}', {"dtype": "utf8", "max_bytes": 4}, "not valid UTF-8 at byte 8"),
])
def test_a_bad_record_names_file_line_and_field(tmp_path: Path, record: str | bytes,
                                                field: dict, message: str) -> None:
    line = record if isinstance(record, bytes) else record.encode()
    (tmp_path / "a.jsonl").write_bytes(b'{"x": 1, "a": {"b": 1, "c": 2}}\n\n' + line + b"\n")
    ds = dataset("d", format="jsonl", source=str(tmp_path), fields={"x": field})
    assert len(ds) == 2
    with pytest.raises(ValueError) as info:
        ds[1]
    assert str(info.value).startswith(f"{tmp_path / 'a.jsonl'} line 3: ")
    assert message in str(info.value)
    assert ds.source_of(1) == f"{tmp_path / 'a.jsonl'} line 3"


def test_jsonl_shards_and_objects(data) -> None:
    ds = dataset("r", **configs(data["root"])["records"])
    assert len(ds) == 21 and ds.shard_starts.tolist() == [0, 13]
    assert ds.objects_of(np.array([20, 3, 14])) == ["a.jsonl", "b.jsonl"]
    assert ds.source_of(12) == f"{data['root'] / 'jsonl' / 'a.jsonl'} line 14"  # after the blank
    assert ds.source_of(20) == f"{data['root'] / 'jsonl' / 'b.jsonl'} line 9"


class NoWholeReads:
    """A storage that lets through only small ranged reads: whole files must be mapped."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.url = inner, inner.url

    def read(self, key: str) -> bytes:
        raise AssertionError(f"read({key!r}) of a whole file")

    def read_range(self, key: str, start: int, length: int) -> bytes:
        assert length <= 4096, f"read_range({key!r}, {start}, {length})"
        return self.inner.read_range(key, start, length)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_tokens_and_memmap_map_files_instead_of_reading_them(tmp_path: Path) -> None:
    from stoker.server.formats.memmap import Memmap
    from stoker.server.formats.tokens import Tokens
    from stoker.server.sources import open_storage

    gib = 1 << 30
    with open(tmp_path / "big.bin", "wb") as f:  # sparse: no disk, and no RAM if mapped
        f.write(np.arange(9, dtype="<u2").tobytes())
        f.truncate(gib)
        f.seek(gib - 18)  # the last window's last two tokens: 9 tokens from 2**29 - 16
        f.write(np.array([7, 8], dtype="<u2").tobytes())
    big = np.lib.format.open_memmap(tmp_path / "big.npy", "w+", np.float32, (gib // 64, 16))
    big[-1] = 5
    big.flush()
    del big
    cfg = Config.model_validate({"datasets": {
        "t": {"format": "tokens", "source": str(tmp_path), "seq_len": 8},
        "m": {"format": "memmap", "source": str(tmp_path),
              "fields": {"big": "big.npy"}}}}).datasets
    storage = NoWholeReads(open_storage(str(tmp_path)))
    tracemalloc.start()
    try:
        tokens = Tokens(cfg["t"], storage)
        first, last = tokens[0], tokens[len(tokens) - 1]
        rows = Memmap(cfg["m"], storage)
        row = rows[len(rows) - 1]["big"]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak  # a whole file would be 1 GiB
    assert len(tokens) == (gib // 2 - 1) // 8 and len(rows) == gib // 64
    assert first["input_ids"].tolist() == list(range(8))
    assert first["labels"].tolist() == list(range(1, 9))
    assert last["labels"][-2:].tolist() == [7, 8]
    assert row.tolist() == [5] * 16
    for arr in (first["input_ids"], last["labels"], row):  # copies, not views of the map
        assert type(arr) is np.ndarray and arr.flags.writeable
        assert arr.base is None or type(arr.base) is np.ndarray
