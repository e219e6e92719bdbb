"""format: parquet on what Hugging Face `datasets` writes: an `Image()` column, a ClassLabel
and a text column, `to_parquet`'d by `datasets` itself, served by a real server and compared
sample by sample with what `datasets`' own reader yields. Nulls (a pandas NaN) stop the start
unless a `fill` is given."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from PIL import Image

from stoker.client import RemoteLoader
from stoker.server import ServerProcess, write_config
from stoker.server.formats.tokenizer import BYTE_PAD

from conftest import StartServer

pytestmark = pytest.mark.timeout(120)

CROP = 8  # every image is at least CROP x CROP: a center crop to it resamples nothing
MAX_BYTES, MAX_TOKENS = 12, 10
ROWS, GROUP = 23, 5  # row groups of 5: a batch spans several

TEXTS = ["", "a cat", "héllo wörld", "日本語のテキストです", "exactly-twelve", "x" * 40]


def _jpeg(rgb: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """train.parquet as `datasets` writes it, and the rows `datasets` reads back from it."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here needs the Hub
    import datasets

    root = tmp_path_factory.mktemp("hub")
    rng = np.random.default_rng(7)
    images: list[Any] = []
    for i in range(ROWS):  # PNG, RGBA PNG, grayscale and JPEG, each its own size
        h, w = CROP + int(rng.integers(0, 9)), CROP + int(rng.integers(0, 9))
        rgb = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        if i % 4 == 0:
            images.append(Image.fromarray(rgb))
        elif i % 4 == 1:
            images.append(Image.fromarray(np.dstack([rgb, rgb[:, :, :1]]), mode="RGBA"))
        elif i % 4 == 2:
            images.append(Image.fromarray(rgb[:, :, 0], mode="L"))
        else:
            images.append({"bytes": _jpeg(rgb), "path": None})
    features = datasets.Features({
        "image": datasets.Image(),
        "label": datasets.ClassLabel(names=["cat", "dog", "bird"]),
        "text": datasets.Value("string"),
    })
    ds = datasets.Dataset.from_dict({
        "image": images, "label": [i % 3 for i in range(ROWS)],
        "text": [TEXTS[i % len(TEXTS)] for i in range(ROWS)]}, features=features)
    ds.to_parquet(str(root / "train.parquet"), batch_size=GROUP)
    assert pq.ParquetFile(root / "train.parquet").metadata.num_row_groups == -(-ROWS // GROUP)
    back = datasets.Dataset.from_parquet(str(root / "train.parquet"),
                                         cache_dir=str(root / "cache"))
    assert back.features == features  # the reader saw an Image() and a ClassLabel
    return root, list(back)


def expected_row(row: dict[str, Any]) -> dict[str, np.ndarray]:
    """A row as `datasets` decodes it, turned into what stoker serves: RGB pixels (Pillow's
    convert) center-cropped to CROP and at native size (no resample: exact), the text's UTF-8
    bytes, and its byte-tokenizer ids."""
    img: Image.Image = row["image"]
    rgb = np.asarray(img.convert("RGB"))
    h, w = rgb.shape[:2]
    top, left = round((h - CROP) / 2), round((w - CROP) / 2)
    data = row["text"].encode()
    cut = data[:MAX_BYTES].decode("utf-8", "ignore").encode()
    ids = np.full(MAX_TOKENS, BYTE_PAD, np.int64)
    ids[: min(len(data), MAX_TOKENS)] = np.frombuffer(data[:MAX_TOKENS], np.uint8)
    return {"image": rgb[top: top + CROP, left: left + CROP],
            "native": rgb, "native_size": np.array([h, w], np.int64),
            "label": np.int64(row["label"]),
            "text": np.frombuffer(cut.ljust(MAX_BYTES, b"\0"), np.uint8),
            "text_length": np.int64(len(cut)),
            "ids": ids, "ids_length": np.int64(min(len(data), MAX_TOKENS))}


HUB_FIELDS = {
    "image": {"decode": "image", "transforms": [{"center_crop": {"size": CROP}}],
              "layout": "hwc"},
    "native": {"column": "image", "decode": "image", "layout": "hwc"},  # neither: native size
    "label": {},
    "text": {"decode": "utf8", "max_bytes": MAX_BYTES},
    "ids": {"column": "text", "decode": "tokens", "tokenizer": "byte",
            "max_tokens": MAX_TOKENS},
}


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_datasets_parquet_is_served_as_datasets_reads_it(start_server: StartServer, hub,
                                                           shuffle: bool) -> None:
    root, rows = hub
    server = start_server({"hub": {"format": "parquet", "source": str(root),
                                   "fields": HUB_FIELDS}}, workers=2)
    with RemoteLoader(server.address, "hub", batch_size=4, shuffle=shuffle, drop_last=False,
                      output="numpy", timeout=60) as loader:
        batches = [{k: v.copy() for k, v in b.items()} for b in loader]
    # Per sample, not concatenated: native-size images are padded per batch.
    got = {k: [row for b in batches for row in b[k]] for k in batches[0]}
    index = np.array(got.pop("sample_index"))
    assert sorted(index.tolist()) == list(range(ROWS))
    assert (index.tolist() != list(range(ROWS))) == shuffle
    assert sorted(got) == sorted(expected_row(rows[0]))
    for position, i in enumerate(index):
        want = expected_row(rows[i])
        for name, value in want.items():
            served = got[name][position]
            if name == "native":  # padded to its batch's largest: the image, then zeros
                h, w = value.shape[:2]
                assert not served[h:].any() and not served[:, w:].any()
                served = served[:h, :w]
            assert served.dtype == value.dtype, name
            assert np.array_equal(served, value), (int(i), name)
    decoded = {bytes(t[:n]).decode() for t, n in zip(got["text"], got["text_length"],
                                                     strict=True)}
    assert "héllo wörld"[:10] in decoded  # cut at a character boundary: "ö" straddles 12


@pytest.fixture(scope="module")
def with_nan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """pandas' to_parquet of a frame with a NaN score and a None caption."""
    root = tmp_path_factory.mktemp("nan")
    pd.DataFrame({"score": [0.5, np.nan, 2.0, 3.5], "label": [1, 0, 1, 1],
                  "caption": ["a", None, "c", "d"]}).to_parquet(root / "part-0.parquet")
    return root


def start_fails(tmp_path: Path, dataset: dict[str, Any]) -> str:
    config = write_config(tmp_path / "bad.yaml", {"datasets": {"bad": dataset}})
    with pytest.raises(RuntimeError) as info:
        ServerProcess(config, workers=1).start()
    return str(info.value)


def test_a_nan_stops_the_start_naming_the_column_unless_filled(
        tmp_path: Path, with_nan: Path, start_server: StartServer, ledger) -> None:
    message = start_fails(tmp_path, {"format": "parquet", "source": str(with_nan),
                                     "fields": {"score": {}, "label": {}}})
    assert "part-0.parquet: field 'score': column 'score' holds 1 null(s)" in message
    assert "fill" in message
    message = start_fails(tmp_path, {"format": "parquet", "source": str(with_nan), "fields": {
        "caption": {"decode": "utf8", "max_bytes": 4}}})
    assert "column 'caption' holds 1 null(s)" in message

    server = start_server({"filled": {"format": "parquet", "source": str(with_nan), "fields": {
        "score": {"fill": -1.0, "dtype": "float32"}, "label": {},
        "caption": {"decode": "utf8", "max_bytes": 4, "fill": "?"}}}})
    with RemoteLoader(server.address, "filled", batch_size=4, shuffle=False,
                      output="numpy", timeout=60) as loader:
        (batch,) = list(loader)
    assert batch["score"].tolist() == [0.5, -1.0, 2.0, 3.5]
    assert batch["label"].dtype == np.int64 and batch["label"].tolist() == [1, 0, 1, 1]
    assert [bytes(t[:n]) for t, n in zip(batch["caption"], batch["caption_length"],
                                         strict=True)] == [b"a", b"?", b"c", b"d"]
    ledger.record("config", "a pandas NaN in a parquet column: start refused naming the "
                  "column; served with fill", tried=2)


@pytest.mark.parametrize(("column", "field", "message"), [
    ("image", {}, "column 'image' is struct<bytes: binary, path: string> (a Hugging Face "
                  "Image()): a field without decode needs numbers"),
    ("image", {}, "set decode: image"),
    ("text", {}, "column 'text' is string"),
    ("text", {}, "set decode: utf8 (its bytes) or decode: tokens"),
    ("label", {"decode": "image", "size": 4}, "column 'label' is int64: decode: image needs"),
    ("image", {"decode": "utf8", "max_bytes": 4}, "decode: utf8 needs a string column"),
])
def test_a_column_a_field_cannot_take_names_it_and_its_type(hub, column: str, field: dict,
                                                            message: str, ledger) -> None:
    from stoker.server import Config
    from stoker.server.formats import open_dataset

    root, _ = hub
    config = Config.model_validate({"datasets": {"d": {
        "format": "parquet", "source": str(root), "fields": {"x": {"column": column, **field}}}}})
    with pytest.raises(ValueError) as info:
        open_dataset("d", config)
    assert message in str(info.value)
    assert "train.parquet: field 'x'" in str(info.value)
    ledger.record("config", "a parquet column of a type the field cannot take: refused at "
                  "open naming the column and its Arrow type")


def test_a_binary_column_of_encoded_images_decodes_when_asked(tmp_path: Path) -> None:
    import pyarrow as pa

    from stoker.server import Config
    from stoker.server.formats import open_dataset

    rng = np.random.default_rng(5)
    pixels = [rng.integers(0, 256, (6, 7, 3), dtype=np.uint8) for _ in range(3)]
    encoded = []
    for rgb in pixels:
        buf = io.BytesIO()
        Image.fromarray(rgb).save(buf, format="PNG")
        encoded.append(buf.getvalue())
    pq.write_table(pa.table({"png": pa.array(encoded, pa.large_binary())}),
                   tmp_path / "p.parquet")
    config = Config.model_validate({"datasets": {"d": {
        "format": "parquet", "source": str(tmp_path / "p.parquet"),
        "fields": {"img": {"column": "png", "decode": "image", "size": [6, 7]}}}}})
    ds = open_dataset("d", config)
    for i, rgb in enumerate(pixels):
        assert np.array_equal(ds[i]["img"], rgb.transpose(2, 0, 1))  # chw, no resample


def test_images_datasets_kept_as_paths_stop_the_open(tmp_path: Path) -> None:
    import datasets

    from stoker.server import Config
    from stoker.server.formats import open_dataset

    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(tmp_path / "x.png")
    ds = datasets.Dataset.from_dict({"image": [str(tmp_path / "x.png")]},
                                    features=datasets.Features({"image": datasets.Image()}))
    (tmp_path / "data").mkdir()
    ds.to_parquet(str(tmp_path / "data" / "p.parquet"))  # keeps the path, not the bytes
    config = Config.model_validate({"datasets": {"d": {
        "format": "parquet", "source": str(tmp_path / "data"),
        "fields": {"image": {"decode": "image", "size": 4}}}}})
    with pytest.raises(ValueError, match="column 'image' has no image bytes in 1 row"):
        open_dataset("d", config)
