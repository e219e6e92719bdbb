"""format: mds: a Mosaic Streaming folder served as Mosaic's own reader yields it.

Mosaic's package (mosaicml-streaming) cannot be installed beside stoker's dependencies: its
newest release (0.13.0) requires numpy<2.2 (pip would downgrade numpy 2.4 to 2.1.3 and pull
torch 2.14.1 with CUDA, transformers, azure, google-cloud and oci clients); with numpy and torch
held, pip falls back to 0.10.0 and 37 packages. So the fixtures here are written by
`write_mds` below, which follows Mosaic's documented format (streaming/base/format/mds:
MDSWriter.encode_sample and encode_joint_shard, the encodings module, index.json version 2),
and the expected values are what Mosaic's decoders return for them (a PIL image for jpeg/png/
pil, numpy scalars for the fixed-width numbers, an int for `int` and `str_int`...). The same
reader was checked against shards written by MDSWriter 0.13.0 and read by its
StreamingDataset (installed apart, --no-deps): every encoding below, uncompressed and with
zstd, gz and bz2 compression, sample by sample.
"""

from __future__ import annotations

import bz2
import gzip
import io
import json
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zstandard
from PIL import Image

from stoker.client import RemoteLoader
from stoker.server import ServerProcess, write_config
from stoker.server._config import Config
from stoker.server.formats import open_dataset

import s3_endpoint as s3
from conftest import StartServer, server_env
from s3_endpoint import moto_endpoint_fixture  # noqa: F401  (the moto_endpoint fixture)

H, W = 5, 6
N = 11
COLUMNS = {"label": "int", "u8": "uint8", "f32": "float32", "f64": "float64", "big": "str_int",
           "ratio": "str_float", "price": "str_decimal", "emb": "ndarray:float32:2,3",
           "ids": "ndarray:int32", "any": "ndarray", "caption": "str", "blob": "bytes",
           "pair": "json", "photo": "jpeg", "mask": "png", "raw": "pil"}
FIELDS = {"label": {}, "u8": {}, "f32": {}, "f64": {}, "big": {}, "ratio": {}, "price": {},
          "emb": {}, "ids": {}, "any": {}, "caption": {"max_bytes": 12},
          "blob": {"max_bytes": 12}, "pair": {},
          "photo": {"size": [H, W], "layout": "hwc"}, "mask": {"size": [H, W], "layout": "hwc"},
          "raw": {"size": [H, W], "layout": "hwc"}}
CODECS = {"zstd": lambda d: zstandard.ZstdCompressor().compress(d), "gz": gzip.compress,
          "bz2": bz2.compress}
_NDARRAY_CODES = {"uint8": 8, "int8": 9, "uint16": 16, "int16": 17, "float16": 18,
                  "uint32": 32, "int32": 33, "float32": 34, "uint64": 64, "int64": 65,
                  "float64": 66}


def encode(encoding: str, value: Any) -> bytes:
    """One column's bytes as Mosaic's encodings write them."""
    base, _, args = encoding.partition(":")
    if base in ("int", "int64", "uint8", "float32", "float64"):
        return np.array(value, "int64" if base == "int" else base).astype(
            np.dtype("int64" if base == "int" else base).newbyteorder("<")).tobytes()
    if base in ("str_int", "str_float", "str_decimal", "str"):
        return str(value).encode("utf-8")
    if base == "bytes":
        return value
    if base == "json":
        return json.dumps(value).encode("utf-8")
    if base in ("jpeg", "png"):
        out = io.BytesIO()
        value.save(out, format="JPEG" if base == "jpeg" else "PNG",
                   **({"quality": int(args)} if args else {}))
        return out.getvalue()
    if base == "pil":
        mode = value.mode.encode("utf-8")
        return (np.array([*value.size, len(mode)], "<u4").tobytes() + mode + value.tobytes())
    assert base == "ndarray"
    parts = args.split(":") if args else []
    head = b""
    if not parts:
        head += bytes([_NDARRAY_CODES[value.dtype.name]])
    if len(parts) < 2:  # the shape: ndim << 2 | width code (0: uint8), then the dims
        head += bytes([value.ndim << 2 | 0]) + np.array(value.shape, np.uint8).tobytes()
    return head + value.astype(value.dtype.newbyteorder("<")).tobytes()


def fixed_size(encoding: str) -> int | None:
    base, _, args = encoding.partition(":")
    sizes = {"int": 8, "uint8": 1, "float32": 4, "float64": 8}
    if base == "ndarray" and args.count(":") == 1:
        dtype, shape = args.split(":")
        return int(np.prod([int(n) for n in shape.split(",")])) * np.dtype(dtype).itemsize
    return sizes.get(base)


def write_mds(out: Path, samples: list[dict[str, Any]], per_shard: int,
              compression: str | None = None) -> None:
    """Mosaic's layout: columns sorted by name; a shard is [n][offsets n+1][config][records],
    a record the uint32 sizes of its variable-size columns, then every column's bytes."""
    out.mkdir(parents=True)
    names = sorted(COLUMNS)
    encodings = [COLUMNS[n] for n in names]
    sizes = [fixed_size(e) for e in encodings]
    shards = []
    for s, start in enumerate(range(0, len(samples), per_shard)):
        records = []
        for sample in samples[start:start + per_shard]:
            data = [encode(e, sample[n]) for n, e in zip(names, encodings, strict=True)]
            head = np.array([len(d) for d, size in zip(data, sizes, strict=True)
                             if size is None], np.uint32).tobytes()
            records.append(head + b"".join(data))
        config = {"column_encodings": encodings, "column_names": names,
                  "column_sizes": sizes, "compression": compression, "format": "mds",
                  "hashes": [], "size_limit": 1 << 26, "version": 2}
        config_bytes = json.dumps(config, sort_keys=True).encode("utf-8")
        header = 4 + 4 * (len(records) + 1) + len(config_bytes)
        offsets = np.cumsum([header] + [len(r) for r in records]).astype(np.uint32)
        shard = (np.uint32(len(records)).tobytes() + offsets.tobytes() + config_bytes
                 + b"".join(records))
        raw = {"basename": f"shard.{s:05d}.mds", "bytes": len(shard), "hashes": {}}
        zipped = None
        if compression:
            data = CODECS[compression](shard)
            zipped = {"basename": f"{raw['basename']}.{compression}", "bytes": len(data),
                      "hashes": {}}
            (out / zipped["basename"]).write_bytes(data)
        else:
            (out / raw["basename"]).write_bytes(shard)
        shards.append({**config, "raw_data": raw, "samples": len(records), "zip_data": zipped})
    (out / "index.json").write_text(json.dumps({"shards": shards, "version": 2}))


def make_samples() -> list[dict[str, Any]]:
    rng = np.random.default_rng(7)
    out = []
    for i in range(N):
        rgb = rng.integers(0, 256, (H, W, 3), dtype=np.uint8)
        out.append({
            "label": i, "u8": np.uint8(200 + i % 50), "f32": np.float32(i / 3),
            "f64": np.float64(i / 7), "big": 2**40 + i, "ratio": i / 9,
            "price": Decimal("0.25") * i, "emb": rng.standard_normal((2, 3)).astype(np.float32),
            "ids": np.arange(4, dtype=np.int32) * i, "any": np.full((2, 2), i, np.int16),
            "caption": "é" * (i % 8), "blob": bytes(range(i)), "pair": [i, -i],
            "photo": Image.fromarray(rgb), "mask": Image.fromarray(rgb[:, :, 0]),
            "raw": Image.fromarray(rgb)})
    return out


def as_mosaic_yields(name: str, value: Any, written: bytes) -> Any:
    """What Mosaic's StreamingDataset gives for a written value (its decoders'
    return values); images decoded by Pillow, as Mosaic's JPEG and PNG encodings do."""
    if name in ("photo", "mask"):
        return np.asarray(Image.open(io.BytesIO(written)).convert("RGB"))
    if name == "raw":
        return np.asarray(value.convert("RGB"))
    if name == "price":
        return float(value)
    return value


@pytest.fixture(scope="module")
def mds(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("mds")
    samples = make_samples()
    write_mds(root / "plain", samples, per_shard=4)
    for codec in CODECS:
        write_mds(root / codec, samples, per_shard=5, compression=codec)
    return root, samples


def dataset(source: Path | str, fields: dict[str, Any] | None = None) -> Any:
    config = Config.model_validate({"datasets": {"d": {
        "format": "mds", "source": str(source), "fields": fields or FIELDS}}})
    return open_dataset("d", config)


@pytest.mark.parametrize("folder", ["plain", *CODECS])
def test_every_sample_equals_what_mosaic_decodes(mds, folder: str) -> None:
    root, samples = mds
    ds = dataset(root / folder)
    assert len(ds) == N
    for i, sample in enumerate(samples):
        got = ds[i]
        for name in FIELDS:
            written = encode(COLUMNS[name], sample[name])
            want = as_mosaic_yields(name, sample[name], written)
            if name in ("caption", "blob"):
                want = sample[name].encode("utf-8") if name == "caption" else sample[name]
                n = int(got[f"{name}_length"])
                assert bytes(got[name][:n]) == want[:12] and not got[name][n:].any()
                continue
            assert np.array_equal(got[name], want), (i, name, got[name], want)
            if isinstance(want, np.ndarray | np.generic):
                assert np.asarray(got[name]).dtype == want.dtype, name
    # "é" is two bytes: cut at 12 bytes, a character boundary; 7 "é" (14 bytes) -> 6 of them
    assert int(ds[7]["caption_length"]) == 12


def test_an_epoch_served_in_order_is_the_global_order_of_the_shards(
        start_server: StartServer, mds) -> None:
    root, samples = mds
    server = start_server({"m": {"format": "mds", "source": str(root / "zstd"),
                                 "fields": {"label": {}, "emb": {},
                                            "photo": {"size": [H, W], "layout": "hwc"}}}})
    for shuffle in (False, True):
        with RemoteLoader(server.address, "m", batch_size=4, shuffle=shuffle, drop_last=False,
                          output="numpy", timeout=60) as loader:
            batches = [{k: v.copy() for k, v in b.items()} for b in loader]
        labels = np.concatenate([b["label"] for b in batches])
        if shuffle:
            assert sorted(labels.tolist()) == list(range(N))
        else:
            assert labels.tolist() == list(range(N))
            emb = np.concatenate([b["emb"] for b in batches])
            assert np.array_equal(emb, np.stack([s["emb"] for s in samples]))


def test_an_mds_folder_on_s3_is_served(moto_endpoint: s3.MotoServer, mds, tmp_path: Path
                                       ) -> None:
    root, samples = mds
    client = s3.s3_client(moto_endpoint.url)
    bucket = s3.new_bucket(client)
    s3.put_objects(client, bucket, {f"train/{p.name}": p.read_bytes()
                                    for p in (root / "plain").iterdir()})
    config = write_config(tmp_path / "c.yaml", {
        "s3": {"endpoint_url": moto_endpoint.url, "region": "us-east-1"},
        "cache": {"dir": str(tmp_path / "cache")},
        "datasets": {"remote": {"format": "mds", "source": f"s3://{bucket}/train",
                                "fields": {"label": {}, "ids": {},
                                           "caption": {"max_bytes": 12}}}}})
    with ServerProcess(config, workers=1, env={**server_env(), **s3.s3_env()}) as server:
        with RemoteLoader(server.address, "remote", batch_size=3, shuffle=False,
                          drop_last=False, output="numpy", timeout=60) as loader:
            batches = [{k: v.copy() for k, v in b.items()} for b in loader]
    ids = np.concatenate([b["ids"] for b in batches])
    assert np.array_equal(ids, np.stack([s["ids"] for s in samples]))
    assert np.concatenate([b["label"] for b in batches]).tolist() == list(range(N))


def test_what_stoker_cannot_read_is_named_at_open(mds, tmp_path: Path, ledger) -> None:
    root, _ = mds
    index = json.loads((root / "plain" / "index.json").read_text())
    for shard in index["shards"]:
        shard["column_encodings"][shard["column_names"].index("pair")] = "pkl"
    (tmp_path / "pkl").mkdir()
    for p in (root / "plain").iterdir():
        (tmp_path / "pkl" / p.name).write_bytes(p.read_bytes())
    (tmp_path / "pkl" / "index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"column 'pair': encoding 'pkl': pickled objects"):
        dataset(tmp_path / "pkl")
    dataset(tmp_path / "pkl", {"label": {}})  # a column no field reads may be anything
    # Options that do not fit the column's encoding, named with it.
    with pytest.raises(ValueError, match=r"column 'caption' \(encoding 'str'\) holds text"):
        dataset(root / "plain", {"caption": {}})
    with pytest.raises(ValueError, match=r"column 'photo' \(encoding 'jpeg'\) is an image"):
        dataset(root / "plain", {"photo": {}})
    with pytest.raises(ValueError, match=r"field 'x': no column 'x'; the columns are"):
        dataset(root / "plain", {"x": {}})
    # A truncated shard: its size differs from the index's, found at open.
    shard = tmp_path / "pkl" / "shard.00001.mds"
    shard.write_bytes(shard.read_bytes()[:-3])
    with pytest.raises(ValueError, match=r"shard.00001.mds: \d+ bytes, the index says \d+"):
        dataset(tmp_path / "pkl", {"label": {}})
    ledger.record("corrupt input", "MDS: a pickle column, a truncated shard, options that "
                  "do not fit a column", tried=5, detail="refused at open, naming the column "
                  "and its encoding or the shard")
