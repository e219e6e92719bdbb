"""Tiny datasets of several formats, written to a folder, for tests/test_determinism*.py:
image-folder, tokens, jsonl (with token lengths), a `format: python` dataset of 48 samples
(`plain`) and a mixture of `format: python` components."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np

JSONL_ROWS = (0, 30, 64)  # two files: rows [0, 30) and [30, 64)
SEQ_LEN = 8
TOKEN_FILES = (97, 130)  # tokens in each .bin file (uint16)


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
    part = {"format": "python", "factory": "mixture_datasets:named"}
    return {
        "pics": {"format": "image-folder", "source": str(root / "images"), "size": 4},
        "toks": {"format": "tokens", "source": str(root / "tokens"), "seq_len": SEQ_LEN},
        "docs": {"format": "jsonl", "source": str(root / "jsonl"), "length_column": "ids",
                 "fields": {"ids": {"dtype": "int64", "shape": [-1]},
                            "label": {"dtype": "int64"}}},
        "plain": {**part, "options": {"n": 48}},
        "a": {**part, "options": {"n": 30}},
        "b": {**part, "options": {"n": 17}},
        "mix": {"format": "mixture", "components": {"a": 0.6, "b": 0.4},
                "samples_per_epoch": 80},
    }
