"""The dataset contract: every format has the optional parts it is meant to have, under the
names the server looks up, and no name that is only a misspelling of one (which would
silently turn prefetch, block shuffle or error locations off)."""

from __future__ import annotations

import difflib
import io
import json
import struct
import tarfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from chat_data import make_tokenizer
from PIL import Image

from stoker.server import Config
from stoker.server.formats import FORMATS, OPTIONAL, DatasetParts, config_models, open_dataset
from stoker.server.formats.config_base import Sourced
from stoker.server.order.sampling import EpochKey

from tfrecord_files import example, write_array_record, write_tfrecord

# The formats that read storage (not python, not mixture).
_READERS = [f for f, m in zip(FORMATS, config_models(), strict=True) if issubclass(m, Sourced)]

# The optional parts each format has; a new format says here which it has.
SHARDED = {"source_of", "shard_starts", "objects_of", "storage"}
IMAGES = {"sample", "use_prefix_cache"}  # formats that may hold images (issue 17)
PLACED = {"place_of"}  # provenance by part: file and byte offset, row group and row, member
EXPECTED = {
    "image-folder": {"source_of", "objects_of", "storage"} | IMAGES | PLACED,
    "jsonl": SHARDED | PLACED | {"sample"},  # sample: video_frames fields draw per epoch
    "tokens": SHARDED | PLACED,
    "memmap": SHARDED,
    "tar": SHARDED | IMAGES | PLACED,
    "parquet": SHARDED | IMAGES | PLACED,
    "text": {"sample", "source_of", "objects_of", "storage"},
    "chat": {"sample", "source_of", "objects_of", "storage", "sample_lengths"},
    "mds": SHARDED | IMAGES,
    "litdata": SHARDED | IMAGES,
    "tfrecord": SHARDED | IMAGES | PLACED,
    "array_record": SHARDED | IMAGES | PLACED,
    "video": {"source_of", "objects_of", "storage"} | IMAGES | PLACED,
    "audio": {"sample", "source_of", "objects_of", "storage"} | PLACED,
}


def misspelled(names: Iterable[str]) -> dict[str, str]:
    """Public names that look like an optional part's name but are not one -> that part."""
    found = {}
    for name in names:
        if not name.startswith("_") and name not in OPTIONAL:
            close = difflib.get_close_matches(name, OPTIONAL, n=1, cutoff=0.8)
            if close:
                found[name] = close[0]
    return found


def write_chunked(folder: Path, fmt: str) -> None:
    """Two shards of two samples with one int64 column, as MDS or LitData lay them out."""
    shards = []
    for k in range(2):
        records = [(b"" if fmt == "mds" else struct.pack("<I", 8)) + struct.pack("<q", i)
                   for i in (2 * k, 2 * k + 1)]
        offsets = np.cumsum([16] + [len(r) for r in records]).astype("<u4")  # 4 + 4 * 3
        (folder / f"{k}.bin").write_bytes(struct.pack("<I", 2) + offsets.tobytes()
                                          + b"".join(records))
        shards.append({"format": "mds", "column_names": ["x"], "column_encodings": ["int"],
                       "column_sizes": [8], "samples": 2,
                       "raw_data": {"basename": f"{k}.bin"}, "zip_data": None}
                      if fmt == "mds" else {"filename": f"{k}.bin", "chunk_size": 2})
    index = ({"version": 2, "shards": shards} if fmt == "mds" else
             {"chunks": shards, "config": {"data_format": ["int"], "data_spec": None}})
    (folder / "index.json").write_text(json.dumps(index))


def png() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (4, 4), (10, 20, 30)).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """A tiny dataset of every format, two shards where the format has shards."""
    root = tmp_path_factory.mktemp("contract")
    for d in ("images/cat", "jsonl", "tokens", "memmap", "tar", "parquet", "text", "chat",
              "mds", "litdata", "video/cat", "audio/cat"):
        (root / d).mkdir(parents=True)
    import video_files

    video_files.write_video(root / "video" / "cat" / "a", "h264", frames=4)
    video_files.write_audio(root / "audio" / "cat" / "a", ".wav", seconds=0.5)
    write_chunked(root / "mds", "mds")
    write_chunked(root / "litdata", "litdata")
    (root / "images" / "cat" / "a.png").write_bytes(png())
    for name in ("a", "b"):
        (root / "jsonl" / f"{name}.jsonl").write_text('{"x": 1}\n{"x": 2}\n')
        (root / "tokens" / f"{name}.bin").write_bytes(np.arange(20, dtype="<u2").tobytes())
        np.save(root / "memmap" / f"{name}.npy", np.arange(6, dtype=np.float32).reshape(3, 2))
        with tarfile.open(root / "tar" / f"{name}.tar", "w") as tf:
            data = b"7"
            info = tarfile.TarInfo(f"{name}0.cls")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        pq.write_table(pa.table({"x": [1, 2, 3]}), root / "parquet" / f"{name}.parquet",
                       row_group_size=2)
        (root / "text" / f"{name}.jsonl").write_text(json.dumps({"text": "hello world"}) + "\n")
        (root / "chat" / f"{name}.jsonl").write_text(json.dumps({"messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}) + "\n")
        write_tfrecord(root / "tfrecord" / f"{name}.tfrecord", [example(x=1), example(x=2)])
        write_array_record(root / "array_record" / f"{name}.array_record",
                           [example(x=1), example(x=2)])
    return {
        "image-folder": {"source": str(root / "images"), "size": 4},
        "jsonl": {"source": str(root / "jsonl"), "fields": {"x": {"dtype": "int64"}}},
        "tokens": {"source": str(root / "tokens"), "seq_len": 4},
        "memmap": {"source": str(root / "memmap"), "fields": {"x": "*.npy"}},
        "tar": {"source": str(root / "tar"), "fields": {"label": {"ext": "cls",
                                                                  "decode": "int"}}},
        "parquet": {"source": str(root / "parquet"), "fields": {"x": {}}},
        "text": {"source": str(root / "text"), "seq_len": 4},
        "chat": {"source": str(root / "chat"), "seq_len": 64,
                 "tokenizer": str(make_tokenizer(root / "tok", ["hi", "hello"]))},
        "mds": {"source": str(root / "mds"), "fields": {"x": {}}},
        "litdata": {"source": str(root / "litdata"), "fields": {"0": {}}},
        "tfrecord": {"source": str(root / "tfrecord"), "features": {"x": {"kind": "int64"}}},
        "array_record": {"source": str(root / "array_record"),
                         "features": {"x": {"kind": "int64"}}},
        "video": {"source": str(root / "video"), "clip": {"frames": 2, "stride": 1}},
        "audio": {"source": str(root / "audio"), "duration": 0.1},
    }


def opened(configs: dict[str, dict[str, Any]], fmt: str, tmp_path: Path, **extra: Any) -> Any:
    config = Config.model_validate({
        "cache": {"dir": str(tmp_path / "cache")},
        "datasets": {"d": {"format": fmt, **configs[fmt], **extra}}})
    return open_dataset("d", config)


def present(parts: DatasetParts) -> set[str]:
    return {name for name in OPTIONAL if getattr(parts, name) is not None}


def test_every_format_says_which_parts_it_has() -> None:
    assert set(EXPECTED) == set(_READERS)
    assert set().union(*EXPECTED.values()) <= set(OPTIONAL)


@pytest.mark.parametrize("fmt", sorted(EXPECTED))
def test_a_format_has_its_parts_and_no_misspelled_one(configs, fmt: str, tmp_path: Path
                                                      ) -> None:
    ds = opened(configs, fmt, tmp_path)
    parts = DatasetParts.of(ds)
    assert present(parts) == EXPECTED[fmt]
    assert misspelled(dir(ds)) == {}
    assert len(ds) > 0 and parts.read(0, EpochKey()).keys() == ds[0].keys()
    if parts.shard_starts is not None:  # two files, or row groups: more than one shard
        assert parts.shard_starts[0] == 0 and len(parts.shard_starts) >= 2
    # text and chat read their tokenized corpus: no object to fetch
    if parts.objects_of is not None and fmt not in ("text", "chat"):
        assert parts.objects_of(np.array([len(ds) - 1]))


def test_a_transform_keeps_the_formats_parts_and_adds_sample(configs, tmp_path: Path) -> None:
    ds = opened(configs, "jsonl", tmp_path, transform="toy_datasets:jitter")
    assert present(DatasetParts.of(ds)) == SHARDED | PLACED | {"sample"}


def test_a_misspelled_part_is_found() -> None:
    assert misspelled(["object_of", "shard_start", "source", "samples", "keys", "_x",
                       "storage"]) == {"object_of": "objects_of", "shard_start": "shard_starts",
                                       "source": "source_of", "samples": "sample"}

