"""`tf.train.Example` and `SequenceExample` records read without TensorFlow, and the
`features:` of `format: tfrecord` and `format: array_record` applied to them.

The messages are TensorFlow's (`tensorflow/core/example/{example,feature}.proto`, public and
frozen for years); their descriptor is built here in code and parsed by the protobuf runtime
stoker already depends on (its C parser), so nothing is generated and no TensorFlow is
imported. A `map<string, Feature>` is a repeated entry message on the wire (key = 1,
value = 2): it is declared as one, and the last entry of a key wins, as in a map.

A feature's `kind` is the list it must hold (`int64_list`, `float_list`, `bytes_list`), its
`shape` how many values (their product; `[]`: one), as `tf.io.FixedLenFeature` reads it:
int64 -> int64, float -> float32 (TensorFlow's FloatList), bytes -> one value, decoded by
`decode:` (image, utf8, npy) or kept as raw bytes (uint8[max_bytes] and `<name>_length`).
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable
from functools import cache
from typing import Any

import numpy as np

from ..images import Prefix, image_pipeline
from ..sources import ObjectInfo, Storage

_PACKAGE = "stoker.tfexample"
_LISTS = {"bytes": "bytes_list", "float": "float_list", "int64": "int64_list"}


@cache
def messages() -> dict[str, Any]:
    """The message classes, by TensorFlow's names (Example, SequenceExample, Feature...)."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    F = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(name="stoker/tfexample.proto", package=_PACKAGE,
                                              syntax="proto3")

    def message(name: str, *fields: tuple[str, int, int, int, str]) -> None:
        m = file.message_type.add(name=name)
        for fname, number, label, ftype, type_name in fields:
            f = m.field.add(name=fname, number=number, label=label, type=ftype)
            if type_name:
                f.type_name = f".{_PACKAGE}.{type_name}"

    rep, opt = F.LABEL_REPEATED, F.LABEL_OPTIONAL
    msg = F.TYPE_MESSAGE
    message("BytesList", ("value", 1, rep, F.TYPE_BYTES, ""))
    message("FloatList", ("value", 1, rep, F.TYPE_FLOAT, ""))  # proto3: packed, either read
    message("Int64List", ("value", 1, rep, F.TYPE_INT64, ""))
    message("Feature", ("bytes_list", 1, opt, msg, "BytesList"),
            ("float_list", 2, opt, msg, "FloatList"), ("int64_list", 3, opt, msg, "Int64List"))
    message("FeatureEntry", ("key", 1, opt, F.TYPE_STRING, ""),
            ("value", 2, opt, msg, "Feature"))
    message("Features", ("feature", 1, rep, msg, "FeatureEntry"))
    message("FeatureList", ("feature", 1, rep, msg, "Feature"))
    message("FeatureListEntry", ("key", 1, opt, F.TYPE_STRING, ""),
            ("value", 2, opt, msg, "FeatureList"))
    message("FeatureLists", ("feature_list", 1, rep, msg, "FeatureListEntry"))
    message("Example", ("features", 1, opt, msg, "Features"))
    message("SequenceExample", ("context", 1, opt, msg, "Features"),
            ("feature_lists", 2, opt, msg, "FeatureLists"))
    # The oneof of Feature: a Feature with two lists set is read as the last one, as protobuf
    # does for a oneof; without the oneof the parser would keep both.
    feature = file.message_type[3]
    feature.oneof_decl.add(name="kind")
    for f in feature.field:
        f.oneof_index = 0
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return {m.name: message_factory.GetMessageClass(pool.FindMessageTypeByName(
        f"{_PACKAGE}.{m.name}")) for m in file.message_type}


def parse_features(record: bytes, sequence: bool) -> dict[str, Any]:
    """The features of a serialized Example (or a SequenceExample's context): key -> Feature.
    Raises ValueError for bytes that are not one."""
    from google.protobuf.message import DecodeError

    kinds = messages()
    msg = kinds["SequenceExample" if sequence else "Example"]()
    try:
        msg.ParseFromString(record)
    except DecodeError as e:
        raise ValueError(f"not a serialized tf.train.{type(msg).__name__}: {e}") from None
    features = msg.context if sequence else msg.features
    return {entry.key: entry.value for entry in features.feature}


class RecordBytes:
    """One output field made of bytes (a raw record, or a bytes feature): decoded as an image,
    npy, or kept as bytes with their length; immutable once made."""

    def __init__(self, name: str, cfg: Any) -> None:
        self.name = name
        self.decode = cfg.decode
        self.max_bytes = cfg.max_bytes
        self.pipeline = image_pipeline(cfg) if cfg.decode == "image" else None

    def output_names(self) -> list[str]:
        if self.pipeline is not None:
            return self.pipeline.output_names(self.name)
        return [self.name] if self.decode == "npy" else [self.name, f"{self.name}_length"]


class Feature(RecordBytes):
    """One output field read from one feature of a record; immutable once made."""

    def __init__(self, name: str, cfg: Any) -> None:
        super().__init__(name, cfg)
        self.key = cfg.key or name
        self.kind = cfg.kind
        self.shape = tuple(cfg.shape)
        self.count = int(np.prod(self.shape)) if self.shape else 1

    def output_names(self) -> list[str]:
        if self.kind == "bytes" or self.pipeline is not None:
            return super().output_names()
        return [self.name]

    def values(self, features: dict[str, Any]) -> Any:
        """The feature's list of values, checked for kind and count."""
        if self.key not in features:
            have = ", ".join(sorted(features)) or "none"
            raise ValueError(f"feature {self.key!r} is missing (the record has: {have})")
        feature = features[self.key]
        held = feature.WhichOneof("kind")
        want = _LISTS[self.kind]
        if held != want:
            raise ValueError(f"feature {self.key!r} is a {held or 'empty Feature'}, "
                             f"the config says kind {self.kind} ({want})")
        values = getattr(feature, want).value
        if len(values) != self.count:
            raise ValueError(f"feature {self.key!r} has {len(values)} values; shape "
                             f"{list(self.shape)} needs {self.count}")
        return values

    def write(self, out: dict[str, Any], features: dict[str, Any] | None,
              rng: np.random.Generator, index: int, prefix: Prefix | None = None) -> None:
        """Field(s) of sample `index` into `out`. `prefix`: an image's cached prefix (then
        `features` may be None)."""
        if prefix is not None:
            assert self.pipeline is not None
            self.pipeline.write(out, self.name, None, rng, index, prefix)
            return
        assert features is not None
        values = self.values(features)
        if self.kind == "int64":
            out[self.name] = np.array(values, np.int64).reshape(self.shape)
        elif self.kind == "float":
            out[self.name] = np.array(values, np.float32).reshape(self.shape)
        else:
            write_bytes(self, out, bytes(values[0]), rng, index)


def write_bytes(field: Any, out: dict[str, Any], data: bytes, rng: np.random.Generator,
                index: int) -> None:
    """A bytes value as `field.decode` says (image, npy, utf8; None: raw bytes), where
    `field` has name, decode, max_bytes and pipeline."""
    name = field.name
    if field.pipeline is not None:
        field.pipeline.write(out, name, data, rng, index, None)
    elif field.decode == "npy":
        out[name] = np.load(io.BytesIO(data), allow_pickle=False)
    else:  # utf8: cut at a character boundary; raw: cut; both zero-padded, as jsonl does
        if field.decode == "utf8":
            data = data.decode("utf-8")[: field.max_bytes].encode("utf-8")
            if len(data) > field.max_bytes:
                data = data[: field.max_bytes].decode("utf-8", "ignore").encode("utf-8")
        else:
            data = data[: field.max_bytes]
        text = np.zeros(field.max_bytes, np.uint8)
        text[: len(data)] = np.frombuffer(data, np.uint8)
        out[name] = text
        out[f"{name}_length"] = np.int64(len(data))


def write_example(fields: list[Feature], prefixes: list[Any], record: Callable[[], bytes],
                  sequence: bool, out: dict[str, Any], rng: np.random.Generator,
                  index: int) -> dict[str, Any]:
    """Each field of sample `index`'s serialized Example written into `out`; the record is
    read (`record()`) and parsed only when some field's prefix is not cached. ValueError
    naming the field that fails."""
    features = None
    if any(p is None for p in prefixes):
        features = parse_features(record(), sequence)
    for field, prefix in zip(fields, prefixes, strict=True):
        try:
            field.write(out, features, rng, index, prefix)
        except Exception as e:
            raise ValueError(f"field {field.name!r}: {e}") from e
    return out


def check_names(fields: list[Any]) -> None:
    names = [n for f in fields for n in f.output_names()]
    if len(set(names)) != len(names):
        raise ValueError(f"output field names collide: {sorted(names)}")


def record_files(storage: Storage, pattern: str | None, named: re.Pattern[str],
                 what: str) -> list[ObjectInfo]:
    """The files of a record format: those `pattern` matches, or with no pattern those whose
    name `named` matches (in any folder; `what` says which, for the error)."""
    infos = storage.list(pattern)
    if pattern is None:
        infos = [o for o in infos if named.search(o.key.rsplit("/", 1)[-1])]
    if not infos:
        raise ValueError(f"{storage.url}: no files match {pattern or what + ' (in any folder)'!r}")
    return infos
