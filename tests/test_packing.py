"""format: text: documents tokenized once, packed into rows; every row checked over whole
epochs against the tokenizer's own output, in this process and from real servers."""

from __future__ import annotations

import base64
import json
import multiprocessing as mp
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stoker.client import RemoteLoader
from stoker.server import Config, ConfigError, ServerProcess, load_config, write_config
from stoker.server.formats import open_dataset
from stoker.server.order.sampling import EpochKey

from conftest import server_env

pytestmark = pytest.mark.timeout(120)

SEQ = 64
IGNORE = -100
BYTE_BOS, BYTE_EOS, BYTE_PAD = 256, 257, 258
WORDS = ["the", "data", "server", "packs", "tokens", "into", "rows", "of", "text", "héllo",
         "日本語", "a", "GPU", "never", "waits", "<|endoftext|>"]


# -- data -------------------------------------------------------------------------------------
def make_texts(n: int, seed: int) -> list[str]:
    """Word salad with log-normal lengths: empty ones, short ones, and some longer than SEQ."""
    rng = np.random.default_rng(seed)
    words = rng.lognormal(np.log(6), 1.0, n).astype(int)
    words[rng.random(n) < 0.08] = 0
    return [" ".join(rng.choice(WORDS, w)) for w in words]


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> None:
    with open(path, "w") as f:
        for k, t in enumerate(texts):
            record: dict[str, Any] = {"id": k}
            node = record
            *parents, leaf = field.split(".")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = t
            f.write(json.dumps(record, ensure_ascii=k % 2 == 0) + ("\n\n" if k == 3 else "\n"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("text")
    (root / "docs").mkdir()
    a, b = make_texts(180, 1), make_texts(120, 2)
    write_jsonl(root / "docs" / "a.jsonl", a)
    write_jsonl(root / "docs" / "b.jsonl", b)
    return {"root": root, "source": str(root / "docs" / "*.jsonl"), "texts": a + b}


def open_text(source: str | Path, cache: Path, **cfg: Any) -> Any:
    config = Config.model_validate({"cache": {"dir": str(cache)}, "datasets": {"t": {
        "format": "text", "source": str(source), "seq_len": SEQ, **cfg}}})
    return open_dataset("t", config)


def byte_docs(texts: list[str], bos: bool = False, eos: bool = True) -> list[list[int]]:
    return [[BYTE_BOS] * bos + list(t.encode()) + [BYTE_EOS] * eos for t in texts if t]


# -- checking a whole epoch -------------------------------------------------------------------
def all_rows(ds: Any, key: EpochKey) -> dict[str, np.ndarray]:
    rows = [ds.sample(i, key) for i in range(len(ds))]
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def unpack(rows: dict[str, np.ndarray], pad_id: int) -> list[list[int]]:
    """The documents of an epoch, in stream order, rebuilt from rows in row order; checks
    every invariant of a packed row on the way."""
    ids, labels = rows["input_ids"], rows["labels"]
    pos, doc = rows["position_ids"], rows["document_ids"]
    assert ids.dtype == labels.dtype == pos.dtype == np.int64 and doc.dtype == np.int32
    n_rows, width = ids.shape
    docs: list[list[int]] = []
    current: list[int] | None = None  # a document running on from the previous row
    for k in range(n_rows):
        real = int(np.count_nonzero(doc[k] >= 0))
        assert (doc[k, :real] >= 0).all() and (doc[k, real:] == -1).all()
        if real < width:  # padding: the last row only, one segment of its own
            assert k == n_rows - 1
            assert (ids[k, real:] == pad_id).all() and (labels[k, real:] == IGNORE).all()
            assert np.array_equal(pos[k, real:], np.arange(width - real))
        seg = doc[k, :real]
        starts = [0, *(np.flatnonzero(np.diff(seg)) + 1).tolist()]
        ends = [*starts[1:], real]
        assert seg.tolist() == [s for s, (a, b) in enumerate(zip(starts, ends, strict=True))
                                for _ in range(b - a)]
        for s, (a, b) in enumerate(zip(starts, ends, strict=True)):
            assert np.array_equal(pos[k, a:b], np.arange(b - a))
            assert np.array_equal(labels[k, a : b - 1], ids[k, a + 1 : b])  # shifted by one
            tokens = ids[k, a:b].tolist()
            if s == 0 and current is not None:
                current += tokens
            else:
                assert current is None
                current = tokens
            if labels[k, b - 1] == IGNORE:  # the document ends here
                docs.append(current)
                current = None
            else:  # it runs on: only at the row's end, into the next row's first token
                assert b == width and k + 1 < n_rows
                assert labels[k, b - 1] == ids[k + 1, 0] and doc[k + 1, 0] == 0
    assert current is None
    return docs


def same_documents(got: list[list[int]], want: list[list[int]]) -> bool:
    return Counter(map(tuple, got)) == Counter(map(tuple, want))


# -- packing ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("bos", "eos", "shuffle"), [(False, True, True), (True, True, False),
                                                    (False, False, True)])
def test_every_token_of_every_document_once_per_epoch(corpus, tmp_path: Path, bos: bool,
                                                      eos: bool, shuffle: bool) -> None:
    ds = open_text(corpus["source"], tmp_path, bos=bos, eos=eos)
    want = byte_docs(corpus["texts"], bos, eos)
    total = sum(map(len, want))
    assert len(ds) == -(-total // SEQ) and ds.total_tokens == total
    assert ds.packing_efficiency == pytest.approx(total / (len(ds) * SEQ))
    assert ds.empty_documents == sum(not t for t in corpus["texts"])
    ends = np.cumsum([len(d) for d in want])
    starts = ends - [len(d) for d in want]
    assert ds.cut_fraction == pytest.approx(np.mean(starts // SEQ != (ends - 1) // SEQ))
    assert any(len(d) > SEQ for d in want) and ds.cut_fraction > 0
    got = unpack(all_rows(ds, EpochKey(3, 1, shuffle)), BYTE_PAD)
    assert same_documents(got, want)
    assert (got == want) == (not shuffle)  # shuffle=False: file order
    for d in got:
        if eos:
            assert d[-1] == BYTE_EOS and BYTE_EOS not in d[:-1]
        if bos:
            assert d[0] == BYTE_BOS and BYTE_BOS not in d[1:]


def test_long_documents_drop_leaves_out_exactly_the_long_ones(corpus, tmp_path: Path) -> None:
    ds = open_text(corpus["source"], tmp_path, long_documents="drop")
    want = byte_docs(corpus["texts"])
    short = [d for d in want if len(d) <= SEQ]
    assert ds.dropped_documents == len(want) - len(short) > 0
    got = unpack(all_rows(ds, EpochKey(0, 0, True)), BYTE_PAD)
    assert same_documents(got, short)
    assert ds.cut_fraction < 1


def test_the_plan_is_a_pure_function_of_seed_and_epoch(corpus, tmp_path: Path) -> None:
    one = open_text(corpus["source"], tmp_path / "one")  # two "servers", each tokenizing
    two = open_text(corpus["source"], tmp_path / "two")
    assert not one.cache_hit and not two.cache_hit and len(one) == len(two)
    a = all_rows(one, EpochKey(7, 2, True))
    b = all_rows(two, EpochKey(7, 2, True))
    assert all(np.array_equal(a[k], b[k]) for k in a)
    other = all_rows(one, EpochKey(7, 3, True))
    assert not np.array_equal(a["input_ids"], other["input_ids"])
    assert len(one) == len(other["input_ids"])  # every epoch has the same rows
    first = one[0]
    assert all(np.array_equal(first[k], one.sample(0, EpochKey())[k]) for k in first)
    assert one.source_of(0).startswith(f"row 0: {corpus['root'] / 'docs' / 'a.jsonl'} line ")
    assert one.objects_of(np.arange(3)) == []


# -- served for real --------------------------------------------------------------------------
def read_epochs(address: str, epochs: int) -> list[dict[str, np.ndarray]]:
    out = []
    with RemoteLoader(address, "corpus", batch_size=4, seed=11, shuffle=True, drop_last=False,
                      output="numpy", timeout=60) as loader:
        for _ in range(epochs):
            batches = list(loader)
            out.append({k: np.concatenate([b[k] for b in batches]) for k in batches[0]})
    return out


def test_served_rows_do_not_depend_on_the_number_of_workers(corpus, tmp_path: Path,
                                                            start_server) -> None:
    block = {"format": "text", "source": corpus["source"], "seq_len": SEQ}
    got = {}
    for workers in (1, 2):  # each with its own empty cache: the workers of 2 race to build
        env = {**server_env(), "XDG_CACHE_HOME": str(tmp_path / f"cache{workers}")}
        server = start_server({"corpus": block}, workers=workers, env=env)
        got[workers] = read_epochs(server.address, 2)
        built = list((tmp_path / f"cache{workers}" / "stoker" / "text").iterdir())
        assert len(built) == 4 and not [p for p in built if p.name.startswith(".tmp")]
    for e in range(2):
        assert got[1][e].keys() == got[2][e].keys()
        for k in got[1][e]:
            assert got[1][e][k].dtype == got[2][e][k].dtype
            assert np.array_equal(got[1][e][k], got[2][e][k]), (e, k)
    first, second = got[2]
    assert not np.array_equal(first["input_ids"], second["input_ids"])
    for epoch in (first, second):  # rows come shuffled: put them back in row order
        order = np.argsort(epoch["sample_index"])
        assert np.array_equal(epoch["sample_index"][order], np.arange(len(order)))
        rows = {k: v[order] for k, v in epoch.items() if k != "sample_index"}
        assert same_documents(unpack(rows, BYTE_PAD), byte_docs(corpus["texts"]))


def test_a_bad_record_stops_the_start_naming_dataset_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.jsonl").write_text('{"text": "fine"}\n\n{"text": 7}\n')
    config = write_config(tmp_path / "c.yaml", {"cache": {"dir": str(tmp_path / "cache")},
                                                "datasets": {"corpus": {
        "format": "text", "source": str(tmp_path / "d"), "seq_len": SEQ}}})
    with pytest.raises(RuntimeError) as info:
        ServerProcess(config, workers=2, env=server_env()).start()
    assert (f"dataset 'corpus': ValueError: {tmp_path / 'd' / 'a.jsonl'} line 3: field 'text': "
            "expected a string, got int") in str(info.value)


# -- tokenizers -------------------------------------------------------------------------------
def test_hugging_face_tokenizer_json(corpus, tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator(corpus["texts"], tokenizers.trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<pad>"], show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    eos, pad = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<pad>")
    ds = open_text(corpus["source"], tmp_path / "cache", tokenizer=str(tmp_path / "tokenizer.json"))
    assert (ds.eos_id, ds.pad_id, ds.bos_id) == (eos, pad, None)
    tok.encode_special_tokens = True  # a document's text is text, never a special token
    want = [[*ids, eos] for t in corpus["texts"]
            if (ids := tok.encode(t, add_special_tokens=False).ids)]
    got = unpack(all_rows(ds, EpochKey(1, 0, True)), pad)
    assert same_documents(got, want)
    assert all(eos not in d[:-1] for d in got)
    assert any("<|endoftext|>" in tok.decode(d[:-1]) for d in got)
    (tmp_path / "odd").mkdir()  # a lone surrogate: valid JSON, but no text HF encodes
    (tmp_path / "odd" / "a.jsonl").write_text('{"text": "fine"}\n{"text": "a\\ud800b"}\n')
    with pytest.raises(ValueError, match=r"a\.jsonl line 2: cannot tokenize: TypeError"):
        open_text(tmp_path / "odd", tmp_path / "c2", tokenizer=str(tmp_path / "tokenizer.json"))
    ds = open_text(tmp_path / "odd", tmp_path / "c3", tokenizer=str(tmp_path / "tokenizer.json"),
                   on_error="skip")
    assert ds.skipped_documents == 1 and ds.total_tokens == len(tok.encode("fine").ids) + 1


def write_tiktoken(path: Path) -> dict[bytes, int]:
    ranks = {bytes([b]): b for b in range(256)}
    for piece in [b"th", b"he", b"the", b" t", b" the", b"da", b"ta", b"data", b"in", b"to",
                  b"ro", b"ws", b"rows", b"er", b"ver", b"ser", b"serv", b"server"]:
        ranks[piece] = len(ranks)
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    return ranks


def test_tiktoken_file(corpus, tmp_path: Path) -> None:
    tiktoken = pytest.importorskip("tiktoken")
    ranks = write_tiktoken(tmp_path / "tiny.tiktoken")
    ds = open_text(corpus["source"], tmp_path / "cache", tokenizer=str(tmp_path / "tiny.tiktoken"),
                   bos=True, bos_id=500, eos_id=501)
    from stoker.server.formats.tokenizer import CL100K_PATTERN

    enc = tiktoken.Encoding("tiny", pat_str=CL100K_PATTERN, mergeable_ranks=ranks,
                            special_tokens={})
    want = [[500, *ids, 501] for t in corpus["texts"] if (ids := enc.encode_ordinary(t))]
    got = unpack(all_rows(ds, EpochKey(2, 5, True)), ds.pad_id)
    assert ds.pad_id == 501  # no pad token: the EOS
    assert same_documents(got, want)
    assert any(len(d) < len(enc.decode(d[1:-1]).encode()) + 2 for d in got)  # merges used
    assert sorted(enc.decode(d[1:-1]) for d in got) == sorted(t for t in corpus["texts"] if t)


def test_parquet_column_and_bad_records(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    texts = make_texts(50, 3)
    table = pa.table({"body": [*texts[:20], None, *texts[20:]], "n": list(range(51))})
    pq.write_table(table, tmp_path / "p.parquet", row_group_size=16)
    with pytest.raises(ValueError, match=r"p\.parquet row 20: field 'body': a null"):
        open_text(tmp_path / "p.parquet", tmp_path / "c1", field="body")
    ds = open_text(tmp_path / "p.parquet", tmp_path / "c2", field="body", on_error="skip")
    assert ds.skipped_documents == 1
    assert same_documents(unpack(all_rows(ds, EpochKey()), BYTE_PAD), byte_docs(texts))
    with pytest.raises(ValueError, match=r"field 'n': column is int64, expected strings"):
        open_text(tmp_path / "p.parquet", tmp_path / "c3", field="n")

    (tmp_path / "j").mkdir()
    write_jsonl(tmp_path / "j" / "a.jsonl", ["one", "two"], field="meta.body")
    with open(tmp_path / "j" / "a.jsonl", "a") as f:
        f.write('{"meta": {"other": 1}}\n{"meta": {"body": 7}}\n{"meta": {"body": "ok"}}\n')
    with pytest.raises(ValueError, match=r"a\.jsonl line 3: field 'meta\.body': no 'meta\.body'"):
        open_text(tmp_path / "j", tmp_path / "c4", field="meta.body")
    ds = open_text(tmp_path / "j", tmp_path / "c5", field="meta.body", on_error="skip")
    assert ds.skipped_documents == 2
    assert same_documents(unpack(all_rows(ds, EpochKey()), BYTE_PAD),
                          byte_docs(["one", "two", "ok"]))


# -- the tokenized-corpus cache ---------------------------------------------------------------
def built(cache: Path) -> dict[str, int]:
    return {p.name: p.stat().st_ino for p in (cache / "text").iterdir()}


def test_the_tokenized_corpus_is_reused_until_the_source_changes(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    texts = make_texts(40, 4)
    write_jsonl(tmp_path / "d" / "a.jsonl", texts)
    first = open_text(tmp_path / "d", tmp_path / "cache")
    files = built(tmp_path / "cache")
    assert not first.cache_hit and len(files) == 4
    again = open_text(tmp_path / "d", tmp_path / "cache", seq_len=32)  # packing is not cached
    assert again.cache_hit and built(tmp_path / "cache") == files  # same files, not rewritten
    assert len(again) == -(-first.total_tokens // 32)
    write_jsonl(tmp_path / "d" / "a.jsonl", [*texts, "a new document"])
    changed = open_text(tmp_path / "d", tmp_path / "cache")
    assert not changed.cache_hit and len(built(tmp_path / "cache")) == 8
    assert same_documents(unpack(all_rows(changed, EpochKey()), BYTE_PAD),
                          byte_docs([*texts, "a new document"]))
    eos_off = open_text(tmp_path / "d", tmp_path / "cache", eos=False)  # other ids: rebuilt
    assert not eos_off.cache_hit


def _open_in_child(source: str, cache: str, go: Any) -> bool:
    go.wait()
    return open_text(source, Path(cache)).cache_hit


def test_processes_opening_at_once_tokenize_once(corpus, tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    go = ctx.Manager().Event()
    with ctx.Pool(3) as pool:
        results = [pool.apply_async(_open_in_child, (corpus["source"], str(tmp_path), go))
                   for _ in range(3)]
        go.set()
        hits = [r.get(timeout=60) for r in results]
    assert sorted(hits) == [False, True, True]
    assert len(built(tmp_path)) == 4


# -- config -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("block", "expected"), [
    ({"tokenizer": "missing.json"}, ["datasets.a.text.tokenizer:", "tokenizer file not found"]),
    ({"tokenizer": "vocab.txt"}, ["datasets.a.text.tokenizer:", "'byte', a Hugging Face"]),
    ({"long_documents": "truncate"}, ["datasets.a.text.long_documents:", "'split' or 'drop'"]),
    ({"seq_len": 1}, ["datasets.a.text.seq_len:", "greater than or equal to 2"]),
    ({"tokenizer": "tok/tiny.tiktoken"}, ["eos_id is required with eos: true"]),
    ({"tokenizer": "tok/tiny.tiktoken", "eos_id": 5, "bos": True}, ["bos_id is required"]),
    ({"tiktoken_pattern": "x"}, ["tiktoken_pattern applies to a *.tiktoken tokenizer only"]),
    ({"shuffle": "block"}, ["datasets.a.text.shuffle:"]),
])
def test_config_errors_name_the_field(tmp_path: Path, block: dict[str, Any],
                                      expected: list[str]) -> None:
    (tmp_path / "tok").mkdir()
    write_tiktoken(tmp_path / "tok" / "tiny.tiktoken")
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({"datasets": {"a": {"format": "text", "source": ".",
                                                     "seq_len": 8, **block}}}))
    with pytest.raises(ConfigError) as info:
        load_config(config)
    for part in expected:
        assert part in str(info.value)


def test_tokenizer_paths_are_relative_to_the_config_file(tmp_path: Path) -> None:
    (tmp_path / "tok").mkdir()
    write_tiktoken(tmp_path / "tok" / "tiny.tiktoken")
    config = tmp_path / "c.yaml"
    config.write_text("datasets: {a: {format: text, source: ., seq_len: 8, "
                      "tokenizer: tok/tiny.tiktoken, eos_id: 300}}")
    cfg = load_config(config).datasets["a"]
    assert cfg.tokenizer == str(tmp_path / "tok" / "tiny.tiktoken")
    assert load_config(config).datasets["a"].long_documents == "split"


# -- the client's attention helpers -----------------------------------------------------------
def test_cu_seqlens_and_block_causal_mask_by_hand() -> None:
    torch = pytest.importorskip("torch")
    from stoker.client.packing import block_causal_mask, cu_seqlens

    # Row 0: a document running on from before (3 tokens), one of 2, one of 1.
    # Row 1: one of 2, one of 2, then 2 padding.
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 0, 1, 0, 1]])
    document_ids = torch.tensor([[0, 0, 0, 1, 1, 2], [0, 0, 1, 1, -1, -1]], dtype=torch.int32)
    cu = cu_seqlens(position_ids)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 5, 6, 8, 10, 12]
    mask = block_causal_mask(document_ids)
    assert mask.dtype == torch.bool and mask.shape == (2, 6, 6)
    want = torch.zeros(2, 6, 6, dtype=torch.bool)
    for b, spans in enumerate([[(0, 3), (3, 5), (5, 6)], [(0, 2), (2, 4), (4, 6)]]):
        for a, e in spans:
            for q in range(a, e):
                want[b, q, a : q + 1] = True
    assert torch.equal(mask, want)
    assert mask.any(dim=-1).all()  # every query attends to something (itself at least)
    assert cu_seqlens(torch.zeros(0, 4, dtype=torch.int64)).tolist() == [0]
