"""Tiny datasets of several formats, written to a folder, for the determinism tests
(test_determinism.py, test_exclusions.py, test_provenance.py): image-folder, tokens, jsonl
(with token lengths, and a mixture of two), parquet, tar, a `format: python` dataset of 48
samples (`plain`) and a mixture of `format: python` components."""

from __future__ import annotations

import io
import itertools
import json
import tarfile
from pathlib import Path
from typing import Any

import numpy as np

JSONL_ROWS = (0, 90, 200)  # two files: rows [0, 90) and [90, 200)
MIXED_ROWS = 60  # docs_b's rows
SEQ_LEN = 8
TOKEN_FILES = (97, 130)  # tokens in each .bin file (uint16)
ROWS = 40  # parquet rows, row groups of 10


def doc_lengths() -> np.ndarray:
    return np.random.default_rng(11).integers(4, 40, JSONL_ROWS[-1])


def make(root: Path) -> dict[str, Any]:
    """Write the files under `root`; the config's `datasets:`."""
    from PIL import Image

    rng = np.random.default_rng(5)
    for c, cls in enumerate(("cat", "dog")):
        (root / "images" / cls).mkdir(parents=True)
        for i in range(15):
            pixels = rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / "images" / cls / f"{c}{i}.png")
    (root / "tokens").mkdir()
    for k, n in enumerate(TOKEN_FILES):
        tokens = np.arange(n, dtype="<u2") + 1000 * k
        (root / "tokens" / f"{k:02d}.bin").write_bytes(tokens.tobytes())
    (root / "jsonl").mkdir()
    lengths = doc_lengths()
    for f, (a, b) in enumerate(itertools.pairwise(JSONL_ROWS)):
        with open(root / "jsonl" / f"part-{f}.jsonl", "w") as out:
            for i in range(a, b):
                out.write(json.dumps({"ids": [i] * int(lengths[i]), "label": i}) + "\n")
    (root / "jsonl_b").mkdir()  # a second corpus, mixed with the first (`docmix`)
    with open(root / "jsonl_b" / "part-0.jsonl", "w") as out:
        for i, n in enumerate(doc_lengths()[:MIXED_ROWS][::-1] // 2 + 3):
            out.write(json.dumps({"ids": [-1 - i] * int(n), "label": 1000 + i}) + "\n")
    (root / "rows").mkdir()
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"label": np.arange(ROWS, dtype=np.int64)}),
                   root / "rows" / "rows.parquet", row_group_size=10)
    (root / "shards").mkdir()
    for s in range(2):
        with tarfile.open(root / "shards" / f"shard-{s}.tar", "w") as tar:
            for n in range(s * 12, s * 12 + 12):
                data = str(n).encode()
                info = tarfile.TarInfo(f"s{n:03d}.cls")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    part = {"format": "python", "factory": "mixture_datasets:named"}
    return {
        "pics": {"format": "image-folder", "source": str(root / "images"), "size": 4},
        "toks": {"format": "tokens", "source": str(root / "tokens"), "seq_len": SEQ_LEN},
        "docs": {"format": "jsonl", "source": str(root / "jsonl"), "length_column": "ids",
                 "fields": {"ids": {"dtype": "int64", "shape": [-1]},
                            "label": {"dtype": "int64"}}},
        "docs_b": {"format": "jsonl", "source": str(root / "jsonl_b"), "length_column": "ids",
                   "fields": {"ids": {"dtype": "int64", "shape": [-1]},
                              "label": {"dtype": "int64"}}},
        "docmix": {"format": "mixture", "components": {"docs": 0.7, "docs_b": 0.3},
                   "samples_per_epoch": 150},
        "rows": {"format": "parquet", "source": str(root / "rows"), "fields": {"label": {}}},
        "shards": {"format": "tar", "source": str(root / "shards"),
                   "fields": {"cls": {"ext": "cls", "decode": "int"}}},
        "plain": {**part, "options": {"n": 48}},
        "a": {**part, "options": {"n": 30}},
        "b": {**part, "options": {"n": 17}},
        "mix": {"format": "mixture", "components": {"a": 0.6, "b": 0.4},
                "samples_per_epoch": 80},
    }
