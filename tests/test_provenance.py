"""Provenance through real servers: `loader.provenance(epoch, index)` and `stoker inspect
--epoch E --index I` name, for each sample of a batch, the file and the line, row group and
row, tar member or token range it came from, and the byte offset and length read there,
checked against the files themselves (the bytes at that offset are the sample's)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import determinism_datasets
import numpy as np
import pyarrow.parquet as pq
import pytest

from stoker.client import RemoteError, RemoteLoader
from stoker.server import ServerProcess

from conftest import StartServer

pytestmark = pytest.mark.timeout(120)

WORLD = 2
SEQ = determinism_datasets.SEQ_LEN


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("provenance")


@pytest.fixture(scope="module")
def server(root: Path, start_server_module: StartServer) -> ServerProcess:
    return start_server_module(determinism_datasets.make(root),
                               cache={"dir": str(root / "cache")})


def sources(address: str, dataset: str, epoch: int = 1, index: int = 1, order: str = "index"
            ) -> tuple[dict[str, np.ndarray], list[dict[str, Any]]]:
    size = {"batch_tokens": 64} if dataset.startswith("doc") else {"batch_size": 3}
    with RemoteLoader(address, dataset, **size, seed=7, rank=1, world_size=WORLD,
                      order=order, output="numpy", timeout=60) as loader:
        return loader.batch_at(epoch, index), loader.provenance(epoch, index)


def rows_of(batch: dict[str, np.ndarray], found: list[dict[str, Any]]) -> list[tuple]:
    """(row, sample index, source) of each sample, the indices checked against the batch's."""
    assert [s["sample_index"] for s in found] == batch["sample_index"].tolist()
    return [(row, s["sample_index"], s["source"]) for row, s in enumerate(found)]


def test_tokens_name_the_file_and_the_token_range(server: ServerProcess, root: Path) -> None:
    batch, found = sources(server.address, "toks")
    for row, _, source in rows_of(batch, found):
        path, first, end = re.fullmatch(r"(.+) tokens (\d+)\.\.(\d+)", source).groups()
        tokens = np.fromfile(path, "<u2").astype(np.int64)
        assert Path(path).parent == root / "tokens"
        assert np.array_equal(tokens[int(first):int(end)], batch["input_ids"][row])
        # by part: the bytes read, input_ids and the label after them
        at, n = found[row]["offset"], found[row]["nbytes"]
        assert found[row]["file"] == path and at == 2 * int(first) and n == 2 * (SEQ + 1)
        read = np.frombuffer(Path(path).read_bytes()[at:at + n], "<u2").astype(np.int64)
        assert np.array_equal(read, [*batch["input_ids"][row], batch["labels"][row][-1]])


def test_jsonl_names_the_file_and_the_line(server: ServerProcess, root: Path) -> None:
    batch, found = sources(server.address, "docs")
    for row, index, source in rows_of(batch, found):
        path, line = re.fullmatch(r"(.+) line (\d+)", source).groups()
        record = json.loads(Path(path).read_text().splitlines()[int(line) - 1])
        assert record["label"] == index == batch["label"][row]
        assert Path(path).parent == root / "jsonl"
        assert_record_at(found[row], path, int(line), batch["label"][row])


def assert_record_at(place: dict[str, Any], path: str, line: int, label: int) -> None:
    """`place`'s file, offset and nbytes are the record of `label`, at the line named."""
    data = Path(place["file"]).read_bytes()
    at, n = place["offset"], place["nbytes"]
    assert place["file"] == path and place["line"] == line
    assert json.loads(data[at:at + n])["label"] == label
    assert at == 0 or data[at - 1:at] == b"\n"  # a whole line
    assert data[at + n:at + n + 1] in (b"\n", b"")
    assert data[:at].count(b"\n") == line - 1


def test_parquet_names_the_file_the_row_group_and_the_row(server: ServerProcess) -> None:
    batch, found = sources(server.address, "rows")
    for row, _, source in rows_of(batch, found):
        path, group, at = re.fullmatch(r"(.+) row group (\d+) row (\d+)", source).groups()
        table = pq.ParquetFile(path).read_row_group(int(group))
        assert table.column("label")[int(at)].as_py() == batch["label"][row]
        assert (found[row]["file"], found[row]["row_group"], found[row]["row"]) == (
            path, int(group), int(at))


def test_tar_names_the_shard_and_the_member(server: ServerProcess, root: Path) -> None:
    batch, found = sources(server.address, "shards")
    for row, _, source in rows_of(batch, found):
        path, key = re.fullmatch(r"(.+) member (.+)\.\*", source).groups()
        with tarfile.open(path) as tar:
            data = tar.extractfile(f"{key}.cls").read()
        assert int(data) == batch["cls"][row]
        assert Path(path).parent == root / "shards"
        place = found[row]  # by part: the member's data, at its byte offset in the shard
        assert place["file"] == path and place["member"] == f"{key}.cls"
        raw = Path(path).read_bytes()[place["offset"]:place["offset"] + place["nbytes"]]
        assert raw == data


def test_image_folder_names_the_file(server: ServerProcess, root: Path) -> None:
    from PIL import Image

    batch, found = sources(server.address, "pics")
    classes = sorted(p.name for p in (root / "images").iterdir())
    for row, _, source in rows_of(batch, found):
        path = Path(source)
        assert found[row]["file"] == source and set(found[row]) == {"sample_index", "source",
                                                                      "file"}
        assert path.parent.parent == root / "images"
        assert classes.index(path.parent.name) == batch["label"][row]
        small = np.asarray(Image.open(path).convert("RGB").resize((4, 4), Image.BILINEAR))
        assert np.abs(small.transpose(2, 0, 1).astype(int) - batch["image"][row]).max() <= 64


def test_a_mixture_names_the_component(server: ServerProcess) -> None:
    batch, found = sources(server.address, "mix")
    names = ["a", "b"]
    for row, _, source in rows_of(batch, found):
        name, sample = re.fullmatch(r"component '(\w)' sample (\d+)", source).groups()
        assert names.index(name) == batch["source"][row]
        assert batch["x"][row][0] == int(sample)  # mixture_datasets.Named: x[0] is i
        assert (found[row]["component"], found[row]["component_index"]) == (name, int(sample))


def test_a_mixture_of_files_names_the_component_and_the_bytes(server: ServerProcess,
                                                              root: Path) -> None:
    # The legacy order's plan: this batch holds both components (under index orders the
    # same position may hold one)
    batch, found = sources(server.address, "docmix", order="legacy")
    assert {s["component"] for s in found} == {"docs", "docs_b"}
    for row, _, source in rows_of(batch, found):
        path, line = re.fullmatch(r"component '\w+' sample \d+, (.+) line (\d+)",
                                  source).groups()
        assert Path(path).parent == root / ("jsonl" if found[row]["component"] == "docs"
                                            else "jsonl_b")
        assert_record_at(found[row], path, int(line), batch["label"][row])


def test_provenance_of_an_index_past_the_epoch(server: ServerProcess) -> None:
    with pytest.raises(RemoteError) as e:
        sources(server.address, "rows", index=1000)
    assert e.value.code.name == "INVALID_ARGUMENT"


def stoker(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stoker.server", *args], capture_output=True,
                          text=True, timeout=100)


def test_inspect_prints_each_samples_source_and_saves_the_arrays(
        server: ServerProcess, tmp_path: Path) -> None:
    batch, found = sources(server.address, "rows", epoch=2, index=3)
    out = stoker("inspect", server.address, "rows", "--epoch", "2", "--index", "3",
                 "--rank", "1", "--world-size", str(WORLD), "--batch-size", "3", "--seed", "7",
                 "--drop-last", "--out", str(tmp_path / "b.npz"))
    assert out.returncode == 0, out.stderr
    assert f"samples {batch['sample_index'].tolist()}" in out.stdout
    for row, s in enumerate(found):
        assert f"{row:>5}{s['sample_index']:>10}  {s['source']}" in out.stdout
        assert f"row_group={s['row_group']}  row={s['row']}" in out.stdout
    saved = np.load(tmp_path / "b.npz")
    assert all(np.array_equal(saved[k], batch[k]) for k in batch)
    out = stoker("inspect", server.address, "docs", "--batch-tokens", "64", "--index", "2",
                 "--rank", "1", "--world-size", str(WORLD), "--seed", "7", "--epoch", "1")
    assert out.returncode == 0, out.stderr
    docs, found = sources(server.address, "docs", epoch=1, index=2)
    assert f"samples {docs['sample_index'].tolist()}" in out.stdout
    assert found[0]["source"] in out.stdout
    assert f"offset={found[0]['offset']}  nbytes={found[0]['nbytes']}  line={found[0]['line']}" \
        in out.stdout
