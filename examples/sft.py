"""Supervised fine-tuning on conversations: rendered, masked and packed by a data server.

    python examples/sft.py [--steps 200] [--seq-len 256] [--batch-size 8] [--workers 1]

Writes a file of made-up conversations (JSON lines, `{"messages": [{role, content}, ...]}`:
a system prompt, then turns of a user asking for a sum and an assistant answering it),
trains a byte-level BPE tokenizer on them with Hugging Face `tokenizers` and saves it as a
`tokenizer.json` with a `tokenizer_config.json` holding a ChatML chat template with
`{% generation %}` markers, as a model on the Hub ships them. It starts `stoker serve` with
`format: chat`: the server renders every conversation through the template, tokenizes it,
masks it (loss on the assistant's turns only) and packs whole conversations into rows of
seq_len. A 2-layer decoder (examples/gpt.py's blocks) trains from RemoteLoader with
block-causal attention over `document_ids`; the loss is cross entropy over `labels`, which
are -100 everywhere but where the next token is the assistant's. Exits non-zero if the loss
did not fall (the last 20 steps' mean >= 0.7 x the first 20 steps') or the server did not
shut down cleanly.
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
from gpt import Block  # examples/gpt.py: a pre-norm transformer block over an attention mask
from torch import nn

from stoker.client import RemoteLoader
from stoker.client.packing import block_causal_mask
from stoker.server import ServerProcess, write_config

LOSS_RATIO = 0.7
CHATML = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>\\n' }}"
    "{% endgeneration %}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def make_conversations(path: Path, count: int, seed: int) -> list[str]:
    """Conversations of 1 to 4 sums each; returns every message's text (for the tokenizer)."""
    rng = np.random.default_rng(seed)
    texts = []
    with open(path, "w") as f:
        for _ in range(count):
            messages = [{"role": "system", "content": "You add numbers."}]
            for _turn in range(int(rng.integers(1, 5))):
                a, b = (int(x) for x in rng.integers(0, 50, 2))
                messages += [{"role": "user", "content": f"What is {a} plus {b}?"},
                             {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]
            texts += [m["content"] for m in messages]
            f.write(json.dumps({"messages": messages}) + "\n")
    return texts


def make_tokenizer(folder: Path, texts: list[str]) -> tuple[Path, int]:
    """A tokenizer.json and its tokenizer_config.json; returns the file and the vocab size."""
    import tokenizers

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator(texts, tokenizers.trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"],
        show_progress=False, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHATML, "eos_token": "<|im_end|>", "pad_token": "<pad>"}))
    return folder / "tokenizer.json", tok.get_vocab_size()


class TinyLM(nn.Module):
    def __init__(self, vocab: int, seq_len: int, d: int = 128, heads: int = 4,
                 layers: int = 2) -> None:
        super().__init__()
        self.vocab = vocab
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq_len, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor,
                documents: torch.Tensor) -> torch.Tensor:
        mask = block_causal_mask(documents)  # a token sees its own conversation's past only
        x = self.tok(ids) + self.pos(positions)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x)


def train(address: str, vocab: int, args: argparse.Namespace) -> tuple[list[float], dict]:
    torch.manual_seed(args.seed)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    print(f"training on {device}", flush=True)
    model = TinyLM(vocab, args.seq_len).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses: list[float] = []
    with RemoteLoader(address, "sft", batch_size=args.batch_size, seed=args.seed, prefetch=8,
                      timeout=120, **({"device": device} if cuda else {})) as loader:
        while len(losses) < args.steps:
            for batch in loader:
                logits = model(batch["input_ids"], batch["position_ids"], batch["document_ids"])
                loss = F.cross_entropy(logits.reshape(-1, vocab), batch["labels"].reshape(-1),
                                       ignore_index=-100)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(loss.item())
                if len(losses) % args.log_every == 0:
                    trained = (batch["labels"] != -100).float().mean().item()
                    print(f"step {len(losses):4d}  loss {losses[-1]:.3f}  ({trained:.0%} of "
                          "the batch's tokens trained on)", flush=True)
                if len(losses) >= args.steps:
                    break
        stats = loader.stats()
    return losses, stats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--conversations", type=int, default=3000)
    p.add_argument("--workers", type=int, default=1, help="data server worker processes")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=25)
    args = p.parse_args(argv)
    if args.steps < 40:
        p.error("--steps must be >= 40 (the loss check compares the first and last 20)")
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) - args.workers))
    with tempfile.TemporaryDirectory(prefix="stoker-sft-") as tmp:
        root = Path(tmp)
        (root / "data").mkdir()
        texts = make_conversations(root / "data" / "chat.jsonl", args.conversations, args.seed)
        tokenizer, vocab = make_tokenizer(root / "tokenizer", texts)
        config = write_config(root / "stoker.yaml", {
            "cache": {"dir": str(root / "cache")},
            "datasets": {"sft": {"format": "chat", "source": str(root / "data"),
                                 "tokenizer": str(tokenizer), "seq_len": args.seq_len}}})
        t0 = time.perf_counter()
        with ServerProcess(config, workers=args.workers) as server:
            print(f"data server ready at {server.address} ({time.perf_counter() - t0:.1f}s: "
                  "conversations rendered, masked and packed there)")
            losses, stats = train(server.address, vocab, args)
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
