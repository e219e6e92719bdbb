"""docs/benchmarks.md, generated from the JSON the scenarios wrote (python -m benchmarks).

Every figure on the page comes from a results/*.json file; nothing is typed by hand. A
scenario without its JSON gets a line saying so. Plots are PNG files next to the page
(docs/benchmarks/), drawn with matplotlib (the `bench` extra).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _measure import TRANSPORT_LABELS, transport_of
from _page import mib as _mib
from _page import plt
from _page import save as _save
from _page import spread as _spread
from _page import table as _table
from report_fleet import fastest_tcp, trainer_cpu_steady
from scenarios import SCENARIOS, Scenario

Section = Callable[[dict[str, Any], Path], list[str]]


def _plot_name(stem: str, parameters: dict[str, Any]) -> str:
    """pipeline.png for the default (shared memory) run, pipeline-socket.png for another."""
    transport = transport_of(parameters)
    return f"{stem}.png" if transport == "shm" else f"{stem}-{transport}.png"


def pipeline(r: dict[str, Any], plots: Path) -> list[str]:
    labels = {"dataloader": "torch DataLoader", "stateful": "torchdata StatefulDataLoader",
              "stoker": "stoker", "stoker_uint8": "stoker, uint8 + client normalize"}
    rows, series, legend = [], {}, dict(labels)
    for s in r["sweep"]:
        spdl = s.get("spdl", {})  # SPDL's thread counts, in the block it ran beside
        ratios = {**s["ratio_images_per_s"], **spdl.get("ratio_images_per_s", {})}
        for name in [*labels, *spdl.get("ratio_images_per_s", {})]:
            if name not in s:
                continue
            label = labels.get(name) or _spdl_label(name, spdl["best"])
            ratio = ratios.get(name)
            rows.append([s["workers"], label, _spread(s[name]["images_per_s"]),
                         f"{ratio:.2f}x" if ratio else "",
                         f"{s[name]['cpu_ms_per_batch']['median']:.1f}"])
            if name in labels or name == spdl["best"]:  # the plot: SPDL's best only
                legend[name] = label
                series.setdefault(name, []).append((s["workers"], s[name]["images_per_s"]))
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for name, pts in series.items():
        w = [p[0] for p in pts]
        med = [p[1]["median"] for p in pts]
        err = [[p[1]["median"] - p[1]["min"] for p in pts],
               [p[1]["max"] - p[1]["median"] for p in pts]]
        ax.errorbar(w, med, yerr=err, marker="o" if len(pts) > 1 else "D", capsize=4,
                    label=legend[name])
    ax.set_xlabel("worker processes W (SPDL: threads in the training process, all cores)")
    ax.set_ylabel("images/s (median, min-max)")
    ax.set_xticks(sorted({s["workers"] for s in r["sweep"]}))
    ax.legend()
    ax.grid(alpha=0.3)
    p = r["parameters"]
    return [f"{r['data']['images']} {_image_set(r['data'])} → random resized crop 224 → flip → "
            f"normalize → float32 CHW, batch {p['batch_size']}, {p['repeats']} repeats per "
            f"system; stoker batches via {TRANSPORT_LABELS[transport_of(p)]}"
            f"{_ran(r['sweep'], transport_of(p))}.", "", *_pipeline_systems(r), "",
            *_table(["W", "system", "images/s median [min, max]", "vs DataLoader",
                     "CPU ms/batch, all processes"], rows),
            _spdl_note(r), "", _save(fig, plots, _plot_name("pipeline", p)), ""]


def _image_set(data: dict[str, Any]) -> str:
    """What the pipeline run's images were: its JSON says since the photographs came in."""
    return {"photos": "real photographs as 500x375 JPEGs (q90; benchmarks/_data.py)",
            "--data-dir": "JPEGs from --data-dir"}.get(
                data.get("set", ""), "synthetic JPEGs ~375x500 (gradient plus noise)")


def _pipeline_systems(r: dict[str, Any]) -> list[str]:
    """What each system in the pipeline run does, one line each (the DataLoader peer as the
    run's JSON records it)."""
    if r.get("dataloader_peer") == "pillow-draft":
        dataset = ("the Dataset a careful user writes with Pillow and torch, torchvision's "
                   "RandomResizedCrop / RandomHorizontalFlip / ToTensor / Normalize step by "
                   "step: the box drawn from the file's header, `Image.draft` for libjpeg's "
                   "DCT-scaled decode wherever the box is at least twice 224 on both sides "
                   "(never at 500x375: 375 < 448), then the bilinear resize (antialiased, "
                   "as Pillow shrinks) reading the box from the decoded image")
    else:
        dataset = ("torchvision's Pillow path written out: each image decoded whole and "
                   "`convert(\"RGB\")`ed, cropped, bilinear resize, flip, ToTensor, Normalize")
    return [f"- **torch DataLoader**: W persistent worker processes (W = 0: the training "
            f"process itself) running {dataset}.",
            "- **torchdata StatefulDataLoader**: the same Dataset and workers in the "
            "resumable DataLoader (its `state_dict` bookkeeping on top).",
            "- **stoker**: one server of W worker processes runs the same steps as "
            "`transforms:` (server/images.py: the JPEG decoded for the crop's box and "
            "resampled into the batch), read by one RemoteLoader. **stoker, uint8 + client "
            "normalize**: the server sends uint8 pixels, RemoteLoader normalises them in "
            "the trainer (counted)."]


def _ran(blocks: list[dict[str, Any]], transport: str) -> str:
    """What the loaders' stats() said carried their batches, where the run recorded it."""
    ran = sorted({t for b in blocks for t in b.get("transport_ran", {}).values()})
    if not ran:
        return (" (the path that ran was not recorded: on one host a run from before "
                "`--transport shm` turned the data connection off may have used it)"
                if transport == "shm" else "")
    return f" (`stats()[\"transport\"]`: {', '.join(ran)})"


def _spdl_label(name: str, best: str) -> str:
    t = int(name.removeprefix("spdl_t"))
    return f"SPDL, {t} thread{'s' * (t > 1)}" + (" (best)" if name == best else "")


def _spdl_note(r: dict[str, Any]) -> str:
    """How SPDL ran in this pipeline run, and its best thread count against the others."""
    plan = r.get("spdl", {"skipped": "this run predates the SPDL peer"})
    if "skipped" in plan:
        return f"SPDL not measured: {plan['skipped']}."
    cores = r["machine"]["cpus_usable"]
    where = (", where every system has all cores" if plan["at_workers"] >= cores else
             f" (fewer workers than the {cores} cores: SPDL's threads may use them all)")
    short = {"dataloader": "DataLoader", "stateful": "StatefulDataLoader", "stoker": "stoker",
             "stoker_uint8": "stoker uint8"}
    against = ", ".join(f"{short[n]} {x:.2f}x" for n, x in plan["others_over_best"].items())
    return (f"SPDL {plan['version']} (benchmarks/spdl_peer.py: its thread pipeline, FFmpeg "
            "decode with a crop/scale/flip filter graph, `aggregate`, one conversion and "
            "normalisation per batch) runs on threads of the training process, so it is "
            f"measured beside W={plan['at_workers']}{where}, at "
            f"{'/'.join(map(str, plan['threads']))} threads. Its best, "
            f"{_spdl_label(plan['best'], '')} at {plan['images_per_s']:.0f} images/s, against "
            f"the others there (their images/s / SPDL's): {against}.")


def trainer_cpu(r: dict[str, Any], plots: Path) -> list[str]:
    rows = []
    for s in r["sweep"]:
        if not s.get("trainer_cpu_vs_dataloader_node"):
            continue
        dl = s["dataloader"]["cpu_ms_per_batch_by_role"]
        node = dl["trainer"] + dl["loader workers"]
        for name, share in s["trainer_cpu_vs_dataloader_node"].items():
            client = s[name]["cpu_ms_per_batch_by_role"]["trainer"]
            rows.append([s["workers"], name, f"{client:.1f}", f"{node:.1f}", f"{share:.1%}"])
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    ax.barh([f"W={row[0]} {row[1]}" for row in rows], [float(row[4][:-1]) for row in rows])
    ax.set_xlabel("% of DataLoader's training-node CPU per batch")
    ax.grid(alpha=0.3, axis="x")
    return ["From the pipeline run: CPU the training process spends per batch with stoker's "
            "client, against DataLoader's main process plus its W workers (all on the training "
            "node).", "",
            *_table(["W", "stoker system", "client ms/batch", "DataLoader node ms/batch",
                     "share"], rows),
            _save(fig, plots, _plot_name("trainer-cpu", r["parameters"])), ""]


def wire(r: dict[str, Any], plots: Path) -> list[str]:
    rows, tls_rows, xs = [], [], []
    ys: dict[str, list[float]] = {"tcp": [], "tls": [], "stoker": [], "stoker_sock": [],
                                  "stoker_torch": [], "stoker_tls": [], "stoker_shm": [],
                                  "memcpy": []}
    for s in r["sizes"]:
        sy = s["systems"]
        rows.append([f"{s['size'] / 2**20:g} MiB", f"{sy['tcp']['gb_per_s']['median']:.2f}",
                     f"{sy['stoker']['gb_per_s']['median']:.2f}",
                     f"{s['ratio_stoker_over_tcp']:.2f}",
                     f"{sy['stoker_sock']['gb_per_s']['median']:.2f}"
                     if "stoker_sock" in sy else "",
                     f"{s['ratio_stoker_sock_over_tcp']:.2f}" if "stoker_sock" in sy else "",
                     f"{sy['stoker_shm']['gb_per_s']['median']:.2f}"
                     if "stoker_shm" in sy else "",
                     f"{s['ratio_stoker_shm_over_tcp']:.2f}" if "stoker_shm" in sy else "",
                     f"{sy['memcpy']['gb_per_s']['median']:.1f}"])
        if "stoker_tls" in sy:  # results from before TLS was measured lack these
            cpu = {k: sy[k]["client_cpu_s_per_gb"]["median"]
                   for k in ("tcp", "tls", "stoker_sock", "stoker_tls")}
            tls_rows.append([f"{s['size'] / 2**20:g} MiB",
                             f"{sy['tls']['gb_per_s']['median']:.2f}",
                             f"{sy['stoker_tls']['gb_per_s']['median']:.2f}",
                             f"{s['ratio_stoker_tls_over_tls']:.2f}",
                             f"{cpu['tcp']:.2f}", f"{cpu['stoker_sock']:.2f}",
                             f"{s['ratio_client_cpu_sock_over_tcp']:.2f}",
                             f"{cpu['tls']:.2f}", f"{cpu['stoker_tls']:.2f}",
                             f"{s['ratio_client_cpu_tls_over_tls']:.2f}"])
        xs.append(s["size"])
        for k in ys:
            if k in sy:
                ys[k].append(sy[k]["gb_per_s"]["median"])
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for k, v in ys.items():
        if len(v) == len(xs):
            ax.plot(xs, v, marker="o", label=k)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch bytes")
    ax.set_ylabel("GB/s into client memory")
    ax.legend()
    ax.grid(alpha=0.3)
    out = ["Ready batches into client memory (numpy): stoker through gRPC on loopback, with "
           "a data socket (payloads on TCP beside gRPC), through shared memory (same host), a "
           "raw TCP stream between two Python processes, and memcpy.", "",
           *_table(["batch", "raw TCP GB/s", "stoker gRPC GB/s", "gRPC / TCP",
                    "stoker data socket GB/s", "socket / TCP", "stoker shm GB/s",
                    "shm / TCP", "memcpy GB/s"], rows), ""]
    if tls_rows:
        out += ["With TLS: the default path to a server with `server.tls` against a raw TLS "
                "socket between two Python processes; and the trainer process's CPU seconds "
                "per GB received over whole epochs (the first batch's start included), stoker's "
                "default path beside raw TCP's receiver and stoker TLS beside raw TLS's.", "",
                *_table(["batch", "raw TLS GB/s", "stoker TLS GB/s", "stoker TLS / raw TLS",
                         "trainer CPU s/GB: raw TCP", "stoker default", "default / TCP",
                         "raw TLS", "stoker TLS", "TLS / raw TLS"], tls_rows), ""]
    return [*out, *trainer_cpu_steady(r), *fastest_tcp(r), _save(fig, plots, "wire.png"), ""]


def stall(r: dict[str, Any], plots: Path) -> list[str]:
    p = r["parameters"]
    names = {"sync": "sync", "dataloader": f"DataLoader(W={p['workers']})", "stoker": "stoker"}
    rows = [[f"{row['data_ms_per_batch']:g}", *[
        f"{row[n]['step_ms']['median']:.1f} ({row[n]['step_over_compute']:.3f}x), wait "
        f"{row[n]['wait_ms']['median']:.2f}" for n in names]] for row in r["costs"]]
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    costs = [row["data_ms_per_batch"] for row in r["costs"]]
    for n, label in names.items():
        ax.plot(costs, [row[n]["step_ms"]["median"] for row in r["costs"]], marker="o",
                label=label)
    ax.axhline(p["compute_ms"], color="grey", ls="--", label="compute only")
    ax.set_xlabel("data cost per batch, ms of CPU")
    ax.set_ylabel("step time, ms (median)")
    ax.legend()
    ax.grid(alpha=0.3)
    return [f"The loop of shared/seeds/000_*: each step takes a batch, then 'computes' for "
            f"{p['compute_ms']:g} ms (a sleep: the accelerator's time). Step time in ms (x the "
            "compute time) and the median wait for data.", "",
            *_table(["data ms/batch", *names.values()], rows), _save(fig, plots, "stall.png"), ""]


def startup(r: dict[str, Any], plots: Path) -> list[str]:
    rows = [[name, _spread(s, ".3f")] for name, s in r["summary"].items()]
    fig, ax = plt.subplots(figsize=(6.4, 3.0))
    ax.barh(list(r["summary"]), [s["median"] for s in r["summary"].values()])
    ax.set_xlabel("seconds to the first batch (median)")
    ax.grid(alpha=0.3, axis="x")
    plot = _save(fig, plots, "startup.png")
    return ["Seconds from creating the loader to holding the first batch (stoker: against a "
            f"running server; its own start, {r['server_start_s']:.2f} s, is paid once).", "",
            *_table(["loader", "seconds median [min, max]"], rows), plot, ""]


def memory(r: dict[str, Any], plots: Path) -> list[str]:
    s = r["summary"]
    rows = [[who, key, _mib(v["first"]), _mib(v["last"]), _mib(v["peak"]), f"{v['growth']:+.2%}"]
            for who in ("server", "client") for key, v in s[who].items()]
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    for who in ("server", "client"):
        ax.plot([x["batch"] for x in r["samples"]],
                [x[who]["RssAnon"] / 2**20 for x in r["samples"]], label=f"{who} RssAnon")
    ax.set_xlabel("batches")
    ax.set_ylabel("MiB")
    ax.legend()
    ax.grid(alpha=0.3)
    return [f"{r['parameters']['batches']} batches; growth from batch {s['from_batch']} to "
            f"{s['to_batch']}.", "",
            *_table(["process", "measure", "first MiB", "last MiB", "peak MiB", "growth"], rows),
            _save(fig, plots, "memory_prefix_cache.png" if r["parameters"].get("prefix_cache")
                  else "memory.png"), *_prefix_bounds(s), ""]


def _prefix_bounds(s: dict[str, Any]) -> list[str]:
    """With the prefix cache: each tier's peak against its bound, and the batch segments'."""
    if "prefix_memory" not in s:
        return []
    return ["", *_table(["shared memory / disk", "peak MiB", "bound MiB"], [
        [name, _mib(s[key]["peak"]), _mib(s[key]["bound"]) if "bound" in s[key] else "-"]
        for key, name in (("prefix_memory", "prefix cache, memory tier (/dev/shm)"),
                          ("prefix_disk", "prefix cache, disk tier"),
                          ("segments", "batch segments (/dev/shm)"))])]


def scale(r: dict[str, Any], plots: Path) -> list[str]:
    rows = [[f"1 server x {x['workers']} worker{'s' * (x['workers'] > 1)}",
             _spread(x["images_per_s"]),
             f"{x['efficiency']:.2f}"] for x in r["workers"]]
    rows += [[f"{x['servers']} server{'s' * (x['servers'] > 1)} x 1 worker",
              _spread(x["images_per_s"]),
              f"{x['efficiency']:.2f}"] for x in r["servers"]]
    per = r["per_worker_images_per_s"]
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    for key, label in (("workers", "1 server, W workers"), ("servers", "S servers x 1 worker")):
        ax.plot([x[key] for x in r[key]], [x["images_per_s"]["median"] for x in r[key]],
                marker="o", label=label)
    n = [x["workers"] for x in r["workers"]]
    ax.plot(n, [per * k for k in n], ls="--", color="grey", label="linear")
    ax.set_xlabel("processes")
    ax.set_ylabel("images/s")
    ax.set_xticks(n)
    ax.legend()
    ax.grid(alpha=0.3)
    plot = _save(fig, plots, "scale.png")
    return ["The image pipeline (uint8 out), read by one RemoteLoader.", "",
            *_table(["servers", "images/s median [min, max]", "efficiency"], rows), plot, "",
            f"Sizing model: a trainer consuming R images/s needs about R / (r x c x u) CPU "
            f"nodes of c cores, r the rate of one worker process (here {per:.0f} images/s for "
            "this pipeline) and u the utilisation to plan for (0.8 leaves room for the front "
            "end and spikes). Example: 8 GPUs at 2,500 images/s each need 20,000 / "
            f"({per:.0f} x 32 x 0.8) = {20000 / (per * 32 * 0.8):.1f} nodes of 32 cores.", ""]


def s3(r: dict[str, Any], plots: Path) -> list[str]:
    rows = []
    for fmt, f in r["formats"].items():
        for run, x in f["runs"].items():
            rows.append([fmt, run, _spread(x["samples_per_s"]),
                         f"{f['ratio_over_local'][run]:.2f}"])
    fig, ax = plt.subplots(figsize=(6.4, 3.0))
    ax.barh([f"{row[0]} {row[1]}" for row in rows], [float(row[3]) for row in rows])
    ax.set_xlabel("samples/s relative to local disk")
    ax.grid(alpha=0.3, axis="x")
    return ["The same dataset from local disk and from a loopback S3 endpoint (moto), with the "
            "disk cache cold and warm.", "",
            *_table(["format", "run", "samples/s median [min, max]", "/ local"], rows),
            _save(fig, plots, "s3.png"), ""]


def packing(r: dict[str, Any], plots: Path) -> list[str]:
    pk, sy = r["packing"], r["systems"]
    rows = [[name, _spread(s["rows_per_s"]), f"{s['tokens_per_s']['median'] / 1e6:.2f}"]
            for name, s in sy.items()]
    fig, ax = plt.subplots(figsize=(6.4, 2.4))
    ax.barh(list(sy), [s["tokens_per_s"]["median"] / 1e6 for s in sy.values()])
    ax.set_xlabel("M tokens/s served (median)")
    ax.grid(alpha=0.3, axis="x")
    plot = _save(fig, plots, "packing.png")
    return [f"format: text, seq_len {r['params']['seq_len']}: packing efficiency "
            f"{pk['packing_efficiency']:.5f}, {pk['cut_fraction']:.1%} of documents cut across "
            "rows; packed rows served against the flat `tokens` format.", "",
            *_table(["system", "rows/s median [min, max]", "M tokens/s"], rows), plot, ""]


def mixture(r: dict[str, Any], plots: Path) -> list[str]:
    sy, p = r["systems"], r["params"]
    rows = [[name, _spread(s["samples_per_s"]), f"{s['tokens_per_s']['median'] / 1e6:.2f}"]
            for name, s in sy.items()]
    weights = ", ".join(f"{k} {v}" for k, v in p["weights"].items())
    return [f"`format: mixture` of three `tokens` datasets (weights {weights}) against one "
            f"plain `tokens` dataset over the same files, seq_len {p['seq_len']}, batch "
            f"{p['batch_size']}, {p['workers']} server workers: mixture / plain samples/s "
            f"**{r['ratio_mix_over_plain']:.3f}** (goal >= 0.9).", "",
            *_table(["system", "samples/s median [min, max]", "M tokens/s"], rows)]


def token_budgets(r: dict[str, Any], plots: Path) -> list[str]:
    p, sy = r["params"], r["systems"]
    rows = [[f"batch_tokens={s['batch_tokens']}" if name == "tokens"
             else f"batch_size={s['batch_size']}", f"{s['padding_waste']:.1%}",
             f"{s['imbalance_median']:.1%} / {s['imbalance_p95']:.1%} / {s['imbalance_max']:.1%}",
             str(s["largest_padded_batch"]), _spread(s["real_tokens_per_s"])]
            for name, s in sy.items()]
    return [f"The same variable-length samples (log-normal lengths, {r['data']['samples']} "
            f"samples) over {p['world']} ranks, by token budget and by a fixed batch size of "
            "the same mean tokens: padding waste of the padded form, rank imbalance of real "
            "tokens per global step (median / p95 / max), the largest padded batch (slots).", "",
            *_table(["batches", "padding waste", "rank imbalance", "max slots",
                     "real tokens/s median [min, max]"], rows), ""]


def prefix_cache(r: dict[str, Any], plots: Path) -> list[str]:
    s, p = r["summary"], r["parameters"]
    labels = {"no_cache": "no cache, epoch 0", "cold": "prefix cache, epoch 0 (cold)",
              "warm": "prefix cache, epoch 1 (warm)"}
    rows = [[label, _spread(s[key], ".0f")] for key, label in labels.items()]
    return [f"The pipeline above ({p['images']} JPEGs ~375x500 -> random resized crop 224 -> "
            f"flip -> normalize), W={p['workers']}, with `cache.decoded_bytes`: epoch 0 decodes "
            "every JPEG and keeps its pixels, epoch 1 reads them (same server, same cores). "
            f"Warm / cold: {s['ratio']['median']:.2f}x (target >= 2.5x).", "",
            *_table(["run", "samples/s median [min, max]"], rows), "", *_against_spdl(r)]


def video(r: dict[str, Any], plots: Path) -> list[str]:
    p, share = r["parameters"], r.get("reference_share", {})
    if "targets" not in r:  # a result from before the per-core benchmark (issue 49)
        return ["Stale: this result predates the per-core benchmark against the careful peer "
                "(issue 49); rerun `python -m benchmarks --only video`.", ""]
    rows = []
    for s in r["summary"].values():
        rows.append([s["codec"], s["workers"], f"{1000 * s['peer_cpu_per_clip']['median']:.1f}",
                     f"{1000 * s['stoker_cpu_per_clip']['median']:.1f} (server "
                     f"{1000 * s['stoker_server_cpu_per_clip']['median']:.1f})",
                     f"**{s['per_core']['median']:.2f}x** [{s['per_core']['min']:.2f}, "
                     f"{s['per_core']['max']:.2f}] (target {r['targets'][s['codec']]}x)",
                     _spread(s["peer_clips_per_s"], ".1f"),
                     _spread(s["stoker_clips_per_s"], ".1f")])
    return [f"{p['videos']} videos (480x360, 30 fps, 6 s, GOP 48), half H.264 with B-frames "
            "(MP4), half VP9 (WebM, libvpx's good deadline); one random clip per "
            "video per epoch: 16 frames, every 2nd, 112x112 RGB, batch 8; "
            f"W={', '.join(str(w) for w in p['workers'])} workers each. Peer: a PyAV clip "
            "Dataset as PyAV's docs and a careful user write it: persistent DataLoader "
            "workers, FFmpeg's threads (`stream.thread_type = \"AUTO\"`), seek, decode, "
            "`frame.reformat(width=112, height=112, format=\"rgb24\")` (PyAV keeps that "
            "scaler per thread). Stoker: `format: video` with `size: 112`, one server, one "
            f"RemoteLoader. After a warm-up epoch, {p['epochs']} timed epochs per run, systems "
            f"alternating, medians of {p['repeats']} repeats. Per core: clips per CPU second "
            "of every process each system ran (the trainer and its DataLoader workers; the "
            "trainer and the server's whole tree), stoker's over the peer's. Targets: "
            f"{'met' if r['meets_target'] else 'NOT met'}.", "",
            *_table(["codec", "W", "peer CPU ms/clip", "stoker CPU ms/clip", "per core",
                     "peer clips/s", "stoker clips/s"], rows), *_video_load(r),
            "Where it comes from: stoker decodes from the keyframe before the clip to its last "
            "frame and no further, and skips what no kept frame refers to (FFmpeg's "
            "`skip_frame = NONREF` on frames it does not keep: H.264, HEVC); it opens a file "
            "without FFmpeg's probe decoding its first frames (the stream's header says what "
            "is needed; 2.8 ms of VP9 per clip); one scaler on one thread per worker, "
            "kept from frame to frame, resizing and converting to RGB in one pass; "
            "threads only where cores are spare (fewer workers than cores: a worker decodes a "
            "batch's clips on threads). " + _video_bound(share), ""]


def _video_load(r: dict[str, Any]) -> list[str]:
    """A note where the host was busy when the run started: clips/s then says which system's
    threads won more of the shared cores, not how fast either is; CPU per clip still holds."""
    machine = r.get("machine", {})
    load, cpus = machine.get("load_avg_at_start", [0])[0], machine.get("cpus_usable", 1)
    if load < cpus:
        return []
    return [f"The host was busy (load average {load:.1f} on {cpus} usable CPUs at the start): "
            "clips/s measures the share of the cores each system's threads won, not its speed; "
            "read CPU per clip.", ""]


def _video_bound(share: dict[str, float]) -> str:
    """What each codec lets skipping save: the share of its frames that are references."""
    if "vp9" not in share:
        return ""
    return (f"Where the codec bounds it: {100 * share.get('h264', 0):.0f}% of these H.264 "
            f"frames are references (decoded even when not kept), {100 * share['vp9']:.0f}% "
            "of the VP9 ones (libvpx makes every frame refresh a reference slot), so on VP9 "
            "nothing is skipped and both systems decode the same frames: the gain there is "
            "what surrounds the decoder (opening, scaling, threads' overhead), not the decode.")


def _against_spdl(r: dict[str, Any]) -> list[str]:
    """The runs above over SPDL's best in the pipeline scenario (same pipeline, machine and
    cores; write_report hands it over as `_spdl`), when that run measured SPDL."""
    spdl, s = r.get("_spdl"), r["summary"]
    if not spdl or "images_per_s" not in spdl:
        return []
    best = spdl["images_per_s"]
    runs = ", ".join(f"{label} {s[key]['median'] / best:.2f}x" for key, label in
                     (("no_cache", "no cache"), ("cold", "cold"), ("warm", "warm")))
    return [f"Against SPDL {spdl.get('version', '')}'s best in the pipeline scenario "
            f"({spdl['best']}: {best:.0f} images/s at W={spdl.get('at_workers', '?')}, the "
            f"same pipeline and cores; its own run): {runs} (goal for warm: >= 2x).", ""]


def _pct(x: float | None) -> str:
    return "" if x is None else f"{x:.1%}"


def _servers_axis(ax: Any, rows: list[dict[str, Any]]) -> None:
    """The server count as a step line on a right-hand axis of `ax`."""
    right = ax.twinx()
    right.step([b["t"] for b in rows], [b["servers"] for b in rows], where="mid", color="grey",
               ls="--", label="servers")
    right.set_ylabel("servers")
    right.set_ylim(0, max(b["servers"] for b in rows) + 1)
    right.set_yticks(range(0, max(b["servers"] for b in rows) + 2))


def elastic(r: dict[str, Any], plots: Path) -> list[str]:
    p, m, s, c = r["parameters"], r["model"], r["scripted"], r["control"]
    rows = [[ph["phase"], _pct(ph.get("stall")), f"{ph.get('step_ms', 0):.1f}",
             f"{ph.get('batches_per_s', 0):.1f}", f"{ph.get('samples_per_s', 0):.0f}",
             f"{ph['efficiency']:.2f}" if "efficiency" in ph else "",
             f"{ph['added_server_efficiency']:.2f}" if "added_server_efficiency" in ph else ""]
            for ph in s["phases"]]
    fig, axes = plt.subplots(2, 1, figsize=(6.4, 5.6), sharex=False)
    for ax, part, title in ((axes[0], s, "servers join, then one drains"),
                            (axes[1], c, f"stoker autoscale, target {p['target']:.0%}")):
        b = part["bins"]
        ax.plot([x["t"] for x in b], [100 * x["stall"] for x in b], label="stall %")
        ax.plot([x["t"] for x in b], [x["step_ms"] for x in b], label="step ms (median)")
        ax.axhline(p["compute_ms"], color="C1", lw=0.8, ls=":")
        ax.set_ylabel("stall %, step ms")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        _servers_axis(ax, b)
        ax.legend(loc="upper right", fontsize=8)
    axes[1].set_xlabel("seconds")
    for x in c["trace"]:
        if x["action"] != "hold":
            axes[1].axvline(x["t"], color="red", lw=0.6, alpha=0.5)
    trace = [[f"{x['t']:.0f}", x["servers"], _pct(x["stall"]), _pct(x["decided_on"]),
              x["action"], x["reason"]] for x in c["trace"] if x["action"] != "hold"]
    chk = [[part, r[part]["check"]["samples"], r[part]["check"]["lost"],
            r[part]["check"]["duplicated"], "yes" if r[part]["check"]["in_order"] else "NO"]
           for part in ("scripted", "control")]
    settled = c["settled_stall"]
    return [f"A trainer whose steps need more data than one server makes: it wants "
            f"{m['demand_batches_per_s']:.0f} batches/s ({p['compute_ms']:g} ms of compute a "
            f"step), one server of one worker makes {m['server_batches_per_s']:.1f} "
            f"({p['data_ms']:g} ms a batch of {p['batch_size']}, "
            + ("waiting: each server stands for a CPU node of its own" if p["work"] == "sleep"
               else "CPU work on this machine's cores") + "). It finds its servers through a "
            f"`dns:///` target re-resolved every {p['dns_refresh']:g} s by a resolver that "
            "reads an address file (`RemoteLoader(dns_refresh=..., resolver=...)`). Scripted: "
            f"a server joins every {p['phase_s']:g} s, then the first leaves (off the list "
            f"and SIGTERM: it drains). Phase figures leave out the first {r['settle_s']:g} s "
            "after each change. Efficiency: batches/s over (one server's x servers); per "
            "added server: the gain over one server's batches/s (a trainer that no longer "
            "waits can gain no more).", "",
            *_table(["servers", "stall", "step ms (median)", "batches/s", "samples/s",
                     "efficiency", "added server"], rows),
            *_table(["run", "samples", "lost", "duplicated", "in order"], chk),
            _save(fig, plots, "elastic.png"), "",
            f"Control loop (`stoker autoscale --target-stall {p['target']:g} --cooldown "
            f"{p['cooldown']:g} --window {p['window']:g}`): it ended at **{c['final_servers']} "
            f"servers** (from {c['converged_at_s']:.0f} s on; the demand/capacity model says "
            f"{m['fewest_servers']}), the trainer's stall since then "
            f"{_pct(settled) or 'n/a'}. Its decisions (every tick's row is in the JSON):", "",
            *_table(["s", "servers", "stall seen", "median judged", "action", "reason"],
                    trace)]


def sweep(r: dict[str, Any], plots: Path) -> list[str]:
    p = r["parameters"]
    reps = r["repeats"]

    def med(run: str, key: str) -> float:
        return float(sorted(x[run][key] for x in reps)[len(reps) // 2])

    last = reps[-1]["sweep"]["outcomes"]
    same = "yes" if not r["check_problems"] else "; ".join(r["check_problems"])
    rows = [["1 job", f"{med('lone', 'server_cpu_s'):.2f}",
             f"{med('lone', 'images_per_s_per_job'):.0f}"],
            [f"{p['jobs']} jobs at once", f"{med('sweep', 'server_cpu_s'):.2f}",
             f"{med('sweep', 'images_per_s_per_job'):.0f}"]]
    return [f"The image pipeline (JPEG ~375x500 -> random resized crop 224 -> flip -> "
            f"normalize, float32), {p['images']} images in batches of {p['batch_size']}, one "
            f"server of {p['workers']} workers, batches by {TRANSPORT_LABELS[p['transport']]}. "
            f"{p['jobs']} jobs with the same coordinates read an epoch at once, against one "
            "job alone on a server of the same config (a new epoch each repeat, so nothing is "
            "kept from the one before). Server CPU is the CPU time of the server's processes "
            f"(front end and workers) over the epoch: {p['jobs']} jobs / 1 job "
            f"**{_spread(r['cpu_ratio'], '.2f')}** (goal <= {r['goal']}). Every job's batches "
            f"identical to the lone job's: {same}. In the last repeat the server built "
            f"{last['built']:.0f} of the {r['batches_per_epoch']} batches an epoch asks for, "
            f"joined {last['joined']:.0f} requests to a build in flight and served "
            f"{last['cached']:.0f} from the batches it keeps (`cache.shared_batches`).", "",
            *_table(["run", "server CPU s (median)", "images/s per job (median)"], rows)]


def chat(r: dict[str, Any], plots: Path) -> list[str]:
    c, sy, p = r["corpus"], r["systems"], r["params"]
    rows = [[name, _spread(s["rows_per_s"], ".1f"),
             f"{1e3 * s['cpu_per_row_s']['median']:.3f}"] for name, s in sy.items()]
    fig, ax = plt.subplots(figsize=(6.4, 2.0))
    ax.barh(list(sy), [s["rows_per_s"]["median"] for s in sy.values()])
    ax.set_xscale("log")
    ax.set_xlabel(f"rows of {p['seq_len']} tokens per second (median, log scale)")
    ax.grid(alpha=0.3, axis="x")
    plot = _save(fig, plots, "chat.png")
    return [f"`format: chat`: {c['conversations']} generated conversations rendered through a "
            "ChatML template with `{% generation %}` markers, masked and packed into rows of "
            f"{p['seq_len']} tokens (packing efficiency {c['packing_efficiency']:.4f}), served "
            f"by {p['workers']} server workers, against the same rendering, masking and "
            "packing (`apply_chat_template(..., return_assistant_tokens_mask=True)`, the same "
            f"rows) in a torch DataLoader with {p['workers']} workers on the same cores. The "
            "server renders once, at start "
            f"({r['start_s']:.1f} s; the DataLoader's length pass {r['peer_plan_s']:.1f} s); "
            "the DataLoader renders every epoch. stoker / DataLoader: rows/s "
            f"**{r['ratio_rows_per_s']:.1f}x** (goal >= 1.5x), trainer CPU per row "
            f"**{r['ratio_cpu_per_row']:.3f}x** (goal <= 0.1x).", "",
            *_table(["system", "rows/s median [min, max]", "trainer CPU ms/row"], rows),
            plot, ""]


def lockstep(r: dict[str, Any], plots: Path) -> list[str]:
    p, systems = r["parameters"], r["systems"]
    labels = {"bound": "same loop, data in hand (bound)", "stoker": "stoker RemoteLoader",
              "dataloader": "DataLoader, same total workers"}
    rows = [[labels.get(k, k), f"{v['steps_per_s']:.2f}",
             f"**{v['of_bound']:.3f}**" if v.get("of_bound") else "-", f"{v['stall']:.1%}",
             f"{v['wait_p50_ms']:.1f}", f"{v['wait_p99_ms']:.1f}",
             f"{v['warmup_s']:.2f}" if v.get("warmup_s") is not None else "-"]
            for k, v in systems.items()]
    warm = p.get("warmup_steps", 10)
    return [f"{p['ranks']} rank processes, each with its own loader, step together: take a "
            "batch, a barrier (every rank has its batch, as an all-reduce waits), then "
            f"{p['compute_ms']:g} ms of compute (a sleep). {p['servers']} servers of "
            f"{p['workers']} workers, samples of {p['sample_bytes'] // 1024} KiB taking "
            f"{p['sample_ms']:g} ms asleep (decode on CPU nodes this machine does not have"
            + (f"; slept {p['sleep_quantum_ms']:g} ms at a time, as a sleep costs this VM "
               "40-65 us of CPU that such nodes would not take from the ranks"
               if p.get("sleep_quantum_ms") else "") + "), "
            f"batch {p['batch_size']}, {p['steps']} timed steps after {warm} steps of start "
            "(every rank's window asked for at once; the servers catch up for about a second: "
            "their time is the start column). The bound is the "
            "same loop with a batch already in hand; DataLoader runs "
            f"{p['servers'] * p['workers'] // p['ranks']} workers per rank (the same total). "
            "The wait is per step and rank, batch and barrier together. This machine is "
            "shared: compare the ratios, measured in one run"
            + (f"; each system ran {p['repeats']} times, alternating with the others, each "
               "repeat against the bound of the same repeat, and the repeat with the median "
               "ratio is shown (every repeat's below)" if (p.get("repeats") or 1) > 1 else "")
            + ".", "",
            *_table(["system", "steps/s", "of bound", "stall", "p50 wait ms",
                     "p99 wait ms", f"start s ({warm} steps)"], rows),
            *_lockstep_repeats(systems),
            *_lockstep_cpu(systems),
            _lockstep_goal(systems, r["machine"]), ""]


def _lockstep_repeats(systems: dict[str, Any]) -> list[str]:
    """Each repeat's steps/s (and ratio to its bound), where there were several."""
    lines = [f"- {k}: " + ", ".join(
        f"{x['steps_per_s']:.2f}" + (f" ({x['of_bound']:.3f})" if x.get("of_bound") else "")
        for x in v["repeats"]) for k, v in systems.items() if len(v.get("repeats", [])) > 1]
    return ["Steps/s by repeat (of bound):", "", *lines, ""] if lines else []


def _lockstep_cpu(systems: dict[str, Any]) -> list[str]:
    """CPU ms per step, all ranks together, by process kind (results that have it)."""
    parts = ("ranks", "rank_children", "server_front", "server_workers", "total")
    rows = [[labels, *(f"{c.get(k, 0.0):.1f}" for k in parts)]
            for labels, c in ((k, v.get("cpu_ms_per_step") or {}) for k, v in systems.items())
            if c]
    if not rows:
        return []
    return ["CPU ms per step (user + system from /proc over rank 0's timed steps, every rank "
            "together): the rank processes (loader threads included), their children "
            "(DataLoader's workers), the servers' front ends and the servers' workers.", "",
            *_table(["system", "ranks", "rank children", "server front", "server workers",
                     "total"], rows),
            "CPUs kept busy, at each one's rate: " + ", ".join(
                f"{k} {v['cpu_ms_per_step']['total'] * v['steps_per_s'] / 1000:.2f}"
                for k, v in systems.items() if v.get("cpu_ms_per_step")) + ".", ""]


def _lockstep_goal(systems: dict[str, Any], machine: dict[str, Any]) -> str:
    """The goal (issue 41: stoker >= 0.95 of the bound, ahead of DataLoader), met or not."""
    ours = systems.get("stoker", {}).get("of_bound")
    theirs = systems.get("dataloader", {}).get("of_bound")
    if ours is None:
        return "stoker was not measured in this run."
    met = ours >= 0.95 and (theirs is None or ours > theirs)
    return (f"Goal: stoker >= 0.95 of the bound and ahead of DataLoader: "
            f"{'met' if met else '**not met**'} in this run ({ours:.3f}"
            + (" in the median repeat" if len(systems["stoker"].get("repeats", [])) > 1 else "")
            + (f" against DataLoader's {theirs:.3f}" if theirs is not None else "")
            + f", on {machine.get('cpus_usable', '?')} usable CPUs that the ranks, the "
              "servers' front ends and their workers all share).")


def seek(r: dict[str, Any], plots: Path) -> list[str]:
    p = r["params"]
    rows = [[f"tokens, budget {s['batch_tokens']}" if name == "tokens"
             else f"fixed, {s['batch_size']} a batch", f"{s['first_far_s']:.2f}",
             f"{s['near_s'] * 1e3:.2f}", f"{s['far_s'] * 1e3:.2f}", f"{s['far_over_near']:.2f}",
             f"{s['first_elastic_s']:.2f}", f"{s['elastic_far_s'] * 1e3:.2f}",
             s["epoch_of_far"]] for name, s in r["systems"].items()]
    return [f"`RemoteLoader.seek` to step {p['far']:,} against a step near the start, "
            f"{p['samples']:,} documents, medians of {p['repeats']}; elastic: a run saved at "
            "one world size resumed at the next. The first far seek on a fresh server makes "
            "what it needs (token budgets: the plans of the epochs before it); later ones are "
            "one request, not a replay.", "",
            *_table(["batches", "first far seek s", "near ms", "far ms", "far / near",
                     "first elastic s", "elastic ms", "epoch of the far step"], rows)]


def per_batch(r: dict[str, Any], plots: Path) -> list[str]:
    p = r["parameters"]
    rows = [[i, f"{x['batches_per_s']:.0f}", f"{x['front_us']:.0f}",
             " + ".join(f"{w:.0f}" for w in x["workers_us"]), f"{x['trainer_us']:.0f}",
             x["transport"]] for i, x in enumerate(r["repeats"])]
    return [f"Batches of {r['batch_size']} x {r['sample_bytes']:,} bytes "
            f"({p['size']:,} bytes) whose samples cost nothing to make, from one server of "
            f"{p['workers']} workers to one RemoteLoader told it is on another machine: CPU "
            "microseconds per batch of the front end (every thread), of each worker and of "
            "the trainer's process. No peer: a breakdown of the fixed cost per batch "
            "(the wire section is the comparison).", "",
            *_table(["repeat", "batches/s", "front end µs", "workers µs", "trainer µs",
                     "transport"], rows)]


def renderer(ref: str) -> Section:
    """A section's renderer from its "module:function" in benchmarks/scenarios.py."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def provenance_lines(scenario: Scenario, r: dict[str, Any]) -> list[str]:
    """Where a section's figures come from: the command, the commit, the machine, the peers."""
    params = r.get("parameters", r.get("params", {}))
    quick = bool(params.get("quick"))
    p = r.get("provenance") or {}
    command = p.get("command") or scenario.command(quick)
    small = " (quick mode: small settings, indicative only)" if quick else ""
    if not p.get("commit"):
        when = r.get("started") or p.get("started") or "at an unrecorded time"
        return [f"`{command}`{small}; run started {when}. Commit: not recorded (measured "
                "before results recorded their commit): older code, whatever `python -m "
                "benchmarks --stale` says of it.", ""]
    m = p["machine"]
    load = "/".join(f"{x:.2f}" for x in m["load_before"])
    dirty = (f", with {len(p['uncommitted'])} file(s) changed but not committed"
             if p.get("uncommitted") else "")
    peers = ", ".join(f"{k} {v}" for k, v in p.get("peers", {}).items())
    return [f"`{command}`{small}; run started {p['started']}. Commit `{p['commit'][:10]}` "
            f"({(p.get('commit_date') or '')[:10]}){dirty}; {m['cores']} cores "
            f"({m['cores_usable']} usable), {m['cpu']}, load {load} before the run (1, 5, "
            f"15 min); Python {m['python']}" + (f"; {peers}" if peers else "") + ".", ""]


def render(scenario: Scenario, r: dict[str, Any], plots: Path) -> list[str]:
    """The scenario's sections of the page from its results `r`, each with its provenance."""
    lines: list[str] = []
    for title, ref in scenario.sections:
        lines += [f"## {title}", "", *provenance_lines(scenario, r), *renderer(ref)(r, plots)]
    return lines


def write_report(results: Path, page: Path) -> Path:
    plots = page.parent / page.stem
    found = {p.stem: json.loads(p.read_text()) for p in sorted(results.glob("*.json"))}
    if "prefix_cache" in found and "pipeline" in found:  # compared with SPDL's best there
        found["prefix_cache"]["_spdl"] = found["pipeline"].get("spdl")
    lines = ["# Benchmarks", "",
             "Generated by `python -m benchmarks` from the JSON in `docs/benchmarks/results/` "
             "(the scenarios are declared in benchmarks/scenarios.py): every figure below was "
             "measured, side by side in one run per scenario, on the machine named under its "
             "section, at the commit named there. Machines differ and are noisy: compare "
             "ratios, not absolute rates, across machines. `python -m benchmarks --stale` "
             "lists the sections measured before the last change to the code they exercise.",
             "",
             "Peers: torch `DataLoader` and torchdata's `StatefulDataLoader` run the same "
             "pipelines; in the image pipeline, so does Meta's SPDL (its thread pipeline "
             "around `spdl.io`'s FFmpeg decoder and filter graphs, swept over its thread "
             "count). torchdata's nodes API is a composition layer over the same workers and "
             "is left out as a duplicate. Each section names the versions it ran.", ""]
    for scenario in SCENARIOS:
        r = found.get(scenario.name)
        if r is None:
            for title, _ in scenario.sections:
                lines += [f"## {title}", "", f"Not measured in this run (no {scenario.name}"
                          f".json in {results.name}/): `{scenario.command(False)}`.", ""]
            continue
        lines += render(scenario, r, plots)
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text("\n".join(lines).rstrip() + "\n")
    return page
