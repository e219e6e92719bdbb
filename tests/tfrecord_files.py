"""TFRecord and ArrayRecord files for the tests, written without TensorFlow: the framing by
hand (TensorFlow's record_writer: length, masked CRC32C, data, masked CRC32C), the Examples
with stoker's own message classes. TensorFlow's own writer is held against stoker in
tests/test_format_tfrecord.py (tests/tf_records.py)."""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path

from stoker.server.formats._example import messages
from stoker.server.formats.tfrecord import masked_crc


def frame(record: bytes) -> bytes:
    length = len(record).to_bytes(8, "little")
    return (length + masked_crc(length).to_bytes(4, "little") + record
            + masked_crc(record).to_bytes(4, "little"))


def example(**features: int | float | bytes | list) -> bytes:
    """A serialized tf.train.Example: ints -> int64_list, floats -> float_list, bytes ->
    bytes_list (a list: its values)."""
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
