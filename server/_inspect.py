"""`stoker datasets ADDRESS` and `stoker inspect ADDRESS DATASET`: look at what a running
server serves, from any machine that reaches it (the client side of stoker is used)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np


def datasets(args: argparse.Namespace) -> int:
    import grpc

    from stoker.client._channel import ChannelMaker
    from stoker.v1 import stoker_pb2 as pb
    from stoker.v1 import stoker_pb2_grpc as pb_grpc

    try:
        tls, token = _security(args)
        channel = ChannelMaker(tls, token)(args.address, [])
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    try:
        with channel:
            reply = pb_grpc.DataServiceStub(channel).ListDatasets(pb.ListDatasetsRequest(),
                                                                  timeout=args.timeout)
    except grpc.RpcError as e:
        print(f"{args.address}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    print(f"{'dataset':<24}{'format':<14}{'samples':>12}")
    for d in reply.datasets:
        print(f"{d.name:<24}{d.format:<14}{d.num_samples:>12}")
    return 0


def image_field(arr: np.ndarray) -> str | None:
    """'chw' or 'hwc' for a batch of RGB images, else None."""
    if arr.ndim == 4 and arr.shape[1] == 3:
        return "chw"
    if arr.ndim == 4 and arr.shape[3] == 3:
        return "hwc"
    return None


def grid(images: np.ndarray, layout: str, columns: int = 8) -> np.ndarray:
    """A batch of images as one uint8 HWC picture, `columns` wide, 2-pixel gaps. Float images
    (normalised) are stretched to 0..255 over the batch."""
    hwc = images.transpose(0, 2, 3, 1) if layout == "chw" else images
    if hwc.dtype != np.uint8:
        lo, hi = float(hwc.min()), float(hwc.max())
        hwc = ((hwc - lo) / ((hi - lo) or 1.0) * 255).round().astype(np.uint8)
    n, h, w, _ = hwc.shape
    cols = min(columns, n)
    rows = -(-n // cols)
    out = np.full((rows * (h + 2) - 2, cols * (w + 2) - 2, 3), 255, np.uint8)
    for i in range(n):
        r, c = divmod(i, cols)
        out[r * (h + 2): r * (h + 2) + h, c * (w + 2): c * (w + 2) + w] = hwc[i]
    return out


def inspect(args: argparse.Namespace) -> int:
    from stoker.client import RemoteError, RemoteLoader

    try:
        tls, token = _security(args)
        with RemoteLoader(args.address, args.dataset, batch_size=args.batch_size, seed=args.seed,
                          shuffle=not args.no_shuffle, drop_last=False, output="numpy",
                          timeout=args.timeout, tls=tls, token=token) as loader:
            info = loader.describe()
            loader.set_epoch(args.epoch)
            batch: dict[str, Any] = next(iter(loader))
    except (RemoteError, ValueError) as e:
        print(e, file=sys.stderr)
        return 1
    print(f"{info.dataset}: format {info.format}, {info.num_samples} samples, "
          f"{info.batches_per_epoch} batches of {args.batch_size} per epoch")
    print(f"\n{'field':<20}{'dtype':<10}{'per sample':<16}{'min':>12}{'max':>12}{'mean':>12}")
    for f in info.fields:
        arr = batch[f.name]
        lo, hi, mean = (float(arr.min()), float(arr.max()), float(arr.mean())) if arr.size \
            else (0.0, 0.0, 0.0)
        print(f"{f.name:<20}{f.dtype:<10}{list(f.shape)!s:<16}{lo:>12.4g}{hi:>12.4g}"
              f"{mean:>12.4g}")
    print(f"\nbatch 0 of epoch {args.epoch}: samples {batch['sample_index'].tolist()}")
    if args.grid:
        name = next((k for k, v in batch.items() if image_field(v)), None)
        if name is None:
            print("no image field (a batch of [3, H, W] or [H, W, 3]) to draw", file=sys.stderr)
            return 1
        from PIL import Image

        Image.fromarray(grid(batch[name], image_field(batch[name]))).save(args.grid)
        print(f"wrote {args.grid}: field {name!r}, {len(batch[name])} images")
    return 0


def _security(args: argparse.Namespace) -> tuple[Any, str | None]:
    """RemoteLoader's `tls` and `token` from the command line (the token from a file, else
    $STOKER_TOKEN: never an argument, which other users of the machine can read in ps)."""
    token = None
    if args.token_file is not None:
        try:
            token = args.token_file.read_text().strip()
        except OSError as e:
            raise ValueError(f"--token-file {args.token_file}: {e.strerror}") from None
    files = {"ca": args.tls_ca, "cert": args.tls_cert, "key": args.tls_key,
             "server_name": args.tls_server_name}
    files = {k: str(v) for k, v in files.items() if v is not None}
    return (files or args.tls), token


def _add_security(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--token-file", type=Path, metavar="FILE",
                        help="the bearer token (default: $STOKER_TOKEN)")
    parser.add_argument("--tls", action="store_true", help="TLS, checked against system roots")
    parser.add_argument("--tls-ca", type=Path, metavar="PEM", help="TLS, checked against this CA")
    parser.add_argument("--tls-cert", type=Path, metavar="PEM", help="client certificate (mTLS)")
    parser.add_argument("--tls-key", type=Path, metavar="PEM", help="its private key")
    parser.add_argument("--tls-server-name", metavar="NAME",
                        help="the name the server's certificate must carry")


def add_commands(sub: Any) -> None:
    ds = sub.add_parser("datasets", help="list what a running server serves")
    ds.add_argument("address", help="host:port of a data server")
    ds.add_argument("--timeout", type=float, default=10.0)
    _add_security(ds)
    ds.set_defaults(func=datasets)
    ins = sub.add_parser("inspect", help="fields and a summary of one batch of a dataset")
    ins.add_argument("address", help="host:port (or dns:///name:port) of data servers")
    ins.add_argument("dataset")
    ins.add_argument("--batch-size", type=int, default=16)
    ins.add_argument("--seed", type=int, default=0)
    ins.add_argument("--epoch", type=int, default=0)
    ins.add_argument("--no-shuffle", action="store_true", help="dataset order")
    ins.add_argument("--grid", type=Path, metavar="FILE.png",
                     help="save the batch's images as one picture")
    ins.add_argument("--timeout", type=float, default=30.0)
    _add_security(ins)
    ins.set_defaults(func=inspect)
