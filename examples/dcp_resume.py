"""A torch.distributed.checkpoint save at 2 ranks, resumed at 3: every sample once.

    python examples/dcp_resume.py [--save-world 2] [--load-world 3] [--stop-at 6]

Data-parallel training as torchtitan does it, on CPU: each rank (a process, gloo) has
a RemoteLoader and a tiny DDP model; after `--stop-at` steps every rank calls `dcp.save` on
`{"model": ..., "loader": LoaderState(loader)}`. A new job of `--load-world` ranks makes its
own loaders, calls `dcp.load` on the same dict and reads the rest of the epoch. The example
checks what stoker's elastic resume promises: every sample of the epoch is read exactly once
across the two jobs, in the slot an unstopped run has it (rank r of the new job reads
positions start + r, start + r + M, ...), and the model's weights came back. Exits non-zero
otherwise.

The sizes are chosen so that no sample falls in the epoch's tail (docs/client.md#resuming):
240 samples, batch 4: 2 ranks x 6 steps consume 48, and 192 = 3 x 16 x 4 remain.
`--address HOST:PORT` uses a running server that serves "line" (framework_data.py).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from framework_data import FEATURES, serve

from stoker.client import RemoteLoader
from stoker.integrations.dcp import LoaderState


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, world: int, port: int, job: dict[str, Any]) -> None:
    """One rank (see `train`), ended by os._exit: a rank that returned could stay alive for
    ever on its way out, held by a thread gloo (or a loader that a failure left open) still
    runs, and `job` waits for every rank to exit (seen: an orphaned rank past this function,
    kept by gloo's pt_gloo_runloop thread)."""
    code = 0
    try:
        train(rank, world, port, job)
    except BaseException:  # the parent sees the exit code; the traceback goes to stderr
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def train(rank: int, world: int, port: int, job: dict[str, Any]) -> None:
    """Load the checkpoint if there is one, train (to `stop_at` steps, or to the end of the
    epoch), save; write what it read to `out`.rank{r}.json."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(FEATURES, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        loader = RemoteLoader(job["address"], "line", batch_size=job["batch_size"], rank=rank,
                              world_size=world, timeout=60)
        state = {"model": model.state_dict(), "loader": LoaderState(loader)}
        if job["load"]:
            dcp.load(state, checkpoint_id=job["ckpt"])
            model.load_state_dict(state["model"])
        restored = model.module.weight.detach().flatten().tolist()
        at = loader.stats()  # the epoch's positions consumed before this job:
        start = at["start"] + at["next_batch"] * job["batch_size"] * world
        read: list[int] = []
        for batch in loader:
            loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            read += batch["sample_index"].tolist()
            if job["stop_at"] and loader.state_dict()["next_batch"] == job["stop_at"]:
                dcp.save({"model": model.state_dict(), "loader": LoaderState(loader)},
                         checkpoint_id=job["ckpt"])
                break
        Path(f"{job['out']}.rank{rank}.json").write_text(json.dumps(
            {"read": read, "start": start, "restored": restored,
             "weight": model.module.weight.detach().flatten().tolist()}))
        loader.close()
    finally:
        dist.destroy_process_group()


def job(world: int, **spec: Any) -> list[dict[str, Any]]:
    """Run `world` ranks (processes) and return what each wrote. Whatever stops the
    wait (a rank's failure, Ctrl-C, a test's timeout) kills the ranks still running: a rank
    blocked in a collective never returns by itself (gloo waits 30 minutes)."""
    # Forked from a fork server that imported torch once (a spawned rank imports it itself:
    # seconds of CPU a rank, three jobs of 2 or 3 ranks on a 2-core machine), never forked
    # from this process, which may run gRPC's threads.
    # torch._dynamo: DDP's constructor imports it (213 modules, 0.5 CPU s) in every rank.
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed.checkpoint", "torch.nn",
                                    "torch._dynamo"])
    ranks = mp.start_processes(rank_main, args=(world, free_port(), spec), nprocs=world,
                               start_method="forkserver", join=False)
    try:
        while not ranks.join():
            pass
    finally:
        for p in ranks.processes:
            if p.is_alive():
                p.kill()
                p.join()
    return [json.loads(Path(f"{spec['out']}.rank{r}.json").read_text()) for r in range(world)]


def epoch_order(address: str) -> list[int]:
    """The samples of epoch 0 in the order of its positions (one loader, batch 1)."""
    with RemoteLoader(address, "line", batch_size=1, timeout=60) as whole:
        return [int(b["sample_index"][0]) for b in whole]


def compare(order: list[int], jobs: list[tuple[list[dict[str, Any]], int]]) -> dict[str, int]:
    """What the `jobs` (each: what its ranks wrote, its world size) read of the epoch `order`,
    one after the other: samples lost, read more than once, read in another slot than the
    epoch's order has them (rank r's j-th sample after the `start` positions consumed before
    the job is position start + r + W j)."""
    slots: dict[int, int] = {}
    twice = 0
    for ranks, world in jobs:
        for rank, got in enumerate(ranks):
            for j, sample in enumerate(got["read"]):
                slot = got["start"] + rank + world * j
                twice += slot in slots
                slots[slot] = sample
    read = [s for ranks, _ in jobs for got in ranks for s in got["read"]]
    return {"samples": len(order), "read": len(read), "lost": len(set(order) - set(read)),
            "duplicated": len(read) - len(set(read)) + twice,
            "wrong": sum(s >= len(order) or order[s] != sample for s, sample in slots.items())}


def check(address: str, args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    ckpt = str(Path(tmp) / "ckpt")
    common = {"address": address, "batch_size": args.batch_size, "ckpt": ckpt}
    before = job(args.save_world, load=False, stop_at=args.stop_at,
                 out=str(Path(tmp) / "before"), **common)
    print(f"job 1: {args.save_world} ranks, dcp.save after step {args.stop_at}")
    after = job(args.load_world, load=True, stop_at=0, out=str(Path(tmp) / "after"), **common)
    start = after[0]["start"]
    print(f"job 2: {args.load_world} ranks, dcp.load: the rest of the epoch from position "
          f"{start}")
    found = compare(epoch_order(address), [(before, args.save_world), (after, args.load_world)])
    print(f"{found['read']} samples read of {found['samples']}: {found['lost']} lost, "
          f"{found['duplicated']} duplicated, {found['wrong']} in another slot than an "
          "unstopped run's")
    if found["lost"] or found["duplicated"] or found["wrong"]:
        raise SystemExit("FAILED: the resumed job did not read the rest of the epoch exactly")
    if any(got["restored"] != before[0]["weight"] for got in after):
        raise SystemExit("FAILED: the model's weights did not come back from the checkpoint")
    print("the model's weights came back on every rank")
    return {"before": before, "after": after, **found}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--save-world", type=int, default=2, help="ranks of the job that saves")
    p.add_argument("--load-world", type=int, default=3, help="ranks of the job that loads")
    p.add_argument("--stop-at", type=int, default=6, help="steps before the save")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--samples", type=int, default=240, help="the dataset's size (own server)")
    p.add_argument("--address", help="a server that serves 'line' (else one is started)")
    p.add_argument("--json", help="write both jobs' reading and the epoch's order here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="stoker-dcp-") as tmp:
        if args.address:
            result = check(args.address, args, tmp)
        else:
            with serve(samples=args.samples) as address:
                result = check(address, args, tmp)
    if args.json:
        Path(args.json).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
