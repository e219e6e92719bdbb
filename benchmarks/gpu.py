"""The GPU path measured on a GPU, and what the client's path costs a busy trainer (issue 31).

    python -m benchmarks --only gpu
    python benchmarks/gpu.py [--quick] [--json out.json] [--trainer-cores T]
    python benchmarks/gpu.py --dry-run-cpu    # the GPU part's code on the CPU, tiny models: a
                                              # check of this script, not a figure

Where CUDA is present (it skips, saying why, where it is not):

- images: a torchvision ResNet-50 (bf16 autocast, channels_last, SGD) at batch 256 on the
  image pipeline (JPEG ~375x500 -> random resized crop 224 -> flip -> uint8, normalised on
  the GPU). Systems: the ceiling (the same steps on one batch already on the GPU); stoker,
  its server pinned to cores [T, N) and this process (the trainer) to [0, T),
  RemoteLoader(device="cuda", normalize=...); torch DataLoader with T workers on the
  trainer's cores; DataLoader with N workers on all cores (pin_memory, non_blocking copies,
  the same steps in `JpegCrops`, torchvision's RandomResizedCrop / RandomHorizontalFlip /
  PILToTensor written out). images/s, fraction of the ceiling, stall (the share of the loop
  spent waiting for a batch), the trainer node's CPU seconds per 1,000 images (this process,
  plus DataLoader's workers). And what the same stoker server delivers to a consumer that
  only counts (batches on the GPU, no model), beside what it delivers under the trainer.
- tokens: a GPT-2-small-sized decoder (12 layers, 768 wide, 12 heads, seq 1024, vocab
  50304; plain torch, bf16 autocast, fused AdamW) against nanoGPT's own `get_batch` (a
  uint16 memmap, random offsets, pinned, non_blocking) and its ceiling.

Everywhere (this machine has no GPU): a CPU stand-in for the trainer's step. The fleet
scenario's dataset (32 KiB samples that take 2 ms asleep) from a server of 8 workers,
batch 256, shared_memory=False; each step burns a fixed CPU time on this process's main
thread (numpy work), as a busy training process does between batches. Per burn: delivered
batches/s against a consumer that only counts, and the trainer's CPU per batch beyond the
burn (what the client's path costs it).
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from _data import MEAN, STD, TRANSFORMS, make_image_folder
from _measure import machine_info, run_scenario, scenario_parser, settle, summarise
from wire import proc_table, tree_cpu

from stoker.client import RemoteLoader
from stoker.server import ServerProcess, write_config

HERE = Path(__file__).resolve().parent
FULL = {"images": 4096, "steps": 60, "warmup": 10, "burns": [0.0, 20.0, 50.0],
        "cpu_batches": 40, "repeats": 3}
QUICK = {"images": 512, "steps": 8, "warmup": 2, "burns": [0.0, 20.0], "cpu_batches": 16,
         "repeats": 1}


def self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def server_env() -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(HERE),
                                                        os.environ.get("PYTHONPATH")]))}


# -- the CPU stand-in (runs everywhere) -------------------------------------------------------
def burn(seconds: float, scratch: np.ndarray) -> None:
    """`seconds` of this thread's CPU in numpy work (one thread: ufuncs, no BLAS)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        np.multiply(scratch, 1.0000001, out=scratch)
        np.add(scratch, 1e-7, out=scratch)


def standin_epoch(address: str, epoch: int, burn_ms: float,
                  args: argparse.Namespace) -> dict[str, float]:
    scratch = np.ones(1 << 16, np.float32)
    with RemoteLoader(address, "fleet", batch_size=256, seed=0, shared_memory=False) as loader:
        loader.set_epoch(epoch)
        batches = len(loader)
        wait, burned = 0.0, 0.0
        cpu0, t0 = self_cpu(), time.perf_counter()
        t = t0
        for batch in loader:
            got = time.perf_counter()
            wait += got - t
            assert batch["x"].shape[0] == 256
            if burn_ms:
                b0 = time.thread_time()
                burn(burn_ms / 1000, scratch)
                burned += time.thread_time() - b0
            t = time.perf_counter()
        elapsed, cpu = time.perf_counter() - t0, self_cpu() - cpu0
    return {"batches_per_s": batches / elapsed, "stall": wait / elapsed,
            "client_cpu_ms_per_batch": 1000 * (cpu - burned) / batches,
            "trainer_cpu_ms_per_batch": 1000 * cpu / batches}


def cpu_standin(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """The fleet dataset from a server of 8 workers; each burn per repeat, alternating."""
    config = write_config(tmp / "standin.yaml", {"datasets": {"fleet": {
        "format": "python", "factory": "_sim:Waiting",
        "options": {"n": 256 * args.cpu_batches, "sample_ms": 2.0}}}})
    runs: dict[float, list[dict[str, float]]] = {b: [] for b in args.burns}
    with ServerProcess(config, workers=8, env=server_env()).start(timeout=300) as server:
        standin_epoch(server.address, 10_000, 0.0, args)  # untimed: first connections, imports
        for r in range(args.repeats):
            order = args.burns if r % 2 == 0 else args.burns[::-1]
            for i, b in enumerate(order):
                m = standin_epoch(server.address, 100 * r + i, b, args)
                runs[b].append(m)
                if not args.json_only:
                    print(f"  stand-in burn {b:4.0f} ms: {m['batches_per_s']:6.2f} batches/s "
                          f"stall {m['stall']:.1%}  client {m['client_cpu_ms_per_batch']:.1f} "
                          "CPU ms/batch", flush=True)
        code = server.stop()
    rows = [{"burn_ms": b, "repeats": rs,
             **{k: summarise([m[k] for m in rs]) for k in rs[0]}} for b, rs in runs.items()]
    counting = rows[0]["batches_per_s"]["median"] if args.burns[0] == 0 else float("nan")
    for row in rows:
        row["over_counting"] = row["batches_per_s"]["median"] / counting
        # The rate the step alone allows, and the server's (8 workers x 2 ms a sample).
        row["step_limit_batches_per_s"] = 1000 / row["burn_ms"] if row["burn_ms"] else None
    return {"rows": rows, "workers": 8, "capacity_batches_per_s": 8 / (256 * 0.002),
            "server_exit_code": code}


# -- the GPU part ---------------------------------------------------------------------------------
def cuda_missing() -> str | None:
    """Why the GPU part cannot run here, or None. torchvision is imported only after CUDA is
    known to be there (a CUDA build of it fails to import beside a CPU torch)."""
    import torch

    if not torch.cuda.is_available():
        return (f"no CUDA device (torch {torch.__version__}, "
                f"built with CUDA {torch.version.cuda or 'none'})")
    return None


class JpegCrops:
    """ImageFolder-style JPEGs -> RandomResizedCrop(224) -> RandomHorizontalFlip ->
    PILToTensor (uint8 CHW), as torchvision's Pillow path does it, written out (the same
    steps, the same Pillow calls); labels by class folder. For torch's DataLoader."""

    def __init__(self, root: Path, size: int = 224) -> None:
        classes = sorted(p.name for p in root.iterdir() if p.is_dir())
        self.items = [(str(f), c) for c, name in enumerate(classes)
                      for f in sorted((root / name).glob("*.jpg"))]
        self.size = size

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        import torch
        from PIL import Image

        path, label = self.items[i]
        with open(path, "rb") as f:
            img = Image.open(f).convert("RGB")
        width, height = img.size
        box = (0, 0, width, height)
        for _ in range(10):
            area = width * height * torch.empty(1).uniform_(0.08, 1.0).item()
            ratio = math.exp(torch.empty(1).uniform_(math.log(3 / 4), math.log(4 / 3)).item())
            w, h = round(math.sqrt(area * ratio)), round(math.sqrt(area / ratio))
            if 0 < w <= width and 0 < h <= height:
                top = int(torch.randint(0, height - h + 1, (1,)))
                left = int(torch.randint(0, width - w + 1, (1,)))
                box = (left, top, left + w, top + h)
                break
        img = img.resize((self.size, self.size), Image.Resampling.BILINEAR, box=box)
        if torch.rand(1).item() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1), label


class Trainer:
    """One model, its optimizer and its step, on `device`; `step` takes device tensors."""

    def __init__(self, model: Any, opt: Any, loss: Callable[..., Any], device: str) -> None:
        import torch

        self.model, self.opt, self.loss, self.device = model, opt, loss, device
        self.autocast = torch.autocast(device.split(":")[0], dtype=torch.bfloat16)

    def step(self, x: Any, y: Any) -> None:
        with self.autocast:
            loss = self.loss(self.model(x), y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def node_cpu(exclude: int | None) -> float:
    """CPU seconds of this process and its children (DataLoader's workers), less the
    subtree of `exclude` (a stoker server this process started: another node's CPU)."""
    table = proc_table()
    mine = tree_cpu(table, os.getpid())
    skip = tree_cpu(table, exclude) if exclude else {}
    return sum(cpu for pid, cpu in mine.items() if pid not in skip)


def timed_steps(batches: Iterator[tuple[Any, Any]], trainer: Trainer | None,
                args: argparse.Namespace, batch_items: int,
                server_pid: int | None) -> dict[str, float]:
    """`warmup` steps untimed, then `steps` timed: items/s (synchronised at both ends),
    the share of the loop spent waiting for the next batch, node CPU per 1,000 items.
    trainer None: a consumer that only counts."""
    for _ in range(args.warmup):
        x, y = next(batches)
        if trainer:
            trainer.step(x, y)
    device = trainer.device if trainer else args.device
    sync(device)
    cpu0, t0 = node_cpu(server_pid), time.perf_counter()
    wait = 0.0
    for _ in range(args.steps):
        w0 = time.perf_counter()
        x, y = next(batches)
        wait += time.perf_counter() - w0
        if trainer:
            trainer.step(x, y)
    sync(device)
    elapsed, cpu = time.perf_counter() - t0, node_cpu(server_pid) - cpu0
    items = args.steps * batch_items
    return {"items_per_s": items / elapsed, "stall": wait / elapsed,
            "node_cpu_s_per_1000": 1000 * cpu / items}


def forever(loader: Any, convert: Callable[[Any], tuple[Any, Any]]) -> Iterator[tuple[Any, Any]]:
    """Batches over epoch after epoch (iterating the loader again), converted."""
    while True:
        for batch in loader:
            yield convert(batch)


def image_systems(args: argparse.Namespace, data: Path, tmp: Path) -> dict[str, Any]:
    import torch
    from torch.utils.data import DataLoader

    device, n, t = args.device, len(os.sched_getaffinity(0)), args.trainer_cores
    all_cores, trainer_cores = sorted(os.sched_getaffinity(0)), set(range(t))
    if args.dry_run_cpu:
        model: Any = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 7, stride=8),
                                         torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                         torch.nn.Linear(8, 1000))
    else:
        import torchvision

        model = torchvision.models.resnet50(num_classes=1000)
    model = model.to(device, memory_format=torch.channels_last)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                      torch.nn.functional.cross_entropy, device)
    bs = args.batch_size
    mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1) * 255
    std = torch.tensor(STD, device=device).view(1, 3, 1, 1) * 255

    def on_gpu(batch: Any) -> tuple[Any, Any]:  # DataLoader's (uint8 CHW, label) pairs
        x = batch[0].to(device, non_blocking=True).float().sub_(mean).div_(std)
        return (x.contiguous(memory_format=torch.channels_last),
                batch[1].to(device, non_blocking=True))

    def stoker_batch(batch: dict[str, Any]) -> tuple[Any, Any]:
        return batch["image"].contiguous(memory_format=torch.channels_last), batch["label"]

    out: dict[str, Any] = {"trainer_cores": t, "cores": n}
    fixed = (torch.randn(bs, 3, 224, 224, device=device).contiguous(
        memory_format=torch.channels_last), torch.randint(0, 1000, (bs,), device=device))
    out["ceiling"] = timed_steps(iter(lambda: fixed, None), trainer, args, bs, None)
    say(args, "images", "ceiling", out["ceiling"])

    os.sched_setaffinity(0, trainer_cores)  # the trainer's node from here on
    config = write_config(tmp / "imgs.yaml", {"datasets": {"imgs": {
        "format": "image-folder", "source": str(data), "transforms": TRANSFORMS[:-1]}}})
    # The server and its workers on [T, N): set in the process that then execs the server,
    # so that every worker it starts inherits it (the dry run: every core).
    server_cores = set(all_cores if args.dry_run_cpu else all_cores[t:]) or {0}
    wrap = [sys.executable, "-c", f"import os, sys; os.sched_setaffinity(0, {server_cores}); "
            "os.execv(sys.argv[1], sys.argv[1:])"]
    out["server_cores"] = sorted(server_cores)
    with ServerProcess(config, workers=max(1, n - t), wrap=wrap).start(timeout=300) as server:
        pid = server.proc.pid
        opts = {"batch_size": bs, "seed": 0, "device": device,
                "normalize": {"image": (MEAN, STD)}}
        with RemoteLoader(server.address, "imgs", **opts) as loader:
            out["stoker"] = timed_steps(forever(loader, stoker_batch), trainer, args, bs, pid)
            out["stoker"]["loader_prefetch"] = loader.stats()["prefetch"]
        say(args, "images", "stoker", out["stoker"])
        with RemoteLoader(server.address, "imgs", **opts) as loader:
            out["stoker_counting"] = timed_steps(forever(loader, stoker_batch), None, args, bs,
                                                 pid)
        say(args, "images", "stoker, counting only", out["stoker_counting"])
        out["server_exit_code"] = server.stop()
    pin = device.startswith("cuda")
    for name, workers, cores in (("dataloader_trainer_cores", t, trainer_cores),
                                 ("dataloader_all_cores", n, set(all_cores))):
        os.sched_setaffinity(0, cores)  # its workers inherit it
        dl = DataLoader(JpegCrops(data), batch_size=bs, shuffle=True, drop_last=True,
                        num_workers=workers, pin_memory=pin, persistent_workers=True)
        out[name] = timed_steps(forever(dl, on_gpu), trainer, args, bs, None)
        say(args, "images", name, out[name])
        del dl
    os.sched_setaffinity(0, all_cores)
    ceiling = out["ceiling"]["items_per_s"]
    for name in ("stoker", "stoker_counting", "dataloader_trainer_cores",
                 "dataloader_all_cores"):
        out[name]["of_ceiling"] = out[name]["items_per_s"] / ceiling
    out["stoker_under_trainer_over_counting"] = (out["stoker"]["items_per_s"]
                                                 / out["stoker_counting"]["items_per_s"])
    return out


def token_systems(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    import torch
    from torch import nn

    device, tiny = args.device, args.dry_run_cpu
    seq, vocab, width, layers, heads = ((128, 512, 64, 2, 2) if tiny else
                                        (1024, 50304, 768, 12, 12))
    bs = args.token_batch
    tokens = tmp / "train.bin"
    rng = np.random.default_rng(0)
    rng.integers(0, vocab, size=(bs * (seq + 1) * 400,), dtype=np.uint16).tofile(tokens)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                     nn.Linear(4 * width, width))

        def forward(self, x: Any) -> Any:
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, heads, d // heads).unbind(2)
            a = nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(seq, width)
            self.blocks = nn.Sequential(*(Block() for _ in range(layers)))
            self.ln, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

        def forward(self, ids: Any) -> Any:
            x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
            return self.head(self.ln(self.blocks(x)))

    model = GPT().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4,
                            **({"fused": True} if device.startswith("cuda") else {}))
    trainer = Trainer(model, opt, lambda logits, y: nn.functional.cross_entropy(
        logits.flatten(0, 1), y.flatten()), device)
    data = np.memmap(tokens, dtype=np.uint16, mode="r")
    pin = device.startswith("cuda")

    def get_batch() -> tuple[Any, Any]:  # nanoGPT's train.py, as it is written there
        ix = torch.randint(len(data) - seq, (bs,))
        x = torch.stack([torch.from_numpy(data[i:i + seq].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + seq].astype(np.int64)) for i in ix])
        if pin:
            return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(
                device, non_blocking=True)
        return x.to(device), y.to(device)

    out: dict[str, Any] = {"seq_len": seq, "batch_size": bs, "layers": layers, "width": width,
                           "parameters": sum(p.numel() for p in model.parameters())}
    fixed = get_batch()
    out["ceiling"] = timed_steps(iter(lambda: fixed, None), trainer, args, bs * seq, None)
    say(args, "tokens", "ceiling", out["ceiling"])
    out["nanogpt_get_batch"] = timed_steps(iter(get_batch, None), trainer, args, bs * seq, None)
    say(args, "tokens", "nanoGPT get_batch", out["nanogpt_get_batch"])
    config = write_config(tmp / "tokens.yaml", {"datasets": {"tokens": {
        "format": "tokens", "source": str(tokens), "seq_len": seq}}})
    with ServerProcess(config, workers=2).start(timeout=300) as server:
        with RemoteLoader(server.address, "tokens", batch_size=bs, seed=0,
                          device=device) as loader:
            out["stoker"] = timed_steps(forever(loader, lambda b: (b["input_ids"],
                                                                   b["labels"])),
                                        trainer, args, bs * seq, server.proc.pid)
        say(args, "tokens", "stoker", out["stoker"])
        out["server_exit_code"] = server.stop()
    for name in ("nanogpt_get_batch", "stoker"):
        out[name]["of_ceiling"] = out[name]["items_per_s"] / out["ceiling"]["items_per_s"]
    return out


def say(args: argparse.Namespace, part: str, name: str, m: dict[str, float]) -> None:
    if not args.json_only:
        print(f"  {part} {name:<28} {m['items_per_s']:10.0f}/s  stall {m['stall']:.1%}  node "
              f"CPU {m['node_cpu_s_per_1000']:.2f} s/1000", flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {"benchmark": "gpu", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "machine": machine_info(numpy=np.__version__),
                           "parameters": dict(vars(args)), "check_problems": []}
    with tempfile.TemporaryDirectory(prefix="stoker-gpu-") as tmp_name:
        tmp = Path(tmp_name)
        res["cpu_standin"] = stand = cpu_standin(args, tmp)
        if stand["server_exit_code"]:
            res["check_problems"].append(f"stand-in server exit code {stand['server_exit_code']}")
        reason = None if args.dry_run_cpu else cuda_missing()
        if reason:
            res["skipped"] = reason
            if not args.json_only:
                print(f"GPU part skipped: {reason}", flush=True)
        else:
            import torch

            args.device = "cpu" if args.dry_run_cpu else "cuda"
            res["device"] = ("cpu (dry run)" if args.dry_run_cpu
                             else torch.cuda.get_device_name(0))
            res["machine"]["torch"] = torch.__version__
            data = tmp / "images"
            make_image_folder(data, args.images, 10, 437, shape=(375, 500))
            res["images"] = image_systems(args, data, tmp)
            res["tokens"] = token_systems(args, tmp)
            for part in ("images", "tokens"):
                if res[part]["server_exit_code"]:
                    res["check_problems"].append(f"{part}: server exit code "
                                                 f"{res[part]['server_exit_code']}")
    res["server_exit_code"] = 0  # each server's is checked into check_problems
    return res


def main(argv: list[str] | None = None) -> int:
    ap = scenario_parser(__doc__)
    ap.add_argument("--images", type=int)
    ap.add_argument("--steps", type=int, help="timed steps per system (60)")
    ap.add_argument("--warmup", type=int, help="untimed steps before them (10)")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--token-batch", type=int, default=8, help="rows of 1024 tokens a step")
    ap.add_argument("--trainer-cores", type=int,
                    help="T: the trainer's cores [0, T); the server gets [T, N) (N / 4)")
    ap.add_argument("--burns", type=float, nargs="+",
                    help="stand-in: CPU ms a step burns (0 first: counting only)")
    ap.add_argument("--cpu-batches", type=int, help="stand-in: batches an epoch (40)")
    ap.add_argument("--repeats", type=int, help="stand-in: repeats (3)")
    ap.add_argument("--dry-run-cpu", action="store_true",
                    help="run the GPU part's code on the CPU with tiny models (no figure)")
    args = ap.parse_args(argv)
    settle(args, QUICK, FULL)
    if args.dry_run_cpu:
        args.images, args.steps, args.warmup, args.batch_size = 96, 3, 1, 16
        args.token_batch = 2
    if args.trainer_cores is None:
        args.trainer_cores = max(1, len(os.sched_getaffinity(0)) // 4)
    args.device = "cpu"
    return run_scenario(args, run)


if __name__ == "__main__":
    sys.exit(main())
