"""A small GPT trained on packed text: documents tokenized and packed by a data server.

    python examples/gpt.py [--steps 300] [--seq-len 128] [--batch-size 16] [--workers 1]
    python examples/gpt.py --mixture 0.7   # two sources, drawn 70/30 (docs/mixtures.md)

Writes a corpus of made-up documents (JSON lines), starts `stoker serve` with `format: text`
(byte tokenizer, EOS after each document, rows of seq_len), and trains a 2-layer decoder
from RemoteLoader (on CUDA when there is a GPU: `device="cuda"`, batches pinned and copied
without blocking; it says which device it used). Each row holds several documents:
attention is block-causal (`stoker.client.packing.block_causal_mask` over `document_ids`),
positions restart with every document (`position_ids`), and labels are -100 where the next
token belongs to another document. With `--mixture W` it writes a second corpus (other
words: another source) and trains from `format: mixture` over the two, the first drawn with
weight W, and prints the share of rows each source gave. Exits non-zero if the loss did not
fall (the last 20 steps' mean >= 0.7 x the first 20 steps') or the server did not shut down
cleanly.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from stoker.client import RemoteLoader
from stoker.client.packing import block_causal_mask
from stoker.server import ServerProcess, write_config

VOCAB = 259  # the byte tokenizer: 256 bytes, BOS 256, EOS 257, PAD 258
LOSS_RATIO = 0.7


def text_dataset(source: Path, seq_len: int) -> dict:
    return {"format": "text", "source": str(source), "field": "text", "tokenizer": "byte",
            "seq_len": seq_len, "eos": True}


def make_corpus(path: Path, documents: int, seed: int = 0) -> None:
    """Documents of words from a small Zipf-distributed vocabulary: spelling is learnable,
    so a byte model's loss falls quickly. Lengths vary (some longer than a row)."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgk"))
    words = ["".join(rng.choice(letters, size=rng.integers(2, 8))) for _ in range(300)]
    weights = 1.0 / np.arange(1, len(words) + 1)
    weights /= weights.sum()
    with open(path, "w") as f:
        for _ in range(documents):
            n = int(rng.lognormal(3.0, 0.8)) + 1
            text = " ".join(rng.choice(words, size=n, p=weights)) + "."
            f.write(json.dumps({"text": text.capitalize()}) + "\n")


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), attn_mask=mask[:, None])
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, seq_len: int, d: int = 128, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d)
        self.pos = nn.Embedding(seq_len, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.head = nn.Linear(d, VOCAB)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor,
                documents: torch.Tensor) -> torch.Tensor:
        mask = block_causal_mask(documents)  # a token sees its own document's past only
        x = self.tok(ids) + self.pos(positions)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x)


def train(address: str, args: argparse.Namespace) -> tuple[list[float], dict]:
    torch.manual_seed(args.seed)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    print(f"training on {device}" + (f" ({torch.cuda.get_device_name(0)})" if cuda else ""),
          flush=True)
    model = TinyGPT(args.seq_len).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses: list[float] = []
    sources = torch.zeros(2, dtype=torch.int64)  # rows of each source (--mixture)
    with RemoteLoader(address, "mix" if args.mixture else "corpus", batch_size=args.batch_size,
                      seed=args.seed, prefetch=8, timeout=120,
                      **({"device": device} if cuda else {})) as loader:
        while len(losses) < args.steps:
            for batch in loader:
                logits = model(batch["input_ids"], batch["position_ids"], batch["document_ids"])
                loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1),
                                       ignore_index=-100)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(loss.item())
                if args.mixture:
                    sources += torch.bincount(batch["source"], minlength=2).cpu()
                if len(losses) % args.log_every == 0:
                    print(f"step {len(losses):4d}  loss {losses[-1]:.3f}", flush=True)
                if len(losses) >= args.steps:
                    break
        stats = loader.stats()
    if args.mixture:
        share = (sources / sources.sum()).tolist()
        print(f"rows by source: corpus {share[0]:.1%}, other {share[1]:.1%} (weights "
              f"{args.mixture:g} and {1 - args.mixture:g})", flush=True)
    return losses, stats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--documents", type=int, default=3000)
    p.add_argument("--workers", type=int, default=1, help="data server worker processes")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--mixture", type=float, default=None, metavar="W",
                   help="train from a mixture of two corpora, the first with weight W (0..1)")
    args = p.parse_args(argv)
    if args.mixture is not None and not 0 < args.mixture < 1:
        p.error("--mixture takes the first corpus's weight, between 0 and 1")
    if args.steps < 40:
        p.error("--steps must be >= 40 (the loss check compares the first and last 20)")
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) - args.workers))
    with tempfile.TemporaryDirectory(prefix="stoker-gpt-") as tmp:
        corpus = Path(tmp) / "corpus"
        corpus.mkdir()
        make_corpus(corpus / "docs.jsonl", args.documents, args.seed)
        datasets = {"corpus": text_dataset(corpus, args.seq_len)}
        if args.mixture:  # another source (another vocabulary), and the mixture of the two
            other = Path(tmp) / "other"
            other.mkdir()
            make_corpus(other / "docs.jsonl", args.documents // 2, args.seed + 1)
            datasets["other"] = text_dataset(other, args.seq_len)
            datasets["mix"] = {"format": "mixture", "components": {
                "corpus": args.mixture, "other": 1 - args.mixture}}
        config = write_config(Path(tmp) / "stoker.yaml", {
            "cache": {"dir": str(Path(tmp) / "cache")}, "datasets": datasets})
        t0 = time.perf_counter()
        with ServerProcess(config, workers=args.workers) as server:
            print(f"data server ready at {server.address} ({time.perf_counter() - t0:.1f}s, "
                  "corpus tokenized and packed there)")
            losses, stats = train(server.address, args)
            code = server.stop()
    first, last = np.mean(losses[:20]), np.mean(losses[-20:])
    print(f"loss: first 20 steps {first:.3f}, last 20 {last:.3f}; waited for data "
          f"{stats['wait_seconds']:.2f}s ({stats['stall']:.1%} of the loop); server exit {code}")
    if code != 0:
        print("FAILED: the server did not shut down cleanly", file=sys.stderr)
        return 1
    if last >= LOSS_RATIO * first:
        print(f"FAILED: the loss did not fall below {LOSS_RATIO} x its start", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
