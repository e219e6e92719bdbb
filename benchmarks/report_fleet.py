"""docs/benchmarks.md's sections for issue 31 (one trainer keeps any number of server workers
busy): fleet, pipeline_batch, gpu, and the wire scenario's fastest raw receiver. Each figure
stands beside its goal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from _page import plt, save, spread, table


def _meets(ok: bool) -> str:
    return "yes" if ok else "**no**"


def fleet(r: dict[str, Any], plots: Path) -> list[str]:
    p, g = r["parameters"], r["goals"]
    rows = [[t["name"], spread(t["samples_per_s"]), f"{t['capacity_samples_per_s']:.0f}",
             f"{t['capacity_ratio']:.2f}", f">= {g['capacity_ratio']}",
             _meets(t["capacity_ratio"] >= g["capacity_ratio"]),
             spread(t["first_batch_s"], ".3f"), t["window"]] for t in r["throughput"]]
    styles = {"set_epoch": "`set_epoch(e)` each epoch", "again": "iterating the loader again"}
    bounds = [[styles[k], spread({x: 100 * v for x, v in b["stall"].items()}, ".1f"),
               f"< {100 * g['stall']:g}", _meets(b["stall"]["median"] < g["stall"]),
               f"{b['batches_per_s']['median']:.2f}", f"{b['boundary_wait_s']['median']:.3f}",
               f"{b['within_epoch_wait_s']['median']:.3f}"]
              for k, b in r.get("boundaries", {}).items()]
    first, goal = r["first_batch_s"]["median"], r["first_batch_goal_s"]
    fig, ax = plt.subplots(figsize=(6.4, 3.0))
    ax.barh([t["name"] for t in r["throughput"]], [t["capacity_ratio"] for t in r["throughput"]])
    ax.axvline(g["capacity_ratio"], color="red", ls="--", label="goal")
    ax.set_xlabel("delivered samples/s / (workers / sample time)")
    ax.legend()
    ax.grid(alpha=0.3, axis="x")
    step_limit = 1000 / p["step_ms"]
    return [f"A `format: python` dataset of {p['sample_bytes'] // 1024} KiB samples that each "
            f"take {p['sample_ms']:g} ms asleep (decode time on cores this machine lacks: a "
            "worker costs it almost no CPU), batches of "
            f"{p['batch_size']} ({p['batch_size'] * p['sample_bytes'] >> 20} MiB), one client "
            "rank with the loader's default settings and `shared_memory=False` (batches on "
            "the wire, as between machines). Each server starts once and serves every repeat; "
            "each read is an epoch no other read asked for (no shared-batch cache hits). "
            f"samples/s over a whole epoch of {p['batches']} batches from `iter()`, against "
            f"the workers' capacity (workers / {p['sample_ms']:g} ms); medians of "
            f"{p['repeats']} repeats. Window: the loader's batches in flight (`stats()`).", "",
            *table(["servers", "samples/s median [min, max]", "capacity", "ratio", "goal",
                    "met", "first batch s", "window"], rows),
            save(fig, plots, "fleet.png"), "",
            f"First batch of {p['batch_size']} from a server of {p['boundary_workers']} "
            f"workers, from `iter()` with the loader described: **{first:.3f} s** (goal <= "
            f"{goal:.3f} s, a quarter of one worker's whole batch; met: "
            f"{_meets(first <= goal)}).", "",
            f"Epoch boundaries: a consumer that steps every {p['step_ms']:g} ms (a sleep; "
            f"alone it would take {step_limit:.0f} batches/s) reads {p['epochs']} epochs of "
            f"{p['epoch_batches']} batches from the server of {p['boundary_workers']} workers "
            f"(capacity {p['boundary_workers'] * 1000 / (p['sample_ms'] * p['batch_size']):.1f} "
            "batches/s). Stall: the share of the loop's time spent waiting for a batch, after "
            "the run's first batch; waits in seconds, medians.", "",
            *table(["loop", "stall % median [min, max]", "goal %", "met", "batches/s",
                    "wait at an epoch's first batch", "wait within an epoch"], bounds)]


def pipeline_batch(r: dict[str, Any], plots: Path) -> list[str]:
    p, sy = r["parameters"], r["systems"]
    rows = [[s["batch_size"], spread(s["images_per_s"]),
             f"{s['after_first_images_per_s']['median']:.0f}",
             f"{s['first_batch_s']['median']:.2f}"] for s in sy.values()]
    ratio = r["ratio_big_over_small"]
    return [f"The held-out image pipeline (JPEG ~375x500 → random resized crop 224 → flip → "
            f"uint8; {r['data']['images']} images), one server of {p['workers']} workers, one "
            "RemoteLoader per batch size (default settings), alternate epochs, medians of "
            f"{p['repeats']} repeats; images/s over a whole epoch from `iter()`. Batch "
            f"{p['big']} / batch {p['small']}: **{ratio:.2f}** (goal >= {r['goal']}; met: "
            f"{_meets(ratio >= r['goal'])}).", "",
            *table(["batch", "images/s median [min, max]", "after the first batch",
                    "first batch s"], rows)]


def gpu(r: dict[str, Any], plots: Path) -> list[str]:
    s = r["cpu_standin"]
    cap = s["capacity_batches_per_s"]
    rows = [[f"{row['burn_ms']:g}" + (" (counting only)" if not row["burn_ms"] else ""),
             f"{min(cap, 1000 / row['burn_ms']) if row['burn_ms'] else cap:.1f}",
             spread(row["batches_per_s"], ".2f"), f"{row['over_counting']:.2f}",
             f"{100 * row['stall']['median']:.1f}" if row["burn_ms"] else "-",
             f"{row['client_cpu_ms_per_batch']['median']:.1f}",
             f"{row['trainer_cpu_ms_per_batch']['median']:.1f}"] for row in s["rows"]]
    out = [_gpu_part(r), "",
           "CPU stand-in for the trainer's step (runs everywhere): the fleet dataset (32 KiB "
           f"samples, 2 ms asleep each) from a server of {s['workers']} workers (capacity "
           f"{s['capacity_batches_per_s']:.1f} batches/s), batch 256 (8 MiB), "
           "`shared_memory=False`; each step burns a fixed CPU time on the trainer's main "
           "thread (numpy work), as a busy training process does between batches. Delivered "
           "batches/s against a consumer that only counts (the same server, the same run), "
           "and the trainer process's CPU per batch beyond the burn: what the client's path "
           "costs it. Bound: the lower of the server's capacity and what the step alone "
           "allows. On this machine the burn takes one of the cores that the client's threads "
           "and the server's front end share (between machines the front end runs elsewhere), "
           "so part of a shortfall here is the machine's core count.", "",
           *table(["burn ms/step", "bound batches/s", "batches/s median [min, max]",
                   "of counting only",
                   "stall %", "client CPU ms/batch", "trainer CPU ms/batch"], rows)]
    return out


def _gpu_part(r: dict[str, Any]) -> str:
    if "skipped" in r:
        return (f"GPU part not measured: {r['skipped']}. No GPU machine was at hand for this "
                "run; on one, `python -m benchmarks --only gpu` measures a ResNet-50 (bf16, "
                "channels_last) on the image pipeline at batch 256 (ceiling, stoker with its "
                "server on cores [T, N) and the trainer on [0, T), DataLoader on the trainer's "
                "cores and on all cores, and what the server delivers to a consumer that only "
                "counts) and a GPT-2-small-sized model against nanoGPT's `get_batch`.")
    lines = [f"On {r['device']} (torch {r['machine'].get('torch', '?')}):", ""]
    names = {"ceiling": "ceiling (batch already on the GPU)", "stoker": "stoker",
             "stoker_counting": "stoker, consumer that only counts",
             "dataloader_trainer_cores": "DataLoader, trainer's cores",
             "dataloader_all_cores": "DataLoader, all cores",
             "nanogpt_get_batch": "nanoGPT get_batch"}
    for part, unit in (("images", "images/s"), ("tokens", "tokens/s")):
        x = r[part]
        rows = [[names[k], f"{m['items_per_s']:.0f}", f"{m.get('of_ceiling', 1.0):.2f}",
                 f"{100 * m['stall']:.1f}", f"{m['node_cpu_s_per_1000']:.2f}"]
                for k, m in x.items() if isinstance(m, dict) and "items_per_s" in m]
        where = (f"trainer on cores [0, {x['trainer_cores']}), server on {x['server_cores']}"
                 if part == "images" else f"{x['parameters'] / 1e6:.0f}M parameters, "
                 f"{x['batch_size']} x {x['seq_len']} tokens a step")
        lines += [f"{part} ({where}):", "",
                  *table(["system", unit, "of ceiling", "stall %",
                          "trainer node CPU s / 1,000"], rows)]
    return "\n".join(lines)


def fastest_tcp(r: dict[str, Any]) -> list[str]:
    """The wire section's ratios against the fastest raw TCP receiver (tcp_limit.py)."""
    limit = r.get("tcp_limit")
    if not limit or "fastest_tcp_gb_per_s" not in r["sizes"][0]:  # a run from before it
        return []
    labels = {"tcp": "raw TCP (4 MiB a call)", "stoker": "stoker gRPC",
              "stoker_sock": "stoker default (data socket)", "stoker_tls": "stoker TLS",
              "stoker_shm": "stoker shm"}
    rows = [[f"{s['size'] / 2**20:g} MiB", spread(s["fastest_tcp_gb_per_s"], ".2f"),
             *[f"{s['ratio_over_fastest_tcp'][k]:.2f}" for k in labels]] for s in r["sizes"]]
    return [f"Against the fastest raw TCP receiver Python has here: tcp_limit.py tries chunk "
            "sizes of 256 KiB to 16 MiB a call (sender and receiver alike), `recv_into`, "
            "`recv_into` with MSG_WAITALL and `recvmsg_into`, and SO_RCVBUF left to the "
            f"kernel or 8 MiB ({limit['bytes_per_way'] >> 20} MiB a way, medians of "
            f"{limit['repeats']}, before the server starts). Fastest: **{limit['label']}**, "
            f"{limit['best']['gb_per_s']:.2f} GB/s in the search. That way is measured again "
            "beside each batch size in every repeat (the same load, the same bytes), and each "
            "path's GB/s is divided by its median there:", "",
            *table(["batch", "fastest way GB/s [min, max]", *labels.values()], rows)]


def trainer_cpu_steady(r: dict[str, Any]) -> list[str]:
    """The wire section's trainer CPU per GB in steady state: stoker's default path, numpy
    and torch output, against the raw receiver into one reused 4 MiB buffer."""
    sizes = [s for s in r["sizes"] if "ratio_client_cpu_steady_torch_over_tcp" in s]
    if not sizes:  # a run from before it was measured
        return []
    goal = {1 << 20: 2.0, 16 << 20: 1.5}
    rows = []
    for s in sizes:
        cpu = {k: s["systems"][k]["client_cpu_steady_s_per_gb"]["median"]
               for k in ("tcp", "stoker_sock", "stoker_torch")}
        limit = goal.get(s["size"])
        ratios = (s["ratio_client_cpu_steady_sock_over_tcp"],
                  s["ratio_client_cpu_steady_torch_over_tcp"])
        rows.append([f"{s['size'] / 2**20:g} MiB", f"{cpu['tcp']:.3f}",
                     f"{cpu['stoker_sock']:.3f}", f"{ratios[0]:.2f}",
                     f"{cpu['stoker_torch']:.3f}", f"{ratios[1]:.2f}",
                     f"<= {limit:g}x: {'yes' if max(ratios) <= limit else '**no**'}"
                     if limit else "-"])
    return ["The trainer's CPU seconds per GB received in steady state (clocks started once "
            "the first batch is handed over; medians of the repeats): stoker's default path "
            "(the data connection) with numpy and with torch output, against a raw receiver "
            "that `recv_into`s every batch into one reused 4 MiB buffer, in the same run. "
            "Goal: at most 1.5x at 16 MiB batches, 2x at 1 MiB.", "",
            *table(["batch", "raw TCP s/GB", "stoker numpy s/GB", "numpy / raw",
                    "stoker torch s/GB", "torch / raw", "goal met"], rows), ""]
