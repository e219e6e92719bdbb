"""TFRecord and ArrayRecord files for the tests, written two ways.

Without TensorFlow (imported by the tests): the framing by hand (TensorFlow's record_writer:
length, masked CRC32C, data, masked CRC32C), the Examples with stoker's own message classes:
`frame`, `example`, `write_tfrecord`, `write_array_record`.

By TensorFlow itself, held against stoker in tests/test_format_tfrecord.py: run by the
TensorFlow venv's python (.venv-tf, `make install-tf`; TensorFlow's pins live apart from the
dev venv's, and stoker need not be installed there):

    .venv-tf/bin/python tests/tfrecord_files.py OUT

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

Imports are inside the functions: each side runs without the other's packages.
"""

from __future__ import annotations

import gzip
import json
import sys
import zlib
from pathlib import Path
from typing import Any

import numpy as np


# -- without TensorFlow ------------------------------------------------------------------------
def frame(record: bytes) -> bytes:
    from stoker.server.formats.tfrecord import masked_crc

    length = len(record).to_bytes(8, "little")
    return (length + masked_crc(length).to_bytes(4, "little") + record
            + masked_crc(record).to_bytes(4, "little"))


def example(**features: int | float | bytes | list) -> bytes:
    """A serialized tf.train.Example: ints -> int64_list, floats -> float_list, bytes ->
    bytes_list (a list: its values)."""
    from stoker.server.formats._example import messages

    m = messages()
    ex = m["Example"]()
    for key, value in features.items():
        values = value if isinstance(value, list) else [value]
        entry = ex.features.feature.add(key=key)
        if isinstance(values[0], bytes):
            entry.value.bytes_list.value.extend(values)
        elif isinstance(values[0], float):
            entry.value.float_list.value.extend(values)
        else:
            entry.value.int64_list.value.extend(values)
    return ex.SerializeToString()


def write_tfrecord(path: Path, records: list[bytes], compression: str = "none") -> Path:
    data = b"".join(frame(r) for r in records)
    if compression == "gzip":
        data = gzip.compress(data)
    elif compression == "zlib":
        data = zlib.compress(data)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def write_array_record(path: Path, records: list[bytes]) -> Path:
    from array_record.python.array_record_module import ArrayRecordWriter

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = ArrayRecordWriter(str(path), "group_size:4")
    for r in records:
        writer.write(r)
    writer.close()
    return path


# -- by TensorFlow (.venv-tf) -------------------------------------------------------------------
N = 12


def _features(tf: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The Examples' features and the SequenceExamples' context, as tf.io parses them."""
    spec = {
        "idx": tf.io.FixedLenFeature([], tf.int64),
        "label": tf.io.FixedLenFeature([], tf.int64),
        "box": tf.io.FixedLenFeature([4], tf.float32),
        "ids": tf.io.FixedLenFeature([2, 3], tf.int64),
        "image/encoded": tf.io.FixedLenFeature([], tf.string),
        "caption": tf.io.FixedLenFeature([], tf.string),
    }
    context = {"idx": tf.io.FixedLenFeature([], tf.int64),
               "length": tf.io.FixedLenFeature([], tf.int64),
               "name": tf.io.FixedLenFeature([], tf.string)}
    return spec, context


def _tf_examples(tf: Any) -> tuple[list[bytes], list[bytes]]:
    """N Examples and N SequenceExamples, serialized by TensorFlow."""
    def ints(values: list[int]) -> Any:
        return tf.train.Feature(int64_list=tf.train.Int64List(value=values))

    def floats(values: list[float]) -> Any:
        return tf.train.Feature(float_list=tf.train.FloatList(value=values))

    def blobs(values: list[bytes]) -> Any:
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=values))

    rng = np.random.default_rng(42)
    examples, sequences = [], []
    for i in range(N):
        h, w = 24 + 4 * (i % 3), 32 - 2 * (i % 4)
        pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        jpeg = tf.io.encode_jpeg(pixels, quality=90).numpy()
        features = {"idx": ints([i]), "label": ints([i % 5 - 2**40]),
                    "box": floats((rng.random(4) * 3 - 1).tolist()),
                    "ids": ints([i * 10 + k for k in range(6)]),
                    "image/encoded": blobs([jpeg]),
                    "caption": blobs([("cat ü " * i).encode()])}
        examples.append(tf.train.Example(features=tf.train.Features(feature=features))
                        .SerializeToString())
    for i in range(N):
        context = tf.train.Features(feature={"idx": ints([i]), "length": ints([i + 1]),
                                             "name": blobs([f"seq{i}".encode()])})
        lists = tf.train.FeatureLists(feature_list={"tokens": tf.train.FeatureList(
            feature=[ints([t]) for t in range(i + 1)])})
        sequences.append(tf.train.SequenceExample(context=context, feature_lists=lists)
                         .SerializeToString())
    return examples, sequences


def _plain(value: Any) -> object:
    value = value.numpy()
    if isinstance(value, bytes):
        return value.hex()
    return value.tolist()


def write_with_tensorflow(out: Path) -> None:
    """The files listed in the module's doc, into `out` (TensorFlow's venv)."""
    import tensorflow as tf

    out.mkdir(parents=True, exist_ok=True)
    records, sequences = _tf_examples(tf)
    for name, compression in [("plain.tfrecord", None), ("gzip.tfrecord.gz", "GZIP"),
                              ("zlib.tfrecord.zz", "ZLIB")]:
        with tf.io.TFRecordWriter(str(out / name), options=compression) as writer:
            for r in records:
                writer.write(r)
    with tf.io.TFRecordWriter(str(out / "context.tfrecord")) as writer:
        for r in sequences:
            writer.write(r)
    write_array_record(out / "examples.array_record", records)
    # What TensorFlow reads back: from the files (its reader checks the CRCs), not the list.
    spec, context_spec = _features(tf)
    parsed = [{k: _plain(v) for k, v in tf.io.parse_single_example(r, spec).items()}
              for r in tf.data.TFRecordDataset(str(out / "gzip.tfrecord.gz"),
                                               compression_type="GZIP")]
    context = [{k: _plain(v) for k, v in
                tf.io.parse_single_sequence_example(r, context_features=context_spec)[0]
                .items()}
               for r in tf.data.TFRecordDataset(str(out / "context.tfrecord"))]
    (out / "parsed.json").write_text(json.dumps({"examples": parsed, "context": context}))


if __name__ == "__main__":
    write_with_tensorflow(Path(sys.argv[1]))
