"""format: tar against webdataset's own reader, on shards its TarWriter wrote: plain, `.tar.gz`
and `.tgz`; extensions in any case (webdataset lowercases them); `decode: json` members; images
at their native size. Sample by sample, stoker serves what webdataset yields (its grouping,
decoded by Pillow and json)."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from test_exact_decode import OTHERS, picture, pillow_rgb
from webdataset import TarWriter
from webdataset.tariterators import group_by_keys, tar_file_expander

from stoker.client import RemoteLoader
from stoker.server import ServerProcess, write_config

from conftest import server_env

SHARDS = ["shard-0.tar", "shard-1.tar.gz", "shard-2.tgz"]
PER_SHARD = 5
FIELDS = {
    "image": {"ext": "jpg", "decode": "image", "layout": "hwc"},  # native size
    "label": {"ext": "json", "decode": "json", "path": "label", "dtype": "int64"},
    "box": {"ext": "json", "decode": "json", "path": "box", "dtype": "float32", "shape": [4]},
    "name": {"ext": "json", "decode": "json", "path": "name", "dtype": "utf8", "max_bytes": 8},
    "cls": {"ext": "CLS", "decode": "int"},  # the config's case does not matter either
}


def jpeg(rgb: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="JPEG", quality=85)
    return buf.getvalue()


def webdataset_samples(paths: list[Path]) -> list[dict[str, Any]]:
    """webdataset's grouping of the shards' members into samples (the functions its
    WebDataset pipeline runs), each shard read from a file we close."""
    out: list[dict[str, Any]] = []
    for path in paths:
        with open(path, "rb") as f:
            out += group_by_keys(tar_file_expander([{"url": str(path), "stream": f}]))
    return out


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("wds")
    for s, name in enumerate(SHARDS):
        with TarWriter(str(root / name), encoder=False) as sink:
            for i in range(PER_SHARD):
                n = s * PER_SHARD + i
                meta = {"label": n, "box": [n, n / 2, n / 4, -1.5], "name": "é" * (n % 6)}
                sink.write({"__key__": f"train/{n:04d}",
                            # upper-case extensions in one shard, as some cameras name files
                            "JPG" if s == 1 else "jpg": jpeg(picture(30 + n % 4, 40 - n % 3, n)),
                            "json": json.dumps(meta).encode(), "cls": str(n % 7).encode()})
    return root


@pytest.fixture(scope="module")
def server_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("wds-server")


@pytest.fixture(scope="module")
def server(shards: Path, server_dir: Path) -> Iterator[ServerProcess]:
    tmp = server_dir
    (tmp / "other").mkdir()
    with TarWriter(str(tmp / "other" / "o.tar"), encoder=False) as sink:
        for i, data in enumerate(OTHERS.values()):  # any format Pillow reads, by content
            sink.write({"__key__": f"{i:03d}", "img": data})
    config = write_config(tmp / "config.yaml", {"cache": {"dir": str(tmp / "cache")}, "datasets": {
        "wds": {"format": "tar", "source": str(shards), "fields": FIELDS},
        "other": {"format": "tar", "source": str(tmp / "other"),
                  "fields": {"image": {"ext": "img", "decode": "image"}}}}})
    with ServerProcess(config, workers=2, env=server_env()) as proc:
        yield proc
    assert proc.proc is not None and proc.proc.returncode == 0, proc.stderr


def served(server: ServerProcess, name: str, batch_size: int = 4) -> list[dict[str, np.ndarray]]:
    with RemoteLoader(server.address, name, batch_size=batch_size, shuffle=False,
                      drop_last=False, output="numpy", timeout=60) as loader:
        return [{k: v.copy() for k, v in b.items()} for b in loader]


def test_tar_serves_what_webdataset_reads(server: ServerProcess, shards: Path) -> None:
    want = webdataset_samples([shards / name for name in SHARDS])
    assert len(want) == len(SHARDS) * PER_SHARD and all("jpg" in w for w in want)
    rows = [(b, r) for b in served(server, "wds") for r in range(len(b["sample_index"]))]
    assert [int(b["sample_index"][r]) for b, r in rows] == list(range(len(want)))
    for (b, r), w in zip(rows, want, strict=True):
        meta = json.loads(w["json"])
        h, w_ = b["image_size"][r]
        assert np.array_equal(b["image"][r][:h, :w_], pillow_rgb(w["jpg"])), w["__key__"]
        assert b["label"][r] == meta["label"] and b["label"].dtype == np.int64
        assert np.array_equal(b["box"][r], np.asarray(meta["box"], np.float32))
        cut = meta["name"].encode()[:8].decode("utf-8", "ignore")  # max_bytes, whole chars
        assert bytes(b["name"][r][: b["name_length"][r]]).decode() == cut
        assert b["cls"][r] == int(w["cls"])


def test_gzipped_shards_are_decompressed_once_into_the_cache(server: ServerProcess,
                                                             server_dir: Path) -> None:
    copies = list((server_dir / "cache" / "tar").glob("*"))
    assert len(copies) == 2  # the .tar.gz and the .tgz, once for both workers


def test_any_format_pillow_reads_through_tar_at_native_size(server: ServerProcess) -> None:
    (batch,) = served(server, "other", batch_size=len(OTHERS))
    assert batch["image"].shape[:2] == (len(OTHERS), 3)  # CHW, padded to the largest
    for image, (h, w), data in zip(batch["image"], batch["image_size"], OTHERS.values(),
                                   strict=True):
        assert np.array_equal(image[:, :h, :w].transpose(1, 2, 0), pillow_rgb(data))
        assert not image[:, h:].any() and not image[:, :, w:].any()


def test_a_damaged_gzip_shard_stops_the_server_naming_it(tmp_path: Path, ledger) -> None:
    (tmp_path / "d").mkdir()
    good = tmp_path / "d" / "a.tar.gz"
    with TarWriter(str(good), encoder=False) as sink:
        sink.write({"__key__": "0", "cls": b"1"})
    (tmp_path / "d" / "b.tgz").write_bytes(good.read_bytes()[:-20])  # cut short
    config = write_config(tmp_path / "c.yaml", {"cache": {"dir": str(tmp_path / "cache")},
                                                "datasets": {"bad": {
        "format": "tar", "source": str(tmp_path / "d"),
        "fields": {"cls": {"ext": "cls", "decode": "int"}}}}})
    with pytest.raises(RuntimeError) as info:
        ServerProcess(config, workers=1, env=server_env()).start()
    assert "b.tgz" in str(info.value) and "not a readable gzip file" in str(info.value)
    left = list((tmp_path / "cache" / "tar").iterdir())
    assert len(left) == 1 and left[0].suffix == ".tar"  # a's copy; nothing half-written
    ledger.record("corrupt input", "gzipped tar shard cut short: refused at start, named")


def test_gzipped_shards_are_held_in_memory_where_the_cache_cannot_be_written(
        shards: Path, tmp_path: Path) -> None:
    from stoker.server.formats.tar import Tar
    from stoker.server.formats.tar_config import TarDataset
    from stoker.server.sources import open_storage

    blocked = tmp_path / "not-a-folder"
    blocked.write_bytes(b"")  # cache.dir is a file: no folder can be made in it
    cfg = TarDataset.model_validate({"format": "tar", "source": str(shards),
                                     "fields": {"cls": {"ext": "cls", "decode": "int"}}})
    tar = Tar(cfg, open_storage(str(shards)), "*.tgz", cache_dir=blocked)
    assert [int(tar[i]["cls"]) for i in range(len(tar))] == [n % 7 for n in range(10, 15)]
