"""format: litdata: chunks written by LitData's own writer (BinaryWriter, what `optimize`
writes through) served as LitData's own StreamingDataset(shuffle=False) yields them, sample by
sample: uncompressed, zstd in frames (LitData's default for zstd), zstd over whole chunks, and
rows of plain values (which LitData keeps in an Arrow table appended to each chunk)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from stoker.client import RemoteLoader
from stoker.server._config import Config
from stoker.server.formats import open_dataset
from stoker.server.formats.litdata import column

from conftest import StartServer

litdata = pytest.importorskip("litdata")
from litdata import StreamingDataset  # noqa: E402
from litdata.streaming.writer import BinaryWriter  # noqa: E402

# LitData's reader makes tensors over read-only buffers (torch warns; not ours to fix).
pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable:UserWarning")

N = 8
H, W = 4, 5
FIELDS = {"label": {}, "weight": {}, "flag": {}, "emb": {}, "ids": {}, "mat": {},
          "half": {}, "caption": {"max_bytes": 10}, "blob": {"max_bytes": 10},
          "image": {"size": [H, W], "layout": "chw"}}
ROW_FIELDS = {"label": {}, "weight": {}, "caption": {"max_bytes": 10}}


def item(i: int, rng: np.random.Generator) -> dict[str, Any]:
    return {"label": i, "weight": i / 3, "flag": i % 2 == 0,
            "emb": rng.standard_normal((2, 3)).astype(np.float32),  # numpy (2-d)
            "ids": np.arange(3, dtype=np.int64) + i,  # no_header_numpy
            "mat": torch.arange(6, dtype=torch.int16).reshape(2, 3) * i,  # tensor
            "half": torch.full((4,), i / 2, dtype=torch.float16),  # no_header_tensor
            "caption": "ü" * i, "blob": bytes(range(i)),
            "image": Image.fromarray(rng.integers(0, 256, (H, W, 3), dtype=np.uint8))}  # pil


def write(out: Path, rows: bool = False, **options: Any) -> None:
    rng = np.random.default_rng(3)
    writer = BinaryWriter(str(out), chunk_size=3, **options)
    for i in range(N):
        writer[i] = ({"label": i, "weight": i / 3, "caption": "ü" * i} if rows
                     else item(i, rng))
    writer.done()
    writer.merge()


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("litdata")
    write(root / "plain")
    write(root / "zstd-batch", compression="zstd")
    write(root / "zstd-chunk", compression="zstd", compression_level="chunk")
    write(root / "rows", rows=True)
    return root


def dataset(source: Path, fields: dict[str, Any]) -> Any:
    config = Config.model_validate({"datasets": {"d": {
        "format": "litdata", "source": str(source), "fields": fields}}})
    return open_dataset("d", config)


def as_array(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.numpy()
    if isinstance(value, Image.Image):
        return np.asarray(value.convert("RGB")).transpose(2, 0, 1)
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, memoryview):
        return bytes(value)
    return value


@pytest.mark.parametrize("folder", ["plain", "zstd-batch", "zstd-chunk", "rows"])
def test_every_sample_equals_what_litdata_yields(folders: Path, folder: str) -> None:
    fields = ROW_FIELDS if folder == "rows" else FIELDS
    ds = dataset(folders / folder, fields)
    served = [ds[i] for i in range(len(ds))]  # first: LitData's reader replaces a compressed
    peer = StreamingDataset(str(folders / folder), shuffle=False)  # chunk by its inflated copy
    assert len(served) == len(peer) == N
    seen = 0
    for i, theirs in enumerate(peer):
        ours = served[i]
        for name in fields:
            want = as_array(theirs[name])
            if isinstance(want, bytes):
                n = int(ours[f"{name}_length"])
                assert bytes(ours[name][:n]) == want[:10] and not ours[name][n:].any(), name
                continue
            assert np.array_equal(ours[name], want), (i, name, ours[name], want)
            if isinstance(want, np.ndarray):
                assert ours[name].dtype == want.dtype, name
        seen += 1
    assert seen == N


def test_an_epoch_served_in_order_is_litdatas_order(start_server: StartServer,
                                                    folders: Path) -> None:
    server = start_server({"l": {"format": "litdata", "source": str(folders / "zstd-batch"),
                                 "fields": {"label": {}, "emb": {},
                                            "image": {"size": [H, W]}}}})
    with RemoteLoader(server.address, "l", batch_size=3, shuffle=False, drop_last=False,
                      output="numpy", timeout=60) as loader:
        batches = [{k: v.copy() for k, v in b.items()} for b in loader]
    peer = list(StreamingDataset(str(folders / "zstd-batch"), shuffle=False))
    assert np.concatenate([b["label"] for b in batches]).tolist() == list(range(N))
    assert np.array_equal(np.concatenate([b["emb"] for b in batches]),
                          np.stack([p["emb"] for p in peer]))
    assert np.array_equal(np.concatenate([b["image"] for b in batches]),
                          np.stack([as_array(p["image"]) for p in peer]))


def test_tensors_written_before_litdata_0_2_57_are_read_too() -> None:
    """LitData wrote a tensor's header in native (little-endian) order before 0.2.57 and
    big-endian since; the chunks do not say which, the sizes do."""
    values = np.arange(6, dtype=np.int32).reshape(3, 2)
    old = struct.pack("<4I", 15, 2, 3, 2) + values.tobytes()  # 15: torch.int32
    new = struct.pack(">4I", 15, 2, 3, 2) + values.tobytes()
    decode = column("t", "tensor").decode
    assert np.array_equal(decode(old), values) and np.array_equal(decode(new), values)
    with pytest.raises(ValueError, match="header and size do not agree"):
        decode(old[:-1])


def test_what_stoker_cannot_read_is_named_at_open(folders: Path, tmp_path: Path,
                                                  ledger) -> None:
    shutil.copytree(folders / "plain", tmp_path / "odd")
    index_file = tmp_path / "odd" / "index.json"
    index = json.loads(index_file.read_text())
    index["config"]["data_format"][0] = "pickle"  # the leaf `label`
    index_file.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"column 'label': serializer 'pickle' is not one"):
        dataset(tmp_path / "odd", {"label": {}})
    dataset(tmp_path / "odd", {"weight": {}})  # a leaf no field reads may be anything
    index["config"]["item_loader"] = "TokensLoader"
    index_file.write_text(json.dumps(index))
    with pytest.raises(ValueError, match="item_loader TokensLoader"):
        dataset(tmp_path / "odd", {"weight": {}})
    (tmp_path / "odd" / index["chunks"][1]["filename"]).unlink()
    index["config"]["item_loader"] = "PyTreeLoader"
    index_file.write_text(json.dumps(index))
    with pytest.raises(ValueError, match="names 1 files that are not there"):
        dataset(tmp_path / "odd", {"weight": {}})
    ledger.record("corrupt input", "LitData: a pickle leaf, a TokensLoader index, a chunk "
                  "missing", tried=3, detail="refused at open, naming the leaf and its "
                  "serializer, the item loader or the file")
