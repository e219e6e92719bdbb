"""Records written and parsed by TensorFlow itself, for tests/test_format_tfrecord.py.

Run by the TensorFlow venv's python (.venv-tf, `make install-tf`; TensorFlow's pins live
apart from the dev venv's):

    .venv-tf/bin/python tests/tf_records.py OUT

writes into OUT, with `tf.io.TFRecordWriter` (`tf.train.Example`s of int64, float and JPEG
bytes features, the JPEGs made by `tf.io.encode_jpeg`):

    plain.tfrecord, gzip.tfrecord.gz, zlib.tfrecord.zz   the same N examples, 3 compressions
    context.tfrecord                                     SequenceExamples (context + lists)
    examples.array_record                                the same examples, by array_record's
                                                         ArrayRecordWriter
    parsed.json                                          per example, what
                                                         tf.io.parse_single_example returns
                                                         (bytes as hex), and the context
                                                         tf.io.parse_single_sequence_example
                                                         returns
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import tensorflow as tf
from array_record.python.array_record_module import ArrayRecordWriter

N = 12
SPEC = {
    "idx": tf.io.FixedLenFeature([], tf.int64),
    "label": tf.io.FixedLenFeature([], tf.int64),
    "box": tf.io.FixedLenFeature([4], tf.float32),
    "ids": tf.io.FixedLenFeature([2, 3], tf.int64),
    "image/encoded": tf.io.FixedLenFeature([], tf.string),
    "caption": tf.io.FixedLenFeature([], tf.string),
}
CONTEXT = {"idx": tf.io.FixedLenFeature([], tf.int64),
           "length": tf.io.FixedLenFeature([], tf.int64),
           "name": tf.io.FixedLenFeature([], tf.string)}


def ints(values: list[int]) -> tf.train.Feature:
    return tf.train.Feature(int64_list=tf.train.Int64List(value=values))


def floats(values: list[float]) -> tf.train.Feature:
    return tf.train.Feature(float_list=tf.train.FloatList(value=values))


def blobs(values: list[bytes]) -> tf.train.Feature:
    return tf.train.Feature(bytes_list=tf.train.BytesList(value=values))


def examples() -> list[bytes]:
    rng = np.random.default_rng(42)
    out = []
    for i in range(N):
        h, w = 24 + 4 * (i % 3), 32 - 2 * (i % 4)
        pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        jpeg = tf.io.encode_jpeg(pixels, quality=90).numpy()
        features = {"idx": ints([i]), "label": ints([i % 5 - 2**40]),
                    "box": floats((rng.random(4) * 3 - 1).tolist()),
                    "ids": ints([i * 10 + k for k in range(6)]),
                    "image/encoded": blobs([jpeg]),
                    "caption": blobs([("cat ü " * i).encode()])}
        out.append(tf.train.Example(features=tf.train.Features(feature=features))
                   .SerializeToString())
    return out


def sequence_examples() -> list[bytes]:
    out = []
    for i in range(N):
        context = tf.train.Features(feature={"idx": ints([i]), "length": ints([i + 1]),
                                             "name": blobs([f"seq{i}".encode()])})
        lists = tf.train.FeatureLists(feature_list={"tokens": tf.train.FeatureList(
            feature=[ints([t]) for t in range(i + 1)])})
        out.append(tf.train.SequenceExample(context=context, feature_lists=lists)
                   .SerializeToString())
    return out


def plain(value: tf.Tensor) -> object:
    value = value.numpy()
    if isinstance(value, bytes):
        return value.hex()
    return value.tolist()


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    records = examples()
    for name, compression in [("plain.tfrecord", None), ("gzip.tfrecord.gz", "GZIP"),
                              ("zlib.tfrecord.zz", "ZLIB")]:
        with tf.io.TFRecordWriter(str(out / name), options=compression) as writer:
            for r in records:
                writer.write(r)
    sequences = sequence_examples()
    with tf.io.TFRecordWriter(str(out / "context.tfrecord")) as writer:
        for r in sequences:
            writer.write(r)
    writer = ArrayRecordWriter(str(out / "examples.array_record"), "group_size:4")
    for r in records:
        writer.write(r)
    writer.close()
    # What TensorFlow reads back: from the files (its reader checks the CRCs), not the list.
    parsed = [{k: plain(v) for k, v in tf.io.parse_single_example(r, SPEC).items()}
              for r in tf.data.TFRecordDataset(str(out / "gzip.tfrecord.gz"),
                                               compression_type="GZIP")]
    context = [{k: plain(v) for k, v in
                tf.io.parse_single_sequence_example(r, context_features=CONTEXT)[0].items()}
               for r in tf.data.TFRecordDataset(str(out / "context.tfrecord"))]
    (out / "parsed.json").write_text(json.dumps({"examples": parsed, "context": context}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
