"""The tf.data service section of docs/benchmarks.md (benchmarks/tfdata_service.py's JSON):
stoker against tf.data service and plain tf.data on the same pipeline and cores, and what
the ratios say, whichever way they fall."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from _measure import TRANSPORT_LABELS
from _page import plt, save, spread, table

LABELS = {"stoker": "stoker, W worker processes",
          "tf_service": "tf.data service, dispatcher + W workers (parallel_epochs)",
          "tf_local": "tf.data in the trainer process, W threads"}


def _ms(s: dict[str, Any], key: str) -> float:
    return float(s[key]["median"])


def tfdata(r: dict[str, Any], plots: Path) -> list[str]:
    p, d = r["parameters"], r["data"]
    lines = [f"The image pipeline from TFRecord files ({d['images']} photos as 500x375 JPEGs, "
             f"`tf.train.Example`s in {d['files']} files; random resized crop 224 → flip → "
             f"uint8 HWC; batch {p['batch_size']}), on the same cores, alternating systems "
             f"within each repeat, medians of {p['repeats']} repeats (min, max) after a "
             "warm-up pass of each. stoker: one server of W worker processes (`format: "
             "tfrecord`, `transforms:`), one RemoteLoader, batches through "
             f"{TRANSPORT_LABELS[p['transport']]}. tf.data service "
             f"(TensorFlow {r['machine'].get('tensorflow', '?')}): a dispatcher and W worker "
             "processes on loopback, the pipeline as TensorFlow's docs write it "
             "(`sample_distorted_bounding_box` → `decode_and_crop_jpeg` → "
             "`random_flip_left_right` → `resize`; benchmarks/tfdata_peer.py), one thread "
             "each (`private_threadpool_size=1`), `processing_mode=\"parallel_epochs\"`, one "
             "consumer. tf.data: the same pipeline in the consumer, W threads. CPU per image "
             "is counted over the timed window from /proc: serving side (stoker's server and "
             "workers; the dispatcher and workers) and trainer side (the consuming process).",
             ""]
    if "skipped_peers" in r:
        lines += [f"TensorFlow was not measured: {r['skipped_peers']}.", ""]
    lines += _table(r["sweep"])
    series: dict[str, list[Any]] = {}
    for s in r["sweep"]:
        for name in LABELS:
            if name in s:
                series.setdefault(name, []).append((s["workers"], s[name]["images_per_s"]))
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for name, pts in series.items():
        ax.errorbar([w for w, _ in pts], [x["median"] for _, x in pts],
                    yerr=[[x["median"] - x["min"] for _, x in pts],
                          [x["max"] - x["median"] for _, x in pts]],
                    marker="o", capsize=4, label=LABELS[name])
    ax.set_xlabel("workers W (tf.data: threads)")
    ax.set_ylabel("images/s (median, min-max)")
    ax.set_xticks(sorted({s["workers"] for s in r["sweep"]}))
    ax.legend(fontsize=7)
    lines += [save(fig, plots, "tfdata.png"), ""]
    lines += _verdict(r["sweep"], "")
    if "large" in r:
        big = r["large"]
        lines += [f"**The large set**: {big['data']['images']} photos of 1.92 and 3.15 MP "
                  "(1600x1200 and 2048x1536, q90, made as the set above), the same pipeline "
                  "and systems, where decoding at a DCT scale matters most.", "",
                  *_table(big["sweep"]), "",
                  *_verdict(big["sweep"], "on the large set ")]
    lines += _WHY
    return lines


def _table(sweep: list[dict[str, Any]]) -> list[str]:
    """One row per (W, system) of a sweep."""
    rows = []
    for s in sweep:
        for name in LABELS:
            if name not in s:
                continue
            server, trainer = (_ms(s[name], "server_cpu_ms_per_image"),
                               _ms(s[name], "trainer_cpu_ms_per_image"))
            ratio = s["stoker_over"].get(name)
            rate = s[name]["images_per_s"]["median"]
            rows.append([s["workers"], LABELS[name], spread(s[name]["images_per_s"]),
                         f"{ratio:.2f}x" if ratio else "", f"{server:.2f}", f"{trainer:.2f}",
                         f"{server + trainer:.2f}", f"{1000 / (server + trainer):.0f}",
                         f"{rate * (server + trainer) / 1000:.2f}",
                         f"{s[name]['other_cores_busy']['median']:.1f}"])
    return table(["W", "system", "images/s median [min, max]", "stoker / it",
                  "serving CPU ms/image", "trainer CPU ms/image", "total CPU ms/image",
                  "images per CPU-second", "cores it got", "the host's other cores busy"], rows)


def _verdict(sweep: list[dict[str, Any]], where: str) -> list[str]:
    """What the figures say, from the largest W where every system ran."""
    full = [s for s in sweep if all(n in s for n in LABELS)]
    if not full:
        return []
    s = full[-1]
    w = s["workers"]
    cpu = {n: _ms(s[n], "server_cpu_ms_per_image") + _ms(s[n], "trainer_cpu_ms_per_image")
           for n in LABELS}
    serving = {n: _ms(s[n], "server_cpu_ms_per_image") for n in ("stoker", "tf_service")}
    svc, loc = s["stoker_over"]["tf_service"], s["stoker_over"]["tf_local"]
    got = {n: s[n]["images_per_s"]["median"] * cpu[n] / 1000 for n in LABELS}
    ahead = [LABELS[n] for n, x in (("tf_service", svc), ("tf_local", loc)) if x < 1]
    out = [f"At W={w} {where}: stoker's images/s are **{svc:.2f}x** tf.data service's and "
           f"**{loc:.2f}x** plain tf.data's. Per image, stoker spends "
           f"{cpu['stoker']:.2f} CPU ms in all (serving {serving['stoker']:.2f}), tf.data "
           f"service {cpu['tf_service']:.2f} (serving {serving['tf_service']:.2f}), plain "
           f"tf.data {cpu['tf_local']:.2f}: stoker's cost per core is "
           f"{cpu['stoker'] / cpu['tf_local']:.2f}x plain tf.data's and "
           f"{cpu['stoker'] / cpu['tf_service']:.2f}x the service's. In their timed "
           f"windows stoker's processes got {got['stoker']:.2f} cores, the service's "
           f"{got['tf_service']:.2f}, plain tf.data's {got['tf_local']:.2f} (the other "
           "systems' processes, idle meanwhile, used "
           f"{max(s[n]['bystanders_cores_busy']['median'] for n in LABELS):.2f} at most).",
           ""]
    out += [f"Ahead on this row: {', '.join(ahead)}." if ahead else
            "Stoker is ahead of both on this row.", ""]
    return out


_WHY = [
    "What each side does per image. tf.data: `decode_and_crop_jpeg` decodes the crop's rows "
    "and columns alone (libjpeg-turbo's cropped scanline decode), then `resize` is plain "
    "bilinear (no antialiasing). stoker: the same libjpeg-turbo cropped decode "
    "(stoker.server._jpeg, server/images.py), at 1/2, 1/4 or 1/8 DCT scale where the box is at "
    "least twice the output on both sides, then an area-average resample (antialiased) with the "
    "flip fused; the image decode's CPU alone is in `python benchmarks/decode.py` (the limit "
    "rows: libjpeg-turbo's full and cropped decode). Both pay the entropy decode of every row "
    "above the crop (a JPEG without restart markers cannot skip it), which is most of a "
    "q90 photo's decode. Images/s are the cores each system got in its timed window "
    "times the images it makes per CPU second: CPU ms per image is the work per image. "
    "tf.data service pays for serialising each batch into its gRPC response; stoker frames raw "
    "tensors. What stoker does that the service in `parallel_epochs` does not: each worker of "
    "the service walks its own epoch, so the trainer sees every image W times per epoch in no "
    "fixed order; stoker delivers each sample once per epoch, in an order that is a function of "
    "(seed, epoch), resumable mid-epoch and unchanged when servers fail (docs/reliability.md).",
    ""]
