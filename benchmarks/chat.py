"""Conversations (`format: chat`) rendered, masked and packed by a server, against the same
rendering, masking and packing in a torch DataLoader with `transformers`.

    python benchmarks/chat.py                  # 4000 conversations, seq_len 2048, 3 repeats
    python benchmarks/chat.py --quick          # smoke test, about a minute
    python benchmarks/chat.py --json out.json

The conversations and the tokenizer are generated (tests/chat_data.py: ChatML with
`{% generation %}` markers, a byte-level BPE trained with `tokenizers`; nothing is
downloaded). Both systems run on the same cores: the server with `--workers` worker
processes, the DataLoader with as many workers.

- stoker: `stoker serve` renders, tokenizes and masks every conversation once at start
  (timed: `start_s`) and plans the rows; each repeat reads one shuffled epoch through
  `RemoteLoader(output="torch")`.
- the peer: a map-style Dataset whose row k renders its conversations with
  `tokenizer.apply_chat_template(..., tokenize=True, return_assistant_tokens_mask=True)` and
  lays out the same fields (input_ids, labels, position_ids, document_ids, attention_mask);
  `DataLoader(shuffle=True, num_workers=W, persistent_workers=True)`, its workers spawned
  (this process runs gRPC's threads for stoker's epochs: a fork then skips gRPC's fork
  handlers, and a forked worker can die of SIGSEGV). It packs with stoker's plan (the same rows, so
  the rows are checked equal), which costs it a pass over the lengths first: that pass,
  rendering every conversation once with transformers in this process, is timed apart
  (`peer_plan_s`) and not counted in its rows/s. Per epoch it renders again, as an
  on-the-fly Dataset does; stoker does not, which is the point of rendering on the server.

Per repeat (the order alternates): rows/s after the first batch, and the trainer's CPU seconds
per row (this process's, plus the DataLoader's workers' for the peer, read from /proc: what
the GPU node spends; the workers' start, before the first batch, is not counted). Medians
over repeats. Every epoch is checked: each row once.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _measure import machine_info, run_scenario, scenario_parser, summarise

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from chat_data import conversations, corpus_texts, make_tokenizer, write_jsonl

from stoker.client import RemoteLoader
from stoker.server import Config, ServerProcess, write_config
from stoker.server.formats import open_dataset

FULL = {"conversations": 4000, "seq_len": 2048, "batch_size": 8, "repeats": 3}
QUICK = {"conversations": 400, "seq_len": 1024, "batch_size": 8, "repeats": 1}
IGNORE = -100


def cpu_seconds(workers: bool) -> float:
    """This process's CPU seconds, plus (`workers`) those of its live multiprocessing children:
    the DataLoader's persistent workers (the server is a subprocess, not one of them)."""
    total = time.process_time()  # not os.times(): its 10 ms ticks read 0 for a quick epoch
    if workers:
        tick = os.sysconf("SC_CLK_TCK")
        for child in multiprocessing.active_children():
            try:
                with open(f"/proc/{child.pid}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
            except OSError:
                continue  # exited while we looked
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


class PeerRows:
    """Row k of stoker's plan, rendered, masked and laid out with transformers per read."""

    def __init__(self, folder: Path, convs: list[Any], members: list[list[int]], seq_len: int,
                 pad_id: int) -> None:
        import transformers

        self.tok = transformers.AutoTokenizer.from_pretrained(str(folder))
        self.convs, self.members, self.seq_len, self.pad_id = convs, members, seq_len, pad_id

    def __len__(self) -> int:
        return len(self.members)

    def __getitem__(self, k: int) -> dict[str, Any]:
        import torch

        n = self.seq_len
        input_ids = torch.full((n,), self.pad_id, dtype=torch.int64)
        labels = torch.full((n,), IGNORE, dtype=torch.int64)
        position_ids = torch.zeros(n, dtype=torch.int64)
        document_ids = torch.full((n,), -1, dtype=torch.int32)
        t = 0
        for seg, d in enumerate(self.members[k]):
            enc = self.tok.apply_chat_template(self.convs[d], tokenize=True, return_dict=True,
                                               return_assistant_tokens_mask=True)
            ids = torch.tensor(enc["input_ids"][:n - t], dtype=torch.int64)
            mask = torch.tensor(enc["assistant_masks"][:n - t], dtype=torch.bool)
            m = len(ids)
            input_ids[t : t + m] = ids
            labels[t : t + m - 1] = torch.where(mask[1:], ids[1:], IGNORE)
            position_ids[t : t + m] = torch.arange(m)
            document_ids[t : t + m] = seg
            t += m
        position_ids[t:] = torch.arange(n - t)
        return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids,
                "document_ids": document_ids,
                "attention_mask": (document_ids >= 0).to(torch.int64), "index": k}


def epoch_stoker(address: str, p: dict[str, Any], epoch: int, rows: int, problems: list[str]
                 ) -> tuple[dict[str, Any], dict[int, Any]]:
    kept: dict[int, Any] = {}
    with RemoteLoader(address, "chat", batch_size=p["batch_size"], shuffle=True, seed=1,
                      drop_last=False, output="torch", timeout=300) as loader:
        loader.set_epoch(epoch)
        it = iter(loader)
        first = next(it)
        seen = [first["sample_index"].numpy()]
        t1, c1 = time.perf_counter(), cpu_seconds(False)
        timed = 0
        for batch in it:
            seen.append(batch["sample_index"].numpy())
            timed += len(batch["sample_index"])
            for j, i in enumerate(batch["sample_index"].tolist()):
                if i < 4:
                    kept[i] = {k: v[j] for k, v in batch.items()}
        t2, c2 = time.perf_counter(), cpu_seconds(False)
    check_once("stoker", epoch, seen, rows, problems)
    return {"rows_per_s": timed / (t2 - t1), "cpu_per_row_s": (c2 - c1) / max(1, timed)}, kept


def peer_loader(data: PeerRows, p: dict[str, Any], workers: int) -> Any:
    """The peer's DataLoader, made once: persistent workers, spawned (not forked: this process
    runs gRPC's threads once stoker's first epoch has run)."""
    import torch
    from torch.utils.data import DataLoader

    return DataLoader(data, batch_size=p["batch_size"], shuffle=True, num_workers=workers,
                      persistent_workers=workers > 0,
                      multiprocessing_context="spawn" if workers > 0 else None,
                      generator=torch.Generator())


def epoch_peer(loader: Any, epoch: int, problems: list[str]
               ) -> tuple[dict[str, Any], dict[int, Any]]:
    kept: dict[int, Any] = {}
    loader.generator.manual_seed(epoch)  # the sampler's: the epoch's shuffle
    it = iter(loader)
    first = next(it)
    seen = [first["index"].numpy()]
    t1, c1 = time.perf_counter(), cpu_seconds(True)
    timed = 0
    for batch in it:
        seen.append(batch["index"].numpy())
        timed += len(batch["index"])
        for j, i in enumerate(batch["index"].tolist()):
            if i < 4:
                kept[i] = {k: v[j] for k, v in batch.items()}
    t2, c2 = time.perf_counter(), cpu_seconds(True)
    check_once("peer", epoch, seen, len(loader.dataset), problems)
    return {"rows_per_s": timed / (t2 - t1), "cpu_per_row_s": (c2 - c1) / max(1, timed)}, kept


def check_once(what: str, epoch: int, seen: list[np.ndarray], rows: int,
               problems: list[str]) -> None:
    if not np.array_equal(np.sort(np.concatenate(seen)), np.arange(rows)):
        problems.append(f"{what} epoch {epoch}: rows delivered are not each row once")


def run(args: argparse.Namespace) -> dict[str, Any]:
    import tokenizers
    import torch
    import transformers

    p = dict(QUICK if args.quick else FULL)
    for k in ("conversations", "seq_len", "repeats"):
        if getattr(args, k):
            p[k] = getattr(args, k)
    p["workers"] = args.workers
    problems: list[str] = []
    res: dict[str, Any] = {
        "machine": machine_info(numpy=np.__version__, torch=torch.__version__,
                                transformers=transformers.__version__,
                                tokenizers=tokenizers.__version__),
        "params": p, "check_problems": problems, "server_exit_code": 0}
    with tempfile.TemporaryDirectory(prefix="stoker-bench-chat-") as tmp:
        work = Path(tmp)
        convs = conversations(p["conversations"], seed=0)
        tok = make_tokenizer(work / "tok", corpus_texts(convs), vocab_size=2000)
        (work / "data").mkdir()
        write_jsonl(work / "data" / "sft.jsonl", convs)
        block = {"format": "chat", "source": str(work / "data"), "tokenizer": str(tok),
                 "seq_len": p["seq_len"]}
        config = Config.model_validate({"cache": {"dir": str(work / "plan")},
                                        "datasets": {"chat": block}})
        ds = open_dataset("chat", config)  # the plan the peer uses, and the corpus's facts
        members = [ds.piece_doc[ds.row_starts[k]:ds.row_starts[k + 1]].tolist()
                   for k in range(ds.packed_rows)]
        rows = len(ds)
        res["corpus"] = {"conversations": len(convs), "tokens": ds.total_tokens, "rows": rows,
                         "packing_efficiency": ds.packing_efficiency,
                         "long_conversations": ds.long_conversations}
        t0 = time.perf_counter()
        data = PeerRows(tok.parent, convs, members, p["seq_len"], ds.pad_id)
        lengths = [len(data.tok.apply_chat_template(c, tokenize=True, return_dict=True)
                       ["input_ids"]) for c in convs]
        res["peer_plan_s"] = time.perf_counter() - t0
        if sum(min(n, p["seq_len"]) for n in lengths) != ds.total_tokens:
            problems.append("the peer's token count differs from the server's")
        del ds

        path = write_config(work / "stoker.yaml", {"cache": {"dir": str(work / "cache")},
                                                   "datasets": {"chat": block}})
        t0 = time.perf_counter()
        server = ServerProcess(path, workers=args.workers).start(timeout=600)
        res["start_s"] = time.perf_counter() - t0
        runs: dict[str, list[dict[str, Any]]] = {"stoker": [], "dataloader": []}
        peer = peer_loader(data, p, args.workers)
        try:
            for rep in range(p["repeats"]):
                for what in (("stoker", "dataloader") if rep % 2 == 0
                             else ("dataloader", "stoker")):
                    if what == "stoker":
                        got, s_rows = epoch_stoker(server.address, p, rep, rows, problems)
                    else:
                        got, d_rows = epoch_peer(peer, rep, problems)
                    runs[what].append(got)
        finally:
            del peer  # its workers exit
            res["server_exit_code"] = server.stop()
        for i in sorted(set(s_rows) & set(d_rows)):
            for k in ("input_ids", "labels", "position_ids", "document_ids", "attention_mask"):
                if not torch.equal(s_rows[i][k], d_rows[i][k]):
                    problems.append(f"row {i}: {k} differs between stoker and the peer")
        res["compared_rows"] = len(set(s_rows) & set(d_rows))
    res["systems"] = {w: {"repeats": r, **{k: summarise([x[k] for x in r])
                                           for k in ("rows_per_s", "cpu_per_row_s")}}
                      for w, r in runs.items()}
    s, d = res["systems"]["stoker"], res["systems"]["dataloader"]
    res["ratio_rows_per_s"] = s["rows_per_s"]["median"] / d["rows_per_s"]["median"]
    res["ratio_cpu_per_row"] = s["cpu_per_row_s"]["median"] / d["cpu_per_row_s"]["median"]
    return res


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = scenario_parser(__doc__)
    ap.add_argument("--conversations", type=int, default=0)
    ap.add_argument("--seq-len", dest="seq_len", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return run_scenario(parse_args(argv), run)


if __name__ == "__main__":
    sys.exit(main())
