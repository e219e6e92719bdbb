"""format: tokens refuses what is not a flat stream of token ids, instead of serving windows of
garbage: a LitData chunk folder (hand-made after its layout, and written by litdata's own
`optimize` where litdata is installed), a nanoGPT folder holding train.bin and val.bin, ids
out of the vocabulary or of the dtype's plausible range. A missing file says so."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stoker.client import RemoteLoader
from stoker.server import Config, ConfigError, ServerProcess, load_config, write_config
from stoker.server.formats import open_dataset

from conftest import StartServer

pytestmark = pytest.mark.timeout(120)


def open_tokens(source: Path | str, **cfg: Any) -> Any:
    config = Config.model_validate({"datasets": {"t": {
        "format": "tokens", "source": str(source), "seq_len": 8, **cfg}}})
    return open_dataset("t", config)


def refused(source: Path | str, **cfg: Any) -> str:
    with pytest.raises(ValueError) as info:
        open_tokens(source, **cfg)
    return str(info.value)


def nanogpt_split(path: Path, ids: np.ndarray) -> None:
    """As nanoGPT's data/*/prepare.py writes a split: np.uint16, little-endian, no header."""
    arr = np.memmap(path, dtype=np.uint16, mode="w+", shape=(len(ids),))
    arr[:] = ids
    arr.flush()


def litdata_by_hand(folder: Path) -> None:
    """LitData's layout: index.json beside chunk-RANK-N.bin, each chunk a uint32 item count,
    the items' offsets, then the serialized items."""
    folder.mkdir()
    chunks = []
    for n in range(3):
        items = [np.arange(i, i + 16, dtype=np.int64).tobytes() for i in range(4)]
        offsets = np.cumsum([0] + [len(b) for b in items]) + 4 * (len(items) + 2)
        data = (np.uint32(len(items)).tobytes() + offsets.astype(np.uint32).tobytes()
                + b"".join(items))
        (folder / f"chunk-0-{n}.bin").write_bytes(data)
        chunks.append({"chunk_bytes": len(data), "chunk_size": len(items),
                       "filename": f"chunk-0-{n}.bin", "dim": None})
    (folder / "index.json").write_text(json.dumps({
        "chunks": chunks, "config": {"data_format": ["int", "no_header_numpy:0"]}}))


LITDATA_SCRIPT = """
import sys
import numpy as np
from litdata import optimize

def sample(i):
    return {"index": i, "tokens": np.arange(i, i + 16, dtype=np.int64)}

if __name__ == "__main__":
    optimize(fn=sample, inputs=list(range(40)), output_dir=sys.argv[1], chunk_bytes="1KB",
             num_workers=1, mode="overwrite")
"""


def test_a_litdata_chunk_folder_stops_the_start_pointing_at_its_format(
        tmp_path: Path, ledger) -> None:
    litdata_by_hand(tmp_path / "lit")
    config = write_config(tmp_path / "c.yaml", {"datasets": {"corpus": {
        "format": "tokens", "source": str(tmp_path / "lit"), "seq_len": 8}}})
    with pytest.raises(RuntimeError) as info:
        ServerProcess(config, workers=1).start()
    message = str(info.value)
    assert "dataset 'corpus'" in message
    assert f"{tmp_path / 'lit' / 'index.json'}: a LitData chunk folder, not flat token " \
           "files" in message
    assert "format: litdata" in message
    # A glob that names the chunks is refused as well.
    assert "a LitData chunk folder" in refused(tmp_path / "lit" / "chunk-*.bin")
    ledger.record("config", "format: tokens pointed at a LitData chunk folder: start refused, "
                  "naming the folder and the format that reads it", tried=2)


def test_a_folder_litdata_optimize_wrote_is_refused(tmp_path: Path, ledger) -> None:
    pytest.importorskip("litdata")
    script = tmp_path / "write.py"
    script.write_text(LITDATA_SCRIPT)
    subprocess.run([sys.executable, str(script), str(tmp_path / "out")], check=True,
                   capture_output=True, timeout=100)
    assert (tmp_path / "out" / "index.json").exists()
    assert "a LitData chunk folder" in refused(tmp_path / "out")
    ledger.record("config", "format: tokens pointed at a folder litdata's optimize wrote: "
                  "refused")


def test_an_mds_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "index.json").write_text('{"version": 2, "shards": []}')
    (tmp_path / "shard.00000.mds").write_bytes(b"\0" * 64)
    assert "a Mosaic MDS folder" in refused(tmp_path / "*.mds")


def test_a_nanogpt_folder_must_name_its_split(tmp_path: Path, start_server: StartServer,
                                              ledger) -> None:
    rng = np.random.default_rng(0)
    train = rng.integers(0, 50257, 8 * 20 + 1).astype(np.uint16)
    nanogpt_split(tmp_path / "train.bin", train)
    nanogpt_split(tmp_path / "val.bin", rng.integers(0, 50257, 8 * 5 + 1).astype(np.uint16))
    (tmp_path / "meta.pkl").write_bytes(b"\x80\x04}\x94.")  # what the char-level prepare writes
    message = refused(tmp_path)
    assert "holds train.bin, val.bin: nanoGPT's splits" in message
    assert f"source: {tmp_path / 'train.bin'}" in message

    server = start_server({"owt": {"format": "tokens", "source": str(tmp_path / "train.bin"),
                                   "seq_len": 8, "vocab_size": 50257}})
    with RemoteLoader(server.address, "owt", batch_size=7, shuffle=False, drop_last=False,
                      output="numpy", timeout=60) as loader:
        ids = np.concatenate([b["input_ids"] for b in loader])
    assert np.array_equal(ids, train[:-1].reshape(20, 8).astype(np.int64))
    ledger.record("config", "format: tokens on a nanoGPT folder holding train.bin and val.bin: "
                  "refused; train.bin named: served", tried=2)


def test_ids_out_of_range_are_refused(tmp_path: Path, ledger) -> None:
    ids = np.arange(100, dtype=np.uint16)
    (tmp_path / "a").mkdir()
    nanogpt_split(tmp_path / "a" / "x.bin", ids)
    assert len(open_tokens(tmp_path / "a", vocab_size=100)) == 12
    message = refused(tmp_path / "a", vocab_size=99)
    assert "x.bin: token 99 is 99, not below vocab_size 99" in message

    (tmp_path / "b").mkdir()  # uint32 ids read as uint16: every second value is 0
    (tmp_path / "b" / "x.bin").write_bytes(np.arange(1, 200, dtype="<u4").tobytes())
    assert "these look like uint32 tokens; set dtype: uint32" in refused(tmp_path / "b")
    assert len(open_tokens(tmp_path / "b", dtype="uint32")) == 24

    (tmp_path / "c").mkdir()  # uint16 ids read as uint32
    (tmp_path / "c" / "x.bin").write_bytes(np.arange(300, 500, dtype="<u2").tobytes())
    assert "uint16 tokens read as uint32?" in refused(tmp_path / "c", dtype="uint32")
    ledger.record("config", "token files with ids past vocab_size, or of the other dtype: "
                  "refused at start naming the file", tried=3)


def test_a_window_past_the_vocabulary_fails_when_read(tmp_path: Path) -> None:
    ids = np.zeros(8 * 1000 + 1, np.uint16)  # past the bytes sampled at open
    ids[-3] = 500
    nanogpt_split(tmp_path / "x.bin", ids)
    tokens = open_tokens(tmp_path, vocab_size=500)
    assert tokens[0]["input_ids"].tolist() == [0] * 8
    with pytest.raises(ValueError, match="token 7998 is 500, not below vocab_size 500"):
        tokens[len(tokens) - 1]


def test_a_missing_file_says_it_does_not_exist(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"datasets: {{t: {{format: tokens, source: {tmp_path / 'train.bin'}, "
                    "seq_len: 8}}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert f"no such file or directory: {tmp_path / 'train.bin'}" in str(info.value)
    assert "not a directory" not in str(info.value)
