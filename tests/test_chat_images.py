"""format: chat with images: image parts expanded to blocks of image tokens, the images
decoded and transformed on the server; checked against the image pipeline, in this process
and from real servers with 1 and 2 workers."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from chat_data import conversations, corpus_texts, make_tokenizer
from PIL import Image

from stoker.client import RemoteError, RemoteLoader
from stoker.server import Config
from stoker.server.formats import open_dataset
from stoker.server.images import image_pipeline
from stoker.server.order.sampling import EpochKey
from stoker.server.sources.storage import StorageError

pytestmark = pytest.mark.timeout(180)
BLOCK = 4  # image tokens per image
VLM = (
    "{% macro show(content) %}{% if content is string %}{{ content }}{% else %}"
    "{% for part in content %}{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{% endmacro %}"
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ show(message['content']) + '<|im_end|>\\n' }}{% endgeneration %}"
    "{% else %}{{ show(message['content']) + '<|im_end|>\\n' }}{% endif %}{% endfor %}")
IMAGES = {"token": "<image>", "tokens": BLOCK, "transforms": [
    {"random_resized_crop": {"size": 8}}, {"horizontal_flip": None}]}


def png(rng: np.random.Generator) -> bytes:
    out = io.BytesIO()
    h, w = (int(x) for x in rng.integers(12, 40, 2))
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """60 conversations: user turns with 0 to 3 images (paths in the parts, or in an images
    column), in a .jsonl file; 20 more with image bytes in a .parquet file."""
    root = tmp_path_factory.mktemp("vlm")
    rng = np.random.default_rng(0)
    convs = conversations(80, seed=5, mean_words=8)
    tok = make_tokenizer(root / "tok", corpus_texts(convs), template=VLM)
    (root / "data" / "img").mkdir(parents=True)
    records, images = [], []  # images: each conversation's image bytes, in order
    for k, conv in enumerate(convs):
        mine, column = [], []
        for m in conv:
            if m["role"] != "user":
                continue
            parts: list[dict[str, Any]] = []  # the images first, in order, then the text
            for _ in range(int(rng.integers(0, 3)) if k % 5 else 0):
                data = png(rng)
                mine.append(data)
                if k >= 60:  # parquet: the bytes in the column
                    column.append(data)
                    parts.append({"type": "image"})
                elif k % 2:  # a path in the part
                    (root / "data" / "img" / f"{len(images)}-{len(mine)}.png").write_bytes(data)
                    parts.append({"type": "image",
                                  "image": f"img/{len(images)}-{len(mine)}.png"})
                else:  # a path in the images column
                    (root / "data" / "img" / f"{len(images)}-{len(mine)}.png").write_bytes(data)
                    column.append(f"img/{len(images)}-{len(mine)}.png")
                    parts.append({"type": "image"})
            m["content"] = [*parts, {"type": "text", "text": m["content"]}]
        records.append({"messages": conv, "images": column})
        images.append(mine)
    with open(root / "data" / "a.jsonl", "w") as f:
        for r in records[:60]:
            f.write(json.dumps(r) + "\n")
    for r in records[60:]:  # parquet: every content a list of parts (one struct type)
        for m in r["messages"]:
            if isinstance(m["content"], str):
                m["content"] = [{"type": "text", "text": m["content"]}]
    pq.write_table(pa.Table.from_pylist(records[60:]), root / "data" / "b.parquet")
    return {"root": root, "tok": tok, "images": images, "source": str(root / "data")}


def open_vlm(vlm: dict[str, Any], cache: Path, **cfg: Any) -> Any:
    block = {"format": "chat", "source": vlm["source"], "tokenizer": str(vlm["tok"]),
             "seq_len": 512, "images": {**IMAGES, "column": "images"}, **cfg}
    config = Config.model_validate({"cache": {"dir": str(cache)}, "datasets": {"c": block}})
    return open_dataset("c", config), config.datasets["c"]


def block_starts(ids: np.ndarray, token: int) -> list[int]:
    """Where each block of BLOCK image tokens starts (adjacent images: a run of blocks)."""
    at = np.flatnonzero(ids == token)
    runs = [int(a) for a in at if a == 0 or ids[a - 1] != token]
    out = []
    for start in runs:
        end = start
        while end < len(ids) and ids[end] == token:
            end += 1
        assert (end - start) % BLOCK == 0
        out += range(start, end, BLOCK)
    return out


def test_unpacked_rows_hold_each_image_where_image_positions_says(vlm, tmp_path: Path) -> None:
    ds, cfg = open_vlm(vlm, tmp_path, pack=False)
    token = ds.tokenizer.token_to_id("<image>")
    pipeline = image_pipeline(cfg.images)
    key = EpochKey(3, 1, True)
    assert len(ds) == 80 and sum(map(len, vlm["images"])) > 40
    for i, mine in enumerate(vlm["images"]):
        row = ds.sample(i, key)
        positions = row["image_positions"].tolist()
        assert int(row["image_counts"]) == len(mine) == len(positions)
        assert block_starts(row["input_ids"], token) == positions
        for p in positions:
            assert (row["input_ids"][p : p + BLOCK] == token).all()
        assert int((row["input_ids"] == token).sum()) == BLOCK * len(mine)
        assert not (row["labels"] == token).any()  # never trained on
        rng = key.rng(i)  # the row's generator, drawn in image order
        want = [pipeline(data, rng) for data in mine]
        assert row["pixel_values"].shape == (len(mine), 3, 8, 8)
        assert all(np.array_equal(a, b) for a, b in zip(row["pixel_values"], want, strict=True))
    other = ds.sample(7, EpochKey(3, 2, True))["pixel_values"]  # another epoch, other crops
    assert not np.array_equal(other, ds.sample(7, key)["pixel_values"])


def test_packed_rows_count_image_tokens_and_keep_blocks_whole(vlm, tmp_path: Path) -> None:
    ds, _ = open_vlm(vlm, tmp_path, seq_len=256)
    token = ds.tokenizer.token_to_id("<image>")
    seen = 0
    for i in range(len(ds)):
        row = ds.sample(i, EpochKey(0, 0, True))
        positions = row["image_positions"].tolist()
        assert block_starts(row["input_ids"], token) == positions
        assert int((row["input_ids"] == token).sum()) == BLOCK * len(positions)
        for p in positions:  # a block sits inside one conversation
            assert len(set(row["document_ids"][p : p + BLOCK].tolist())) == 1
        seen += len(positions)
    whole, _ = open_vlm(vlm, tmp_path / "whole", pack=False, seq_len=4096)
    lengths = [int(whole[k]["attention_mask"].sum()) for k in range(len(whole))]
    kept = [mine for mine, n in zip(vlm["images"], lengths, strict=True) if n <= 256]
    assert ds.long_with_images == sum(1 for mine, n in zip(vlm["images"], lengths, strict=True)
                                      if n > 256 and mine) > 0  # left out whole
    assert seen == sum(map(len, kept)) > 0
    assert ds.packing_efficiency > 0.9 and len(ds) < 80


def test_a_mismatch_and_a_missing_image_name_the_record(vlm, tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    two = [{"type": "image", "image": "nowhere.png"}, {"type": "text", "text": "hi"}]
    lines = [{"messages": [{"role": "user", "content": two},
                           {"role": "assistant", "content": "a"}]},
             {"messages": [{"role": "user", "content": "no parts"}], "images": ["x.png"]}]
    (tmp_path / "d" / "a.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    ds, _ = open_vlm({**vlm, "source": str(tmp_path / "d")}, tmp_path / "c")
    with pytest.raises(ValueError, match="line 2: the images column holds 1 image"):
        ds[1]
    with pytest.raises(StorageError, match=r"d/nowhere\.png: No such file"):
        ds[0]


def test_served_batches_are_the_same_from_1_and_2_workers(vlm, tmp_path: Path,
                                                          start_server) -> None:
    block = {"format": "chat", "source": vlm["source"], "tokenizer": str(vlm["tok"]),
             "seq_len": 256, "images": {**IMAGES, "column": "images"}}
    got = []
    for workers in (1, 2):
        server = start_server({"vlm": block}, workers=workers)
        with RemoteLoader(server.address, "vlm", batch_size=3, seed=4, shuffle=True,
                          drop_last=False, output="numpy", timeout=60) as ld:
            got.append(list(ld))
    assert len(got[0]) == len(got[1]) > 3
    for a, b in zip(*got, strict=True):
        assert a.keys() == b.keys() >= {"pixel_values", "image_positions", "image_counts"}
        for k in a:
            assert np.array_equal(a[k], b[k]), k
        b, k = len(a["image_counts"]), int(a["image_counts"].max())
        total = int(a["image_counts"].sum())  # the loader hands out the images flat
        assert a["pixel_values"].shape == (total, 3, 8, 8) and a["image_positions"].shape == (b, k)
    # Row 1's image is missing (row 0 is read at start: a server whose first row fails
    # does not start, as for any dataset).
    bad = {**block, "source": str(tmp_path / "bad"), "pack": False}
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "a.jsonl").write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}, *image]},
        {"role": "assistant", "content": "a"}]}) + "\n"
        for image in ([], [{"type": "image", "image": "gone.png"}])))
    server = start_server({"bad": bad}, workers=1)
    with RemoteLoader(server.address, "bad", batch_size=1, shuffle=False, output="numpy",
                      timeout=60) as ld:
        assert int(ld.batch_at(0, 0)["image_counts"][0]) == 0
        with pytest.raises(RemoteError) as info:
            ld.batch_at(0, 1)
    assert info.value.code == grpc.StatusCode.DATA_LOSS
    assert "a.jsonl line 2 tokens 0.." in str(info.value) and "gone.png" in str(info.value)


def test_patch_sets_the_block_from_the_image_size(vlm, tmp_path: Path) -> None:
    by_patch, _ = open_vlm(vlm, tmp_path / "p", pack=False, images={
        "token": "<image>", "patch": 4, "size": 8, "column": "images"})  # (8/4)^2 = 4 tokens
    by_count, _ = open_vlm(vlm, tmp_path / "c", pack=False, images={
        "token": "<image>", "tokens": 4, "size": 8, "column": "images"})
    assert by_patch.image_tokens == 4
    for i in (1, 2, 3):
        assert np.array_equal(by_patch[i]["input_ids"], by_count[i]["input_ids"])
        assert np.array_equal(by_patch[i]["pixel_values"], by_count[i]["pixel_values"])
    with pytest.raises(ValueError, match=r"images.token '<img>' is not a token"):
        open_vlm(vlm, tmp_path / "x", images={"token": "<img>", "tokens": 2, "size": 8})
