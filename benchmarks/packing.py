"""Packed text rows (`format: text`) delivered to a RemoteLoader, against pre-tokenized windows.

    python benchmarks/packing.py                  # 24k documents, seq_len 2048, 5 repeats
    python benchmarks/packing.py --quick          # smoke test, well under a minute
    python benchmarks/packing.py --json out.json

The corpus is generated (nothing is downloaded): documents of words drawn from a Zipf-like
vocabulary of made-up words, their lengths in words log-normal (median 300, sigma 1, so a
few percent run past seq_len), written as JSON lines. The tokenizer is a byte-level BPE
trained on the corpus with Hugging Face `tokenizers` (vocabulary 8192; `--tokenizer byte`
for the built-in one), so a word is about a token.

Measured, in this order:
- tokenization at open: `Text` opened in this process with an empty cache folder (parse,
  tokenize and write the corpus), then again (map the cached corpus); the peer is the
  tokenizer alone on the same texts (parsed beforehand, one `encode_batch` call, ids kept
  as Python lists): what any pipeline pays to tokenize;
- server start: `stoker serve` with an empty cache (its workers tokenize once, the others
  wait) and with the warm one;
- delivery, per repeat one shuffled epoch (epoch = repeat) through `RemoteLoader(output=
  "numpy")` from a server with `--workers` workers: rows/s, tokens/s (row slots) and real
  tokens/s (not padding) after the first batch, which is timed apart. The peer, measured in
  the same repeat (the order alternates): `format: tokens` serving the same token stream
  (the corpus in file order, as one flat .bin) in windows of the same seq_len, the same
  batch size: the cost of serving tokens with no packing at all. Medians over repeats;
- packing efficiency (real tokens / row slots, the same every epoch) and the share of
  documents cut across rows.

Every epoch is checked: every row once, and exactly the corpus's token count delivered as
real tokens (document_ids >= 0).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _measure import machine_info, run_scenario, scenario_parser, summarise

from stoker.client import RemoteLoader
from stoker.server import Config, ServerProcess, write_config
from stoker.server.formats import open_dataset

FULL = {"documents": 24000, "seq_len": 2048, "batch_size": 8, "repeats": 5}
QUICK = {"documents": 1500, "seq_len": 512, "batch_size": 8, "repeats": 1}
MEDIAN_WORDS, SIGMA, VOCAB_WORDS = 300, 1.0, 4000


# -- the corpus ------------------------------------------------------------------------------
def make_corpus(path: Path, documents: int, seed: int = 0) -> dict[str, Any]:
    """JSON lines {"text": ...}; deterministic in (documents, seed)."""
    import json

    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocab = ["".join(rng.choice(letters, int(n))) for n in rng.integers(2, 11, VOCAB_WORDS)]
    p = 1 / np.arange(1, VOCAB_WORDS + 1) ** 1.1
    words = np.minimum(rng.lognormal(np.log(MEDIAN_WORDS), SIGMA, documents), 30000
                       ).astype(np.int64) + 1
    picks = rng.choice(VOCAB_WORDS, int(words.sum()), p=p / p.sum())
    ends = np.cumsum(words)
    with open(path, "w") as f:
        for end, n in zip(ends, words, strict=True):
            text = " ".join(vocab[w] for w in picks[end - n : end])
            f.write(json.dumps({"text": text}) + "\n")
    return {"documents": documents, "words": int(words.sum()), "bytes": path.stat().st_size,
            "median_words": float(np.median(words))}


def train_bpe(corpus: Path, out: Path, vocab_size: int = 8192) -> None:
    import itertools
    import json

    import tokenizers

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    with open(corpus) as f:
        texts = [json.loads(line)["text"] for line in itertools.islice(f, 2000)]
    tok.train_from_iterator(texts, tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(out))


# -- runs ------------------------------------------------------------------------------------
def tokenize_alone(corpus: Path, tokenizer: str) -> dict[str, float]:
    """Seconds the tokenizer itself takes for every document, and the tokens it gives."""
    import json

    with open(corpus) as f:
        texts = [json.loads(line)["text"] for line in f]
    t0 = time.perf_counter()
    if tokenizer == "byte":
        n = sum(len(t.encode()) for t in texts)
    else:
        import tokenizers

        tok = tokenizers.Tokenizer.from_file(tokenizer)
        n = sum(len(e.ids) for e in tok.encode_batch_fast(texts, add_special_tokens=False))
    return {"seconds": time.perf_counter() - t0, "tokens": n}


def text_block(p: dict[str, Any], source: Path, tokenizer: str) -> dict[str, Any]:
    return {"format": "text", "source": str(source), "tokenizer": tokenizer,
            "seq_len": p["seq_len"]}


def open_in_process(block: dict[str, Any], cache: Path) -> tuple[Any, float]:
    config = Config.model_validate({"cache": {"dir": str(cache)}, "datasets": {"d": block}})
    t0 = time.perf_counter()
    ds = open_dataset("d", config)
    return ds, time.perf_counter() - t0


def start(work: Path, name: str, block: dict[str, Any], cache: Path, workers: int
          ) -> tuple[ServerProcess, float]:
    config = write_config(work / f"{name}.yaml", {"cache": {"dir": str(cache)},
                                                  "datasets": {"d": block}})
    t0 = time.perf_counter()
    server = ServerProcess(config, workers=workers).start(timeout=600)
    return server, time.perf_counter() - t0


def read_epoch(server: ServerProcess, p: dict[str, Any], epoch: int, rows: int,
               real_tokens: int | None, problems: list[str], what: str) -> dict[str, Any]:
    with RemoteLoader(server.address, "d", batch_size=p["batch_size"], shuffle=True, seed=1,
                      drop_last=False, output="numpy", timeout=300) as loader:
        loader.set_epoch(epoch)
        t0 = time.perf_counter()
        it = iter(loader)
        first = next(it)
        t1 = time.perf_counter()
        seen = [first["sample_index"]]
        real = int(np.count_nonzero(first["document_ids"] >= 0)) if real_tokens else 0
        nbytes = sum(a.nbytes for a in first.values())
        timed_rows = timed_bytes = timed_real = 0
        for batch in it:
            seen.append(batch["sample_index"])
            n = len(batch["sample_index"])
            timed_rows += n
            timed_bytes += sum(a.nbytes for a in batch.values())
            if real_tokens:
                r = int(np.count_nonzero(batch["document_ids"] >= 0))
                timed_real += r
                real += r
        t2 = time.perf_counter()
    nbytes += timed_bytes
    index = np.sort(np.concatenate(seen))
    if not np.array_equal(index, np.arange(rows)):
        problems.append(f"{what} epoch {epoch}: rows delivered are not each row once")
    if real_tokens and real != real_tokens:
        problems.append(f"{what} epoch {epoch}: {real} real tokens delivered, the corpus has "
                        f"{real_tokens}")
    wall = t2 - t1
    slots = timed_rows * p["seq_len"]
    return {"first_batch_s": t1 - t0, "epoch_s": t2 - t0, "rows": rows,
            "payload_bytes": nbytes, "rows_per_s": timed_rows / wall,
            "tokens_per_s": slots / wall,
            "real_tokens_per_s": (timed_real if real_tokens else slots) / wall,
            "mb_per_s": timed_bytes / wall / 1e6}


def run(args: argparse.Namespace) -> dict[str, Any]:
    p = dict(QUICK if args.quick else FULL)
    for k in ("documents", "seq_len", "repeats"):
        if getattr(args, k):
            p[k] = getattr(args, k)
    problems: list[str] = []
    res: dict[str, Any] = {"params": {**p, "workers": args.workers, "tokenizer": args.tokenizer},
                           "check_problems": problems, "server_exit_code": 0,
                           "machine": machine_info(numpy=np.__version__)}
    with tempfile.TemporaryDirectory(prefix="stoker-bench-") as tmp:
        work = Path(tmp)
        (work / "docs").mkdir()
        t0 = time.perf_counter()
        res["corpus"] = make_corpus(work / "docs" / "corpus.jsonl", p["documents"])
        tokenizer = "byte"
        if args.tokenizer == "bpe":
            train_bpe(work / "docs" / "corpus.jsonl", work / "tokenizer.json")
            tokenizer = str(work / "tokenizer.json")
        res["corpus"]["generate_s"] = time.perf_counter() - t0
        block = text_block(p, work / "docs" / "corpus.jsonl", tokenizer)

        alone = tokenize_alone(work / "docs" / "corpus.jsonl", tokenizer)
        ds, cold = open_in_process(block, work / "cache-local")
        _, warm = open_in_process(block, work / "cache-local")
        lengths = np.diff(np.asarray(ds.offsets))
        res["corpus"].update({
            "tokens": ds.total_tokens, "median_doc_tokens": float(np.median(lengths)),
            "p99_doc_tokens": float(np.percentile(lengths, 99)),
            "docs_longer_than_seq_len": int(np.count_nonzero(lengths > p["seq_len"]))})
        res["tokenize"] = {"cold_open_s": cold, "warm_open_s": warm,
                           "tokens_per_s": ds.total_tokens / cold,
                           "tokenizer_alone_s": alone["seconds"],
                           "ratio_open_over_tokenizer_alone": cold / alone["seconds"]}
        res["packing"] = {"rows": len(ds), "packing_efficiency": ds.packing_efficiency,
                          "cut_fraction": ds.cut_fraction,
                          "padding_tokens": len(ds) * p["seq_len"] - ds.total_tokens}
        flat = np.asarray(ds.tokens)
        (work / "flat").mkdir()
        flat.tofile(work / "flat" / "corpus.bin")
        peer = {"format": "tokens", "source": str(work / "flat" / "corpus.bin*"),
                "seq_len": p["seq_len"], "dtype": flat.dtype.name}
        peer_rows = (len(flat) - 1) // p["seq_len"]
        text_rows, real = len(ds), ds.total_tokens
        del ds, flat

        server, cold_start = start(work, "cold", block, work / "cache-server", args.workers)
        res["server_exit_code"] = server.stop()
        runs: dict[str, list[dict[str, Any]]] = {"text": [], "tokens": []}
        starts: dict[str, list[float]] = {"text": [], "tokens": []}
        servers = {}
        try:
            servers["text"], s = start(work, "text", block, work / "cache-server", args.workers)
            starts["text"].append(s)
            servers["tokens"], s = start(work, "tokens", peer, work / "cache-server",
                                         args.workers)
            starts["tokens"].append(s)
            for rep in range(p["repeats"]):
                for what in (("text", "tokens") if rep % 2 == 0 else ("tokens", "text")):
                    runs[what].append(read_epoch(
                        servers[what], p, rep, text_rows if what == "text" else peer_rows,
                        real if what == "text" else None, problems, what))
        finally:
            for srv in servers.values():
                code = srv.stop()
                res["server_exit_code"] = res["server_exit_code"] or code
        res["server_start"] = {"cold_s": cold_start, "warm_s": starts["text"][0],
                               "tokens_peer_s": starts["tokens"][0]}
        res["systems"] = {what: {"repeats": reps, **{k: summarise([x[k] for x in reps]) for k in (
            "rows_per_s", "tokens_per_s", "real_tokens_per_s", "mb_per_s", "first_batch_s")}}
            for what, reps in runs.items()}
        t, k = res["systems"]["text"], res["systems"]["tokens"]
        res["ratio_text_over_tokens"] = {
            m: t[m]["median"] / k[m]["median"] for m in ("rows_per_s", "real_tokens_per_s")}
    return res


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = scenario_parser(__doc__)
    ap.add_argument("--documents", type=int, default=0)
    ap.add_argument("--seq-len", dest="seq_len", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--tokenizer", choices=["bpe", "byte"], default="bpe")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return run_scenario(parse_args(argv), run)


if __name__ == "__main__":
    sys.exit(main())
