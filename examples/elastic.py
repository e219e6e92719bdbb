"""A GPT run on a mixture of two sources, stopped at 2 trainers and resumed at 3.

    python examples/elastic.py [--stop-at 40] [--batch-size 8] [--weight 0.7] [--more-epochs 1]

The worked example of docs/mixtures.md, runnable on one machine. One data server serves two
text corpora and `format: mixture` over them. Data-parallel training is simulated in this
process: at each global step every rank's loader gives its batch (rank r of world_size W, as
torchrun would run it), and one model takes the step on all of them together (what DDP's
averaged gradients amount to). After `--stop-at` steps at 2 ranks the job "loses a node": it
saves rank 0's `loader.state_dict()` with the model, and a new job of 3 ranks loads that same
state in every rank and trains to the end of the epoch, then `--more-epochs` more at 3.

It checks what an elastic resume promises: every (source, sample) of the epoch is read
exactly once across the two jobs, in the slots a run that never stopped would have read it
(compared with one loader reading the whole epoch), the sources' shares hold, and the loss
falls. Exits non-zero otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from gpt import VOCAB, TinyGPT, make_corpus, text_dataset

from stoker.client import RemoteLoader
from stoker.server import ServerProcess, write_config


def loaders(address: str, world: int, args: argparse.Namespace) -> list[RemoteLoader]:
    return [RemoteLoader(address, "mix", batch_size=args.batch_size, seed=args.seed, rank=r,
                         world_size=world, timeout=120) for r in range(world)]


def run(address: str, args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    model = TinyGPT(args.seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses: list[float] = []

    def step(batches: list[dict]) -> None:
        ids = torch.cat([b["input_ids"] for b in batches])
        logits = model(ids, torch.cat([b["position_ids"] for b in batches]),
                       torch.cat([b["document_ids"] for b in batches]))
        loss = F.cross_entropy(logits.reshape(-1, VOCAB),
                               torch.cat([b["labels"] for b in batches]).reshape(-1),
                               ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())

    # What a run that never stopped reads in epoch 0, slot by slot.
    with RemoteLoader(address, "mix", batch_size=1, seed=args.seed, timeout=120) as whole:
        reference = [(int(b["source"][0]), int(b["sample_index"][0])) for b in whole]
    read: dict[int, tuple[int, int]] = {}  # slot -> (source, sample_index)

    def note(batches: list[dict], start: int, world: int, batch_index: int) -> None:
        for rank, b in enumerate(batches):
            for j, (src, idx) in enumerate(zip(b["source"].tolist(), b["sample_index"].tolist(),
                                               strict=True)):
                slot = start + rank + world * (batch_index * args.batch_size + j)
                if slot in read:
                    raise SystemExit(f"FAILED: slot {slot} read twice")
                read[slot] = (src, idx)

    # The job of 2 trainers, stopped after --stop-at steps.
    two = loaders(address, 2, args)
    its = [iter(ld) for ld in two]
    for s in range(args.stop_at):
        batches = [next(it) for it in its]
        note(batches, 0, 2, s)
        step(batches)
    state = two[0].state_dict()  # every rank is at this step: one state is the job's
    torch.save({"model": model.state_dict(), "loader": state}, Path(args.tmp) / "ckpt.pt")
    for ld in two:
        ld.close()
    print(f"2 trainers: {args.stop_at} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}; "
          f"stopped at epoch {state['epoch']}, batch {state['next_batch']}")

    # The job of 3 trainers: every rank loads rank 0's state.
    ckpt = torch.load(Path(args.tmp) / "ckpt.pt", weights_only=False)
    model.load_state_dict(ckpt["model"])
    three = loaders(address, 3, args)
    for ld in three:
        ld.load_state_dict(ckpt["loader"])
    start = three[0].stats()["start"]
    rest = len(three[0])
    for s, batches in enumerate(zip(*three, strict=True)):
        note(list(batches), start, 3, s)
        step(list(batches))
    print(f"3 trainers: the rest of epoch 0 from slot {start}, {rest} steps")
    for epoch in range(1, 1 + args.more_epochs):  # normal epochs at 3
        for ld in three:
            ld.set_epoch(epoch)
        for batches in zip(*three, strict=True):
            step(list(batches))
        print(f"3 trainers: epoch {epoch}, {len(three[0])} steps; loss now {losses[-1]:.3f}")
    for ld in three:
        ld.close()

    # Epoch 0 across both jobs against the run that never stopped.
    lost = [s for s in range(len(reference)) if s not in read]
    wrong = [s for s, got in read.items() if reference[s] != got]
    sources = np.bincount([src for src, _ in read.values()], minlength=2)
    share = sources[0] / sources.sum()
    # What the 3 ranks leave of the epoch's rest: what does not divide by 3, then each rank's
    # last partial batch (drop_last=True, the default).
    left = len(reference) - start
    tail = left % 3 + 3 * ((left // 3) % args.batch_size)
    print(f"epoch 0: {len(read)} of {len(reference)} slots read once each; {len(lost)} not "
          f"read: the tail ({left} slots left at the change: {left % 3} over a multiple of 3, "
          f"then each rank's last partial batch); {len(wrong)} differ from the unstopped "
          f"run; source 0's share {share:.1%} (weight {args.weight:g})")
    first, last = np.mean(losses[:10]), np.mean(losses[-10:])
    failed = []
    if wrong:
        failed.append(f"{len(wrong)} slots differ from the unstopped run")
    if lost != list(range(len(reference) - tail, len(reference))):
        failed.append(f"{len(lost)} slots not read, not the epoch's last {tail}")
    if abs(share - args.weight) > 0.02:
        failed.append(f"source 0's share {share:.1%} is not its weight")
    if last >= 0.8 * first:
        failed.append(f"the loss did not fall ({first:.3f} -> {last:.3f})")
    for f in failed:
        print(f"FAILED: {f}", file=sys.stderr)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stop-at", type=int, default=40, help="global steps at 2 trainers")
    p.add_argument("--batch-size", type=int, default=8, help="rows per rank per step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--documents", type=int, default=600)
    p.add_argument("--weight", type=float, default=0.7, help="the first source's weight")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--more-epochs", type=int, default=1, help="normal epochs at 3 afterwards")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) - 1))
    with tempfile.TemporaryDirectory(prefix="stoker-elastic-") as tmp:
        args.tmp = tmp
        datasets = {}
        for i, name in enumerate(("web", "code")):
            folder = Path(tmp) / name
            folder.mkdir()
            make_corpus(folder / "docs.jsonl", args.documents, args.seed + i)
            datasets[name] = text_dataset(folder, args.seq_len)
        datasets["mix"] = {"format": "mixture",
                           "components": {"web": args.weight, "code": 1 - args.weight}}
        config = write_config(Path(tmp) / "stoker.yaml", {
            "cache": {"dir": str(Path(tmp) / "cache")}, "datasets": datasets})
        with ServerProcess(config, workers=1) as server:
            code = run(server.address, args)
            if server.stop() != 0:
                print("FAILED: the server did not shut down cleanly", file=sys.stderr)
                return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
