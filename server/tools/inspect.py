"""`stoker datasets ADDRESS` and `stoker inspect ADDRESS DATASET`: look at what a running
server serves, from any machine that reaches it (the client side of stoker is used: numpy and
grpcio only, no Pillow, pyyaml or torch; the `--grid` picture is written by `write_png`)."""

from __future__ import annotations

import argparse
import struct
import sys
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from .connect import CONTACT_SECONDS, ContactError, add_security, first_contact, security


def datasets(args: argparse.Namespace) -> int:
    try:
        reply = first_contact(args.address, security(args), min(args.timeout, CONTACT_SECONDS))
    except (ContactError, ValueError) as e:
        print(e, file=sys.stderr)
        return 1
    lakes = any(d.fingerprint.snapshot for d in reply.datasets)  # a lake table's column
    print(f"{'dataset':<24}{'format':<14}{'samples':>12}" + ("  snapshot" if lakes else ""))
    for d in reply.datasets:
        print(f"{d.name:<24}{d.format:<14}{d.num_samples:>12}  {d.fingerprint.snapshot}".rstrip())
    return 0


def image_field(arr: np.ndarray) -> str | None:
    """'chw' or 'hwc' for a batch of RGB images, else None."""
    if arr.ndim == 4 and arr.shape[1] == 3:
        return "chw"
    if arr.ndim == 4 and arr.shape[3] == 3:
        return "hwc"
    return None


def clip_field(arr: np.ndarray) -> tuple[int, ...] | None:
    """The transpose that makes a batch of RGB clips [B, T, H, W, 3] (from tchw, cthw or
    thwc, as format: video lays them out), else None."""
    if arr.ndim != 5:
        return None
    if arr.shape[2] == 3:
        return (0, 1, 3, 4, 2)  # tchw
    if arr.shape[1] == 3:
        return (0, 2, 3, 4, 1)  # cthw
    if arr.shape[4] == 3:
        return (0, 1, 2, 3, 4)  # thwc
    return None


def label_field(batch: dict[str, np.ndarray]) -> str | None:
    """The field a tile's caption shows beside its sample index: `label` if there is one, else
    the first other integer field with one number per sample; None if there is none."""
    names = [k for k, v in batch.items() if k != "sample_index" and v.ndim == 1
             and np.issubdtype(v.dtype, np.integer)]
    return "label" if "label" in names else next(iter(names), None)


# -- captions: a 3x5 pixel font for the characters a caption uses -------------------------------
_GLYPHS = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111",
    "3": "111001111001111", "4": "101101111001001", "5": "111100111001111",
    "6": "111100111101111", "7": "111001010010010", "8": "111101111101111",
    "9": "111101111001111", ":": "000010000010000", "-": "000000111000000",
    " ": "000000000000000",
}
_FONT = {c: np.array([int(b) for b in bits], bool).reshape(5, 3) for c, bits in _GLYPHS.items()}
INK = (40, 40, 40)


def _scale(width: int) -> int:
    """Pixels per font pixel for tiles `width` wide: readable, and rarely wider than a tile."""
    return 1 if width < 64 else 2 if width < 160 else 3


def draw_text(out: np.ndarray, text: str, top: int, left: int, scale: int, width: int) -> None:
    """`text` (digits, ':', '-', ' ') into `out` at (top, left), cut at `width` pixels."""
    for i, ch in enumerate(text):
        glyph = np.kron(_FONT[ch], np.ones((scale, scale), bool))
        x = left + i * 4 * scale
        room = min(glyph.shape[1], left + width - x)
        if room <= 0:
            return
        region = out[top: top + glyph.shape[0], x: x + room]
        region[glyph[:, :room]] = INK


def grid(images: np.ndarray, layout: str, columns: int = 8,
         captions: list[str] | None = None) -> np.ndarray:
    """A batch of images as one uint8 HWC picture, `columns` wide, 2-pixel gaps; with
    `captions`, each tile has its caption in a strip under it. Float images (normalised) are
    stretched to 0..255 over the batch."""
    hwc = images.transpose(0, 2, 3, 1) if layout == "chw" else images
    if hwc.dtype != np.uint8:
        lo, hi = float(hwc.min()), float(hwc.max())
        hwc = ((hwc - lo) / ((hi - lo) or 1.0) * 255).round().astype(np.uint8)
    n, h, w, _ = hwc.shape
    scale = _scale(w)
    strip = 7 * scale if captions is not None else 0  # 5 rows of glyph, a row above, below
    cols = min(columns, n)
    rows = -(-n // cols)
    cell_h, cell_w = h + strip + 2, w + 2
    out = np.full((rows * cell_h - 2, cols * cell_w - 2, 3), 255, np.uint8)
    for i in range(n):
        r, c = divmod(i, cols)
        top, left = r * cell_h, c * cell_w
        out[top: top + h, left: left + w] = hwc[i]
        if captions is not None:
            draw_text(out, captions[i], top + h + scale, left, scale, w)
    return out


def write_png(path: Path, rgb: np.ndarray) -> None:
    """An 8-bit RGB PNG of an HWC uint8 array (zlib only: the client extra has no Pillow)."""
    h, w, _ = rgb.shape
    rows = np.concatenate([np.zeros((h, 1), np.uint8), rgb.reshape(h, w * 3)], axis=1)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))

    path.write_bytes(b"\x89PNG\r\n\x1a\n"
                     + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(rows.tobytes(), 6))
                     + chunk(b"IEND", b""))


def inspect(args: argparse.Namespace) -> int:
    from stoker.client import RemoteError, RemoteLoader

    try:
        sec = security(args)
        served = first_contact(args.address, sec, min(args.timeout, CONTACT_SECONDS))
        names = [d.name for d in served.datasets]
        if args.dataset not in names:
            print(f"{args.address}: NOT_FOUND: no dataset {args.dataset!r}; this server "
                  f"serves {', '.join(names)}", file=sys.stderr)
            return 1
        size = ({"batch_tokens": args.batch_tokens, "token_cost": args.token_cost}
                if args.batch_tokens else {"batch_size": args.batch_size})
        with RemoteLoader(args.address, args.dataset, **size, seed=args.seed,
                          shuffle=not args.no_shuffle, drop_last=args.drop_last,
                          rank=args.rank, world_size=args.world_size, output="numpy",
                          timeout=args.timeout, tls=sec.tls, token=sec.token,
                          snapshot=args.snapshot) as loader:
            info = loader.describe()
            batch: dict[str, Any] = loader.batch_at(args.epoch, args.index)
            sources = loader.provenance(args.epoch, args.index)
    except (ContactError, RemoteError, ValueError) as e:
        print(e, file=sys.stderr)
        return 1
    cut = (f"of up to {args.batch_tokens} tokens" if args.batch_tokens
           else f"of {args.batch_size}")
    snapshot = f", snapshot {info.fingerprint.snapshot}" if info.fingerprint.snapshot else ""
    print(f"{info.dataset}: format {info.format}{snapshot}, {info.num_samples} samples, "
          f"{info.batches_per_epoch} batches {cut} per epoch")
    print(f"\n{'field':<20}{'dtype':<10}{'per sample':<16}{'min':>12}{'max':>12}{'mean':>12}")
    for f in info.fields:
        arr = batch[f.name]
        lo, hi, mean = (float(arr.min()), float(arr.max()), float(arr.mean())) if arr.size \
            else (0.0, 0.0, 0.0)
        print(f"{f.name:<20}{f.dtype:<10}{list(f.shape)!s:<16}{lo:>12.4g}{hi:>12.4g}"
              f"{mean:>12.4g}")
    print(f"\nbatch {args.index} of epoch {args.epoch} (rank {args.rank} of "
          f"{args.world_size}, seed {args.seed}): samples {batch['sample_index'].tolist()}")
    print(f"\n{'row':>5}{'sample':>10}  source")
    for row, s in enumerate(sources):
        print(f"{row:>5}{s['sample_index']:>10}  {s['source'] or '(the format does not say)'}")
        parts = "  ".join(f"{k}={v}" for k, v in s.items()
                          if k not in ("sample_index", "source", "file"))
        if parts:  # the file is in the source already
            print(f"{'':>17}{parts}")
    if args.out:
        np.savez(args.out, **batch)
        print(f"\nwrote {args.out}: {', '.join(sorted(batch))} (numpy.load reads it)")
    if args.grid:
        return _save_grid(batch, args.grid)
    return 0


def _save_grid(batch: dict[str, np.ndarray], path: Path) -> int:
    name, layout = next(((k, f) for k, v in batch.items() if (f := image_field(v))),
                        (None, None))
    if name is None or layout is None:
        return _save_clips(batch, path)
    label = label_field(batch)
    captions = [str(i) if label is None else f"{i}:{batch[label][k]}"
                for k, i in enumerate(batch["sample_index"].tolist())]
    write_png(path, grid(batch[name], layout, captions=captions))
    under = "sample index" if label is None else f"sample index:{label}"
    print(f"wrote {path}: field {name!r}, {len(batch[name])} images, each captioned {under}")
    return 0


def _save_clips(batch: dict[str, np.ndarray], path: Path) -> int:
    """Each clip of the batch as one row of its frames; the first frame captioned with the
    sample index (and label), the others with their frame number."""
    name = next((k for k, v in batch.items() if clip_field(v)), None)
    if name is None:
        print("no image field (a batch of [3, H, W] or [H, W, 3]) or clip field ([T, 3, H, W],"
              " [3, T, H, W] or [T, H, W, 3]) to draw", file=sys.stderr)
        return 1
    clips = batch[name].transpose(clip_field(batch[name]))
    n, t = clips.shape[:2]
    label = label_field(batch)
    captions = []
    for k, i in enumerate(batch["sample_index"].tolist()):
        captions += [str(i) if label is None else f"{i}:{batch[label][k]}"]
        captions += [str(f) for f in range(1, t)]
    write_png(path, grid(clips.reshape(n * t, *clips.shape[2:]), "hwc", columns=t,
                         captions=captions))
    print(f"wrote {path}: field {name!r}, {n} clips of {t} frames, one clip per row")
    return 0


def add_commands(sub: Any) -> None:
    ds = sub.add_parser("datasets", help="list what a running server serves")
    ds.add_argument("address", help="host:port of a data server")
    ds.add_argument("--timeout", type=float, default=10.0)
    add_security(ds)
    ds.set_defaults(func=datasets)
    ins = sub.add_parser("inspect", help="one batch of a dataset: its fields, and where each "
                                         "of its samples comes from")
    ins.add_argument("address", help="host:port (or dns:///name:port) of data servers")
    ins.add_argument("dataset")
    ins.add_argument("--batch-size", type=int, default=16)
    ins.add_argument("--batch-tokens", type=int, metavar="N",
                     help="batches cut by tokens instead (RemoteLoader's batch_tokens)")
    ins.add_argument("--token-cost", default="tokens", choices=["tokens", "squares"])
    ins.add_argument("--seed", type=int, default=0)
    ins.add_argument("--epoch", type=int, default=0)
    ins.add_argument("--index", type=int, default=0, help="the batch's index in the epoch")
    ins.add_argument("--rank", type=int, default=0)
    ins.add_argument("--world-size", type=int, default=1)
    ins.add_argument("--no-shuffle", action="store_true", help="dataset order")
    ins.add_argument("--snapshot", metavar="ID",
                     help="a lake table's snapshot id or version (default: the server's pin, "
                          "else the current one)")
    ins.add_argument("--drop-last", action="store_true",
                     help="as RemoteLoader's default drop_last=True (here off by default: "
                          "every sample of a small dataset shows)")
    ins.add_argument("--out", type=Path, metavar="FILE.npz", help="save the batch's arrays")
    ins.add_argument("--grid", type=Path, metavar="FILE.png",
                     help="save the batch's images as one picture, each tile captioned with "
                          "its sample index and label (video clips: one row of frames each)")
    ins.add_argument("--timeout", type=float, default=30.0)
    add_security(ins)
    ins.set_defaults(func=inspect)
