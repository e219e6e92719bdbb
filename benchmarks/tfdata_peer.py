"""tf.data and tf.data service, the peer of benchmarks/tfdata_service.py. Runs in the
TensorFlow venv (.venv-tf, `make install-tf`), never imported by the main one.

    python tfdata_peer.py dispatcher                  # prints "READY <address>", serves
    python tfdata_peer.py worker --dispatcher ADDR    # prints "READY <address>", serves
    python tfdata_peer.py consume --files GLOB --batch-size B [--service ADDR] ...

`consume` reads commands on stdin, one a line: `epoch SEED` runs one pass of `--batches`
batches from a new iterator (a new tf.data service job), printing `timing` after the first
batch (the warm-up) and then `done {json}` with images/s and its own CPU seconds over the
timed batches; `quit` ends it. The parent snapshots every process's CPU at `timing` and
`done`, so that the servers' CPU is counted over the same window.

The pipeline, as TensorFlow's docs write ImageNet input (the official ResNet preprocessing):
parse_single_example -> sample_distorted_bounding_box (area 0.08-1, ratio 3/4-4/3, 10
attempts; the whole image when none fits) -> decode_and_crop_jpeg (only the crop's part of
the JPEG is decoded) -> random_flip_left_right -> resize to 224x224 (bilinear) -> uint8 ->
batch -> prefetch. With `--service` the dataset is distributed with
processing_mode="parallel_epochs": each worker runs the whole pipeline on the whole data.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import tensorflow as tf

SIZE = 224
FEATURES = {"image/encoded": tf.io.FixedLenFeature([], tf.string),
            "image/class/label": tf.io.FixedLenFeature([], tf.int64)}


def preprocess(record: tf.Tensor) -> dict[str, tf.Tensor]:
    parsed = tf.io.parse_single_example(record, FEATURES)
    jpeg = parsed["image/encoded"]
    shape = tf.io.extract_jpeg_shape(jpeg)
    begin, size, _ = tf.image.sample_distorted_bounding_box(
        shape, bounding_boxes=tf.constant([0.0, 0.0, 1.0, 1.0], shape=[1, 1, 4]),
        min_object_covered=0.1, aspect_ratio_range=(3 / 4, 4 / 3), area_range=(0.08, 1.0),
        max_attempts=10, use_image_if_no_bounding_boxes=True)
    y, x, _ = tf.unstack(begin)
    h, w, _ = tf.unstack(size)
    image = tf.io.decode_and_crop_jpeg(jpeg, tf.stack([y, x, h, w]), channels=3)
    image = tf.image.random_flip_left_right(image)
    image = tf.image.resize(image, [SIZE, SIZE], method="bilinear")
    image = tf.cast(tf.clip_by_value(tf.round(image), 0, 255), tf.uint8)
    return {"image": image, "label": parsed["image/class/label"]}


def dataset(files: list[str], batch_size: int, threads: int, seed: int) -> tf.data.Dataset:
    """Files interleaved, records shuffled in a window, the pipeline on `threads` threads."""
    ds = tf.data.Dataset.from_tensor_slices(files).shuffle(len(files), seed=seed)
    ds = ds.interleave(tf.data.TFRecordDataset, cycle_length=min(4, len(files)),
                       num_parallel_calls=1, deterministic=False)
    ds = ds.shuffle(256, seed=seed)
    ds = ds.map(preprocess, num_parallel_calls=threads, deterministic=False)
    ds = ds.batch(batch_size, drop_remainder=True).prefetch(2)
    options = tf.data.Options()
    # `threads` cores' worth: the same budget as a stoker worker process per core.
    options.threading.private_threadpool_size = threads
    options.autotune.enabled = False
    return ds.with_options(options)


def serve(kind: str, dispatcher: str | None) -> None:
    from tensorflow.data.experimental import service

    if kind == "dispatcher":
        server = service.DispatchServer(service.DispatcherConfig(port=0))
        address = server.target.split("://")[-1]
    else:
        server = service.WorkerServer(service.WorkerConfig(dispatcher_address=dispatcher,
                                                           port=0))
        address = "worker"
    print(f"READY {address}", flush=True)
    server.join()


def consume(args: argparse.Namespace) -> None:
    files = sorted(tf.io.gfile.glob(args.files))
    for line in sys.stdin:
        command = line.split()
        if not command or command[0] == "quit":
            return
        seed = int(command[1])
        ds = dataset(files, args.batch_size, args.threads, seed)
        if args.service:  # endless on the workers; this pass takes what it times
            ds = ds.repeat().apply(tf.data.experimental.service.distribute(
                processing_mode="parallel_epochs", service=f"grpc://{args.service}"))
        it = iter(ds)
        first = next(it)
        shape = [int(n) for n in first["image"].shape]
        print("timing", flush=True)
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(args.batches - 1):
            batch = next(it)
            _ = batch["image"].shape
        t1, c1 = time.perf_counter(), time.process_time()
        del it  # ends the service job: its workers stop
        n = (args.batches - 1) * args.batch_size
        print("done " + json.dumps({"images": n, "seconds": t1 - t0,
                                    "images_per_s": n / (t1 - t0), "trainer_cpu_s": c1 - c0,
                                    "shape": shape, "dtype": first["image"].dtype.name}),
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("role", choices=["dispatcher", "worker", "consume"])
    ap.add_argument("--dispatcher")
    ap.add_argument("--service", help="consume through the tf.data service at this address")
    ap.add_argument("--files")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--batches", type=int, default=32, help="per pass, the first untimed")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if args.role == "consume":
        consume(args)
    else:
        serve(args.role, args.dispatcher)


if __name__ == "__main__":
    main()
