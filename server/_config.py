"""The server's YAML config, validated with pydantic.

A bad config is reported as `config error in FILE: FIELD.PATH: what was expected` for each
problem, and the server exits non-zero before opening any port.
"""

from __future__ import annotations

import difflib
import os
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ByteSize,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

# Frames must stay well under the client's receive limit (see stoker.client).
MAX_FRAME_BYTES = 32 << 20


class ConfigError(Exception):
    """A config that cannot be served; the message names the file and the field path."""


# -- local paths: relative to the config file --------------------------------------------------
def _relative_to_config(v: Any, info: ValidationInfo) -> Any:
    """A local path as the config file means it: `~` expanded, then absolute, or relative to
    the file's folder (`base` in the validation context), not to the working directory.

    Without a `base` (a config built in code, not read from a file) the value is kept as
    given; so is anything but a string or path, for the field's own checks to name."""
    base = (info.context or {}).get("base")
    if base is None or not isinstance(v, str | os.PathLike):
        return v
    path = Path(v).expanduser()
    return str(path if path.is_absolute() else Path(base) / path)


# The marker of every local path field: a path field typed without it would be read relative
# to the working directory. It goes last in an Annotated so that it runs first: the field's
# other checks see the resolved path, and their errors show it.
RelativeToConfig = BeforeValidator(_relative_to_config)
ConfigPath = Annotated[Path, RelativeToConfig]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class S3Settings(_Strict):
    """How to reach S3 or an S3-compatible store (MinIO...). Credentials come from boto3's
    standard chain (environment, profile, instance role), never from this file."""

    endpoint_url: str | None = Field(None, description="e.g. http://minio:9000; None: AWS")
    region: str | None = None
    profile: str | None = Field(None, description="a named profile from ~/.aws/config")
    # Connections per worker process; None: enough for the prefetch and range threads.
    max_pool_connections: int | None = Field(None, ge=1, le=1024)
    connect_timeout: float = Field(10.0, gt=0)
    read_timeout: float = Field(60.0, gt=0)
    # botocore's retries: exponential backoff with jitter on throttling (503 SlowDown),
    # 5xx and dropped connections; `adaptive` also slows the client down when throttled.
    max_attempts: int = Field(10, ge=1, le=100)
    retry_mode: Literal["standard", "adaptive"] = "standard"
    # Objects larger than range_bytes are read as parallel ranged GETs of this size.
    range_bytes: ByteSize = Field(ByteSize(8 << 20), ge=1 << 20)
    range_concurrency: int = Field(8, ge=1, le=64)


class CacheSettings(_Strict):
    """The disk cache for remote objects: shared by a server's workers, kept across restarts."""

    dir: ConfigPath = Field(default_factory=lambda: Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "stoker")
    max_bytes: ByteSize = Field(ByteSize(20 << 30), ge=1 << 20, description="e.g. 50GiB")
    # Objects each worker fetches ahead of the batches that need them (the epoch's order is
    # known), at most this many bytes in flight.
    prefetch_bytes: ByteSize = Field(ByteSize(256 << 20), ge=0)
    # -- issue 17, the prefix cache (server/pool/prefix_cache.py): what each pipeline computes
    # before its first random step (decoded, resized pixels; a python dataset's `prepare`),
    # kept across epochs and jobs, shared by the workers. 0: none kept in memory.
    decoded_bytes: ByteSize = Field(ByteSize(0), ge=0, description="in /dev/shm, e.g. 8GiB")
    # Entries evicted from memory go to disk, up to spill_bytes (0: they are dropped).
    spill_bytes: ByteSize = Field(ByteSize(0), ge=0, description="e.g. 100GiB")
    spill_dir: ConfigPath | None = Field(None, description="local disk; default: dir/prefix")
    # -- issue 17, batches shared across jobs (server/front/shared_batches.py): requests in flight
    # for the same coordinates and batch index always wait for one build; a batch built is
    # also kept this many bytes of shared memory (at most 1/8 of /dev/shm) for this many
    # seconds, for the jobs of a sweep that ask for it a little later. 0 bytes: no keeping.
    shared_batches: ByteSize = Field(ByteSize(256 << 20), ge=0, description="e.g. 1GiB; 0: off")
    shared_seconds: float = Field(30.0, gt=0, le=3600)
    # -- end of "batches shared across jobs"


# fn(sample: dict of arrays, rng: numpy Generator) -> dict, applied to every sample after the
# format's own decoding and transforms; rng is seeded by (seed, epoch, sample index).
UserTransform = Field(None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$",
                      description='"module:callable", importable on the server')


def _local_root_exists(v: str) -> str:
    from .sources import split_source

    if not v.strip():  # not "the config's folder": an empty value is a mistake
        raise ValueError("empty: give a folder, a glob or an s3:// URL")
    root, _ = split_source(v)
    if "://" not in root and not Path(root).is_dir():
        # split_source took an existing file apart already: what is left does not exist.
        raise ValueError(f"no such file or directory: {root}" if not Path(root).exists()
                         else f"not a directory or file: {root}")
    return v


def _path_unless_url(v: Any, info: ValidationInfo) -> Any:
    # A blank source stays blank, to be refused, not read as the config's folder.
    if isinstance(v, str) and ("://" in v or not v.strip()):
        return v
    return _relative_to_config(v, info)


# A local path (relative to the config file) or an s3:// URL; either may end in a glob.
Source = Annotated[str, AfterValidator(_local_root_exists), BeforeValidator(_path_unless_url)]


class _Sourced(_Strict):
    """Fields every dataset read from storage has."""

    source: Source = Field(min_length=1,
                           description="a path or s3://bucket/prefix, may hold a glob")
    s3: S3Settings | None = Field(None, description="overrides the top-level s3: block")
    # raise: the batch fails with DATA_LOSS naming the sample and where it came from.
    # skip: the sample is replaced by another, the same one on every server; counted, logged.
    on_error: Literal["raise", "skip"] = "raise"
    # global: any sample after any other. block: shards in a random order, samples shuffled
    # within a window of `shuffle_window` shards, so reads stay sequential (see docs).
    shuffle: Literal["global", "block"] = "global"
    shuffle_window: int = Field(4, ge=1)
    transform: str | None = UserTransform
    # Local sources: a symlink under the root that leads outside it is refused (the dataset
    # does not open) unless the operator says so here. `..` never leads out.
    follow_symlinks_outside_root: bool = False


def _field_names(v: list[str] | None) -> list[str] | None:
    if v is not None and (len(set(v)) != len(v) or "sample_index" in v or "" in v):
        raise ValueError("field names must be distinct, non-empty and not 'sample_index'")
    return v


class PythonDataset(_Strict):
    """The user's own map-style dataset: `factory` returns an object with __len__ and
    __getitem__(i) -> a dict of fields, a tuple of them or one (formats/python.py)."""

    format: Literal["python"]
    factory: str = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$",
                         description='"module:callable", importable on the server')
    options: dict[str, Any] = Field(default_factory=dict)
    # fn(dataset[i]) -> a sample: deterministic work (decode, resize) whose output the prefix
    # cache keeps (cache.decoded_bytes); `transform:` then runs on it every epoch.
    prepare: str | None = Field(None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$",
                                description='"module:callable", importable on the server')
    # The names of the values a sample tuple holds, in order (default "0", "1", ...).
    fields: Annotated[list[str] | None, AfterValidator(_field_names)] = None
    on_error: Literal["raise", "skip"] = "raise"
    transform: str | None = UserTransform


def _square(v: Any) -> Any:
    return (v, v) if isinstance(v, int) and not isinstance(v, bool) else v


def _positive_size(v: tuple[int, int]) -> tuple[int, int]:
    if min(v) < 1:
        raise ValueError("sizes must be >= 1")
    return v


ImageSize = Annotated[tuple[int, int], BeforeValidator(_square), AfterValidator(_positive_size),
                      Field(description="output [height, width], or one int for square")]


# -- transforms: an ordered list of one-key mappings `name: {arguments}` -----------------------
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def _none_is_empty(v: Any) -> Any:
    return {} if v is None else v  # `- horizontal_flip:` with nothing after it


class ResizeArgs(_Strict):
    size: int | tuple[int, int] = Field(
        description="int: the shorter side (aspect kept); [height, width]: exactly")
    antialias: bool = Field(True, description="false: plain bilinear, faster, aliases")

    @model_validator(mode="before")
    @classmethod
    def _short(cls, v: Any) -> Any:
        """`short: 256` is `size: 256` (the shorter side, FFCV's "max resolution" spelling)."""
        if isinstance(v, dict) and "short" in v:
            if "size" in v:
                raise ValueError("give either size or short, not both")
            if not isinstance(v["short"], int) or isinstance(v["short"], bool):
                raise ValueError(f"short: the shorter side in pixels, one int, got {v['short']!r}")
            v = {("size" if k == "short" else k): x for k, x in v.items()}
        return v

    @field_validator("size")
    @classmethod
    def _positive(cls, v: Any) -> Any:
        if min(v if isinstance(v, tuple) else (v,)) < 1:
            raise ValueError("sizes must be >= 1")
        return v


class CenterCropArgs(_Strict):
    size: ImageSize


def _ordered_range(v: tuple[float, float]) -> tuple[float, float]:
    if not 0 < v[0] <= v[1]:
        raise ValueError(f"expected 0 < low <= high, got {list(v)}")
    return v


Range = Annotated[tuple[float, float], AfterValidator(_ordered_range)]


class RandomResizedCropArgs(_Strict):
    """As torchvision's RandomResizedCrop: area fraction in `scale`, aspect in `ratio`."""

    size: ImageSize
    scale: Range = (0.08, 1.0)
    ratio: Range = (3 / 4, 4 / 3)
    antialias: bool = Field(True, description="false: plain bilinear, faster, aliases")

    @field_validator("scale")
    @classmethod
    def _fraction(cls, v: tuple[float, float]) -> tuple[float, float]:
        if v[1] > 1:
            raise ValueError(f"scale is a fraction of the image's area, at most 1, got {list(v)}")
        return v


class FlipArgs(_Strict):
    p: float = Field(0.5, ge=0, le=1, description="probability of mirroring")


def _positive_std(v: tuple[float, float, float]) -> tuple[float, float, float]:
    if min(v) <= 0:
        raise ValueError("std must be > 0")
    return v


class NormalizeArgs(_Strict):
    """(pixel / 255 - mean) / std per channel; output CHW in `dtype`."""

    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: Annotated[tuple[float, float, float], AfterValidator(_positive_std)] = IMAGENET_STD
    dtype: Literal["float32", "float16"] = "float32"


# One model per transform, its single field named like it (module-level: configs are pickled
# to the worker processes).
_Args = BeforeValidator(_none_is_empty)


class ResizeStep(_Strict):
    resize: Annotated[ResizeArgs, _Args]


class CenterCropStep(_Strict):
    center_crop: Annotated[CenterCropArgs, _Args]


class RandomResizedCropStep(_Strict):
    random_resized_crop: Annotated[RandomResizedCropArgs, _Args]


class HorizontalFlipStep(_Strict):
    horizontal_flip: Annotated[FlipArgs, _Args]


class NormalizeStep(_Strict):
    normalize: Annotated[NormalizeArgs, _Args]


TRANSFORMS = {"resize": ResizeStep, "center_crop": CenterCropStep,
              "random_resized_crop": RandomResizedCropStep,
              "horizontal_flip": HorizontalFlipStep, "normalize": NormalizeStep}


def _transform_name(v: Any) -> str | None:
    if isinstance(v, dict):
        return next(iter(v)) if len(v) == 1 and next(iter(v)) in TRANSFORMS else None
    if isinstance(v, BaseModel):  # a validated step
        return next(iter(type(v).model_fields), None)
    return None  # `- resize` (a bare name), a number...: the error names the step


TransformStep = Annotated[
    Union[tuple(Annotated[m, Tag(n)] for n, m in TRANSFORMS.items())],  # noqa: UP007
    Discriminator(_transform_name, custom_error_type="transform",
                  custom_error_message="each transform is a one-key mapping `name: {arguments}`"
                                       f" with name one of {', '.join(TRANSFORMS)}")]


def transform_steps(steps: list[Any]) -> list[tuple[str, Any]]:
    """(name, arguments) of each validated step, in order."""
    return [(name, getattr(step, name)) for step in steps
            for name in type(step).model_fields]


def _check_transforms(steps: list[Any]) -> list[Any]:
    names = [n for n, _ in transform_steps(steps)]
    if "normalize" in names[:-1]:
        raise ValueError("normalize must be the last transform (its output is float CHW)")
    if not {"center_crop", "random_resized_crop"} & set(names) and not any(
            n == "resize" and isinstance(a.size, tuple) for n, a in transform_steps(steps)):
        raise ValueError("transforms must give every image the same size: include "
                         "center_crop, random_resized_crop, or resize with [height, width]")
    return steps


Transforms = Annotated[list[TransformStep], AfterValidator(_check_transforms),
                       Field(min_length=1)]


def _size_or_transforms(size: Any, transforms: Any) -> None:
    # Neither: images at their native size, each batch padded to its largest (images.py).
    if size is not None and transforms is not None:
        raise ValueError("give either size (a plain resize) or transforms, not both")


class ImageFolderDataset(_Sourced):
    """One sub-folder per class under `source` (class index = sorted folder order), or the
    images and labels a `manifest` lists."""

    format: Literal["image-folder"]
    size: ImageSize | None = None
    transforms: Transforms | None = Field(
        None, description="ordered list replacing `size`; see docs/configuration.md")
    layout: Literal["chw", "hwc"] = Field("chw", description="uint8 output; normalize: CHW")
    manifest: str | None = Field(
        None, description="key under source of a CSV (path,label) or JSON lines "
                          '({"path": ..., "label": ...}) file; paths relative to source')

    @model_validator(mode="after")
    def _one_geometry(self) -> ImageFolderDataset:
        _size_or_transforms(self.size, self.transforms)
        return self


NumberDtype = Literal["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                      "uint64", "float16", "float32", "float64"]


def _check_text(is_text: bool, max_bytes: int | None) -> None:
    if is_text and max_bytes is None:
        raise ValueError("max_bytes is required for utf8 text")
    if not is_text and max_bytes is not None:
        raise ValueError("max_bytes applies to utf8 text only")


# A value put in place of a null (JSON null, Parquet null: what pandas writes for NaN).
Fill = Annotated[bool | int | float | str | None,
                 Field(description="the value a null becomes; default: a null fails")]


def _check_fill(fill: Any, text: bool) -> None:
    if fill is None:
        return
    if text != isinstance(fill, str):
        raise ValueError("fill must be a string for utf8 or tokens, a number for numbers, "
                         f"got {fill!r}")


class JsonField(_Strict):
    path: str | None = Field(None, description="dotted key in the record; default: field name")
    # None: inferred at open from the first records (see formats/jsonl.py): int64 when
    # every value seen is an integer, bool when every one is a bool, else float32.
    dtype: Literal[NumberDtype, "utf8"] | None = None  # one Literal: one error line, not two
    # -1 as the first axis: a list of any length (token ids), padded to the batch's longest.
    shape: tuple[int, ...] = ()
    # utf8: the text's bytes as uint8[max_bytes], zero-padded, and `<name>_length` (int64).
    max_bytes: int | None = Field(None, ge=1)
    fill: Fill = None

    @model_validator(mode="after")
    def _utf8_needs_max_bytes(self) -> JsonField:
        _check_text(self.dtype == "utf8", self.max_bytes)
        if self.dtype == "utf8" and self.shape:
            raise ValueError("a utf8 field has no shape (it is uint8[max_bytes])")
        _check_fill(self.fill, self.dtype == "utf8")
        if any(d < 0 for d in self.shape[1:]) or any(d < -1 for d in self.shape[:1]):
            raise ValueError("shape: -1 (any length) may be the first axis only")
        return self


# Token budgets (batch_tokens) read each sample's length from this field (jsonl) or column
# (parquet): a list (its length) or an integer (the length itself). See docs/configuration.md.
LengthColumn = Field(None, min_length=1)


class JsonlDataset(_Sourced):
    """Records, one JSON object per line, from one file or many (a glob); a shard is a file."""

    format: Literal["jsonl"]
    fields: dict[str, JsonField] = Field(min_length=1)
    length_column: str | None = LengthColumn  # a field's name


class TokensDataset(_Sourced):
    """nanoGPT-style flat token files: sample i is a window of seq_len + 1 tokens, giving
    `input_ids` (the first seq_len) and `labels` (the last seq_len); windows step by seq_len
    and never cross a file; a shard is a file."""

    format: Literal["tokens"]
    dtype: Literal["uint16", "uint32"] = "uint16"
    seq_len: int = Field(ge=1)
    header_bytes: int = Field(0, ge=0, description="bytes to skip at the start of each file")
    output_dtype: Literal["int32", "int64"] = "int64"
    # Token ids must be below it: checked on each file's first tokens at open and on every
    # window read (None: only the dtype's own range).
    vocab_size: int | None = Field(None, ge=1, le=2**32)


class MemmapDataset(_Sourced):
    """Arrays whose first axis is the sample: .npy files, or raw arrays with stoker's small
    header (see formats/memmap.py). Each field's files are concatenated along axis 0 in key
    order; a shard is a file of the first field."""

    format: Literal["memmap"]
    fields: dict[str, str] = Field(min_length=1, description="field -> glob under source")


class TarField(_Strict):
    ext: str = Field(min_length=1, description="the member's extension after the sample key "
                                               "(matched ignoring case, as webdataset does)")
    decode: Literal["image", "int", "float", "npy", "utf8", "json"]
    size: ImageSize | None = None  # image: a plain resize
    transforms: Transforms | None = None  # image: instead of size
    layout: Literal["chw", "hwc"] = "chw"  # image
    max_bytes: int | None = Field(None, ge=1)  # utf8, and json with dtype utf8, as in jsonl
    # json: the value at `path` (dotted, as in jsonl; default: the whole document), as dtype
    # (required: no silent float) and shape.
    path: str | None = None
    dtype: Literal[NumberDtype, "utf8"] | None = None
    shape: tuple[int, ...] = ()

    @model_validator(mode="after")
    def _decoder_options(self) -> TarField:
        _check_text(self.decode == "utf8" or (self.decode == "json" and self.dtype == "utf8"),
                    self.max_bytes)
        if self.decode == "image":
            _size_or_transforms(self.size, self.transforms)
        elif self.size is not None or self.transforms is not None:
            raise ValueError("size and transforms apply to decode: image only")
        if self.decode == "json" and self.dtype is None:
            raise ValueError("decode: json needs dtype (a number type, or utf8 with max_bytes)")
        if self.decode != "json" and (self.path is not None or self.dtype is not None
                                      or self.shape):
            raise ValueError("path, dtype and shape apply to decode: json only")
        return self


class TarDataset(_Sourced):
    """WebDataset-style shards: members `KEY.EXT` grouped into samples by KEY; a shard is a
    tar file."""

    format: Literal["tar"]
    fields: dict[str, TarField] = Field(min_length=1)
    shuffle: Literal["global", "block"] = "block"


class ColumnField(_Strict):
    """A field of `format: mds` or `format: litdata`: one column of the peer's samples,
    decoded as its encoding says (see docs/configuration.md); the options that apply depend
    on that encoding, known when the dataset opens."""

    column: str | None = Field(None, description="default: the field name")
    size: ImageSize | None = None  # image columns: a plain resize
    transforms: Transforms | None = None  # image columns: instead of size
    layout: Literal["chw", "hwc"] = "chw"  # image columns
    max_bytes: int | None = Field(None, ge=1)  # str and bytes columns, as utf8 in jsonl

    @model_validator(mode="after")
    def _one_geometry(self) -> ColumnField:
        if self.size is not None and self.transforms is not None:
            raise ValueError("give either size (a plain resize) or transforms, not both")
        return self


class MdsDataset(_Sourced):
    """A Mosaic Streaming folder (MDSWriter's index.json and shards); a shard is a shard."""

    format: Literal["mds"]
    fields: dict[str, ColumnField] = Field(min_length=1)
    shuffle: Literal["global", "block"] = "block"


class LitdataDataset(_Sourced):
    """A LitData folder (optimize's index.json and chunks); a shard is a chunk."""

    format: Literal["litdata"]
    fields: dict[str, ColumnField] = Field(min_length=1)
    shuffle: Literal["global", "block"] = "block"


TokenId = Annotated[int, Field(ge=0, lt=2**31)]


def _tokenizer_file(v: str) -> str:
    if v == "byte":
        return v
    path = Path(v).expanduser()  # already done when read from a file; not when built in code
    if path.suffix not in (".json", ".tiktoken"):
        raise ValueError(f"expected 'byte', a Hugging Face tokenizer file (*.json) or a "
                         f"tiktoken BPE file (*.tiktoken), got {v!r}")
    if not path.is_file():
        raise ValueError(f"tokenizer file not found: {path}")
    return str(path)


def _path_unless_byte(v: Any, info: ValidationInfo) -> Any:
    return v if v == "byte" else _relative_to_config(v, info)


# "byte" (a name), or a tokenizer file: a local path like a local source.
Tokenizer = Annotated[str, AfterValidator(_tokenizer_file), BeforeValidator(_path_unless_byte)]


class ParquetField(_Strict):
    """A column -> a field: numbers as they are (no `decode`), or decoded like tar members:
    `image` (binary, or a Hugging Face `Image()` struct<bytes, path>), `utf8` or `tokens`
    (string columns)."""

    column: str | None = Field(None, description="default: the field name")
    dtype: NumberDtype | None = Field(None, description="default: the column's own type")
    decode: Literal["image", "utf8", "tokens"] | None = None  # None: a column of numbers
    size: ImageSize | None = None  # image: a plain resize
    transforms: Transforms | None = None  # image: instead of size
    layout: Literal["chw", "hwc"] = "chw"  # image
    max_bytes: int | None = Field(None, ge=1)  # utf8, as in jsonl
    # tokens: the string's ids as int64[max_tokens], padded with pad_id, and `<name>_length`.
    tokenizer: Tokenizer = Field("byte", min_length=1, description="as in format: text")
    tiktoken_pattern: str | None = None  # tokens, *.tiktoken only
    max_tokens: int | None = Field(None, ge=1)
    pad_id: TokenId | None = None  # default: the tokenizer's PAD, else its EOS, else 0
    fill: Fill = None

    @model_validator(mode="after")
    def _decoder_options(self) -> ParquetField:
        _check_text(self.decode == "utf8", self.max_bytes)
        if self.decode == "image":
            _size_or_transforms(self.size, self.transforms)
        elif (self.size is not None or self.transforms is not None
              or "layout" in self.model_fields_set):
            raise ValueError("size, transforms and layout apply to decode: image only")
        if self.dtype is not None and self.decode is not None:
            raise ValueError("dtype applies to number columns (no decode) only")
        tokens_only = {"tokenizer", "tiktoken_pattern", "max_tokens", "pad_id"}
        if self.decode == "tokens":
            if self.max_tokens is None:
                raise ValueError("max_tokens is required for decode: tokens")
            if self.tiktoken_pattern is not None and not self.tokenizer.endswith(".tiktoken"):
                raise ValueError("tiktoken_pattern applies to a *.tiktoken tokenizer only")
        elif tokens_only & self.model_fields_set:
            raise ValueError(f"{', '.join(sorted(tokens_only & self.model_fields_set))}: "
                             "only with decode: tokens")
        if self.decode == "image" and self.fill is not None:
            raise ValueError("an image has no fill: a null image fails its sample")
        _check_fill(self.fill, self.decode in ("utf8", "tokens"))
        return self


class ParquetDataset(_Sourced):
    """Parquet files (pyarrow): columns -> fields, read by row group; a shard is a row group."""

    format: Literal["parquet"]
    fields: dict[str, ParquetField] = Field(min_length=1)
    shuffle: Literal["global", "block"] = "block"
    length_column: str | None = LengthColumn  # a column's name


class TextDataset(_Sourced):
    """Documents (a string field of .jsonl records or a string column of .parquet files),
    tokenized once at open and packed into rows of seq_len tokens: the documents of an epoch
    concatenated in a (seed, epoch) order and cut every seq_len tokens (see formats/text.py)."""

    format: Literal["text"]
    field: str = Field("text", min_length=1,
                       description="jsonl: a dotted path in each record; parquet: a column")
    tokenizer: Tokenizer = Field("byte", min_length=1,
                           description='"byte", a tokenizer.json (Hugging Face tokenizers) or '
                                       "a *.tiktoken BPE ranks file")
    tiktoken_pattern: str | None = Field(None, description="*.tiktoken only; default cl100k's")
    seq_len: int = Field(ge=2)
    bos: bool = Field(False, description="prepend BOS to every document")
    eos: bool = Field(True, description="append EOS to every document")
    bos_id: TokenId | None = None  # default: the tokenizer's own BOS
    eos_id: TokenId | None = None  # default: the tokenizer's own EOS
    pad_id: TokenId | None = None  # default: the tokenizer's PAD, else the EOS, else 0
    # split: a document longer than seq_len (BOS/EOS included) runs on across rows; drop: left out.
    long_documents: Literal["split", "drop"] = "split"
    shuffle: Literal["global"] = "global"  # rows have no shards

    @model_validator(mode="after")
    def _special_ids(self) -> TextDataset:
        tiktoken = self.tokenizer.endswith(".tiktoken")
        if self.tiktoken_pattern is not None and not tiktoken:
            raise ValueError("tiktoken_pattern applies to a *.tiktoken tokenizer only")
        for flag, name in ((self.bos, "bos"), (self.eos, "eos")):
            if tiktoken and flag and getattr(self, f"{name}_id") is None:
                raise ValueError(f"{name}_id is required with {name}: true and a *.tiktoken "
                                 "tokenizer (the file holds no special tokens)")
        return self


# -- format: mixture (server/order/mixture.py, formats/mixture.py) ---------------------------------
Weight = Annotated[float, Field(ge=0, allow_inf_nan=False)]


def _weight_alone(v: Any) -> Any:
    return {"weight": v} if isinstance(v, int | float) and not isinstance(v, bool) else v


class MixtureComponent(_Strict):
    """One component: its weight, and renames that give its fields the mixture's names."""

    weight: Weight
    # mixture's field name -> this component's field name, e.g. {input_ids: tokens}.
    fields: dict[str, str] = Field(default_factory=dict)


class MixtureStep(_Strict):
    """From global sample `from_sample` on (epoch * samples_per_epoch + position, counted
    from the run's first sample), these weights; a component not named gets 0."""

    from_sample: int = Field(ge=1)
    weights: dict[str, Weight] = Field(min_length=1)


class MixtureDataset(_Strict):
    """Other datasets of this config, drawn with weights: which component and which of its
    samples fill each position is a function of (seed, epoch, position), see docs/mixtures.md."""

    format: Literal["mixture"]
    # name -> weight, or {weight: w, fields: {common: own}}; weights need not sum to 1.
    components: dict[str, Annotated[MixtureComponent, BeforeValidator(_weight_alone)]] = Field(
        min_length=1)
    schedule: list[MixtureStep] = Field(default_factory=list)
    # Positions an epoch; default: the components' lengths summed (weights may change with
    # the schedule, an epoch's length must not).
    samples_per_epoch: int | None = Field(None, ge=1)
    # As for any dataset; inside a mixture the mixture's own policy applies to every component.
    on_error: Literal["raise", "skip"] = "raise"

    @model_validator(mode="after")
    def _phases(self) -> MixtureDataset:
        if not any(c.weight > 0 for c in self.components.values()):
            raise ValueError("components: at least one weight must be > 0")
        last = 0
        for n, step in enumerate(self.schedule):
            if step.from_sample <= last:
                raise ValueError(f"schedule.{n}.from_sample: must be larger than the one "
                                 f"before ({last}), got {step.from_sample}")
            last = step.from_sample
            unknown = sorted(set(step.weights) - set(self.components))
            if unknown:
                raise ValueError(f"schedule.{n}.weights: {', '.join(map(repr, unknown))} not in "
                                 f"components ({', '.join(self.components)})")
            if not any(w > 0 for w in step.weights.values()):
                raise ValueError(f"schedule.{n}.weights: at least one weight must be > 0")
        return self

    def phase_weights(self) -> list[tuple[int, list[float]]]:
        """(first global sample, weight of each component in `components` order) per phase."""
        names = list(self.components)
        return [(0, [c.weight for c in self.components.values()])] + [
            (s.from_sample, [s.weights.get(n, 0.0) for n in names]) for s in self.schedule]


def _check_mixtures(datasets: dict[str, Any]) -> None:
    """Every component of a mixture is another dataset of the config, and not a mixture."""
    for name, cfg in datasets.items():
        if not isinstance(cfg, MixtureDataset):
            continue
        for c in cfg.components:
            if c not in datasets:
                raise ValueError(f"datasets.{name}.components: {c!r} is not a dataset of this "
                                 f"config; datasets: {', '.join(datasets)}")
            if isinstance(datasets[c], MixtureDataset):
                raise ValueError(f"datasets.{name}.components: {c!r} is a mixture; a mixture "
                                 "of mixtures is not supported: list its components here")


DatasetConfig = Annotated[
    PythonDataset | ImageFolderDataset | JsonlDataset | TokensDataset | MemmapDataset
    | TarDataset | ParquetDataset | TextDataset | MdsDataset | LitdataDataset
    | MixtureDataset,
    Field(discriminator="format")]


def _readable_file(v: Path) -> Path:
    if not v.is_file():
        raise ValueError(f"not a file: {v}")
    return v


ReadableFile = Annotated[Path, AfterValidator(_readable_file), RelativeToConfig]


class TlsSettings(_Strict):
    """TLS on the gRPC and HTTP ports (PEM files, read at start; relative paths are relative
    to the config file). With `client_ca_file`, clients must present a certificate it signed
    (mutual TLS), on both ports."""

    cert_file: ReadableFile = Field(description="the server's certificate chain (PEM)")
    key_file: ReadableFile = Field(description="its private key (PEM)")
    client_ca_file: ReadableFile | None = Field(
        None, description="CA certificates (PEM) for client certificates; set: mutual TLS")


class ServerSettings(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(50051, ge=0, le=65535)
    http_port: int = Field(8080, ge=0, le=65535)
    # TCP port for data sockets (clients that ask send payloads there, beside gRPC); 0: any
    # free port (the stream tells the client which).
    data_port: int = Field(0, ge=0, le=65535)
    workers: int | None = Field(None, ge=1, description="worker processes; default one per core")
    # Credits one stream may hold at once: with the batch size, this bounds server memory.
    max_credits: int = Field(64, ge=1, le=4096)
    # 4 MiB less room for the frame's header: a frame then fits the 4 MiB receive limit that
    # gRPC clients have by default, so any gRPC client can read the stream unconfigured.
    frame_bytes: int = Field((4 << 20) - (64 << 10), ge=4096, le=MAX_FRAME_BYTES)
    grace_seconds: float = Field(10.0, ge=0)
    # Clients on this host (same user) read batches straight from shared memory: no copy
    # through gRPC. false: every batch goes over the socket.
    shared_memory: bool = True
    tls: TlsSettings | None = None
    # The bearer token every call must carry; from a file or an environment variable, never
    # from this file (configs get committed, printed and mounted where secrets should not be).
    auth_token_file: ReadableFile | None = None
    auth_token_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    # Limits a client cannot talk its way past; each refusal names the limit and its value.
    max_streams_per_client: int = Field(64, ge=1, le=65536)
    max_batch_bytes: ByteSize = Field(ByteSize(2 << 30), ge=1 << 10)
    max_request_bytes: ByteSize = Field(ByteSize(1 << 20), ge=4 << 10, le=64 << 20)
    # -- issue 19, shm-watchdog: hung workers --
    # A batch a worker has not built within this many seconds fails (INTERNAL, in-band: the
    # client asks again) and the worker is killed and replaced. Below the client's own
    # timeout (300 s by default), so that the client hears of it before giving up.
    batch_timeout_seconds: float = Field(120.0, gt=0, le=86400)
    # -- issue 19, package "limits": bounded connections, streams and memory
    # (server/front/limits.py; each is a row of docs/security.md's Limits table, with the error
    # it gives).
    # Batch streams open at once, all clients together: each holds credits, a share of the
    # workers and, when asked, a data socket (one descriptor).
    max_streams: int = Field(1024, ge=1, le=1 << 20)
    # Health/Watch calls open at once, all clients together (one address's watches count in
    # its max_streams_per_client too): each is a call held open for its whole life.
    max_health_watches: int = Field(256, ge=1, le=1 << 20)
    # Shared memory held by streams (batches built and not yet sent or released), all clients
    # together; in effect at most 3/4 of /dev/shm, which the workers' own segments need too.
    max_held_bytes: ByteSize = Field(ByteSize(8 << 30), ge=1 << 20)
    # The same, per client address: a frozen client cannot pin more than this.
    max_held_bytes_per_client: ByteSize = Field(ByteSize(2 << 30), ge=1 << 20)
    # Epoch orders (8 bytes a sample) kept in memory, all datasets: an LRU in bytes; an order
    # larger than this is computed for each use and never kept.
    max_order_cache_bytes: ByteSize = Field(ByteSize(1 << 30), ge=0)
    # HTTP connections open at once (uvicorn's limit_concurrency backs it), and per address.
    max_http_connections: int = Field(256, ge=1, le=1 << 20)
    max_http_connections_per_client: int = Field(32, ge=1, le=1 << 20)
    # Seconds a connection has to complete a request's head (a half-sent head held a
    # descriptor for ever: uvicorn has no such timeout).
    http_header_timeout_seconds: float = Field(10.0, gt=0, le=3600)
    # gRPC connections open at once (grpc.max_allowed_incoming_connections): more are closed
    # at accept. gRPC has no per-address cap.
    max_grpc_connections: int = Field(512, ge=1, le=1 << 20)
    # Seconds a gRPC connection has to finish its handshake (the HTTP/2 preface, TLS): silent
    # TCP connections are closed after this (gRPC's own default is 120 s).
    grpc_handshake_timeout_seconds: float = Field(10.0, gt=0, le=3600)
    # Seconds a gRPC connection may stay without calls before the server sends GOAWAY
    # (channels reconnect by themselves when next used).
    grpc_idle_seconds: float = Field(600.0, gt=0)
    # -- end of "limits"

    @model_validator(mode="after")
    def _one_token_source(self) -> ServerSettings:
        if self.auth_token_file is not None and self.auth_token_env is not None:
            raise ValueError("give auth_token_file or auth_token_env, not both")
        if self.auth_token_env is not None and not os.environ.get(self.auth_token_env):
            raise ValueError(f"auth_token_env: environment variable {self.auth_token_env} "
                             "is not set (or empty)")
        return self

    @property
    def worker_count(self) -> int:
        return self.workers or len(os.sched_getaffinity(0))


class Config(_Strict):
    server: ServerSettings = Field(default_factory=ServerSettings)
    s3: S3Settings = Field(default_factory=S3Settings)
    cache: CacheSettings = Field(default_factory=CacheSettings)
    datasets: dict[str, DatasetConfig] = Field(min_length=1)

    @model_validator(mode="after")
    def _mixtures(self) -> Config:
        _check_mixtures(self.datasets)
        return self

    def s3_for(self, dataset: str) -> S3Settings:
        """The top-level s3: block with the dataset's own s3: fields laid over it."""
        own = getattr(self.datasets[dataset], "s3", None)
        if own is None:
            return self.s3
        return self.s3.model_copy(update=own.model_dump(exclude_unset=True))


def load_config(path: str | os.PathLike[str], **overrides: Any) -> Config:
    """Read and validate a config file; `overrides` (not None) replace `server:` settings."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(f"config error in {path}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config error in {path}: not UTF-8 text: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config error in {path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config error in {path}: expected a mapping with `datasets:` at the top")
    server = raw.get("server")
    if server is None:
        server = {}
    if isinstance(server, dict):  # anything else: validation names `server` below
        raw["server"] = {**server, **{k: v for k, v in overrides.items() if v is not None}}
    try:
        return Config.model_validate(raw, context={"base": path.resolve().parent})
    except ValidationError as e:
        lines = [f"config error in {path}:"]
        for err in e.errors():
            # A tagged union repeats its tag (transforms.0.resize.resize.size): say it once.
            parts = [str(p) for i, p in enumerate(err["loc"]) if i == 0 or p != err["loc"][i - 1]]
            loc = ".".join(parts) or "(top level)"
            got = repr(err.get("input"))
            got = got if len(got) <= 80 else got[:77] + "..."
            msg = err["msg"]
            if err["type"] == "extra_forbidden":
                msg += _did_you_mean(err["loc"])
            lines.append(f"  {loc}: {msg} (got {got})")
        raise ConfigError("\n".join(lines)) from None


# -- unknown keys: the valid keys where the typo is, and the closest of them -------------------
def _unwrap(t: Any) -> Any:
    """`t` without Annotated and without `| None`."""
    while True:
        if typing.get_origin(t) is Annotated:
            t = typing.get_args(t)[0]
        elif typing.get_origin(t) in (Union, types.UnionType) and type(None) in typing.get_args(t):
            rest = [a for a in typing.get_args(t) if a is not type(None)]
            if len(rest) != 1:
                return t
            t = rest[0]
        else:
            return t


def _member(union: Any, tag: Any) -> Any:
    """The member of a tagged union that an error's location names by `tag`: a transform's
    `Tag`, or a dataset's `format` literal."""
    for m in typing.get_args(union):
        if typing.get_origin(m) is Annotated and any(
                isinstance(x, Tag) and x.tag == tag for x in typing.get_args(m)[1:]):
            return m
        model = _unwrap(m)
        fmt = getattr(model, "model_fields", {}).get("format")
        if fmt is not None and tag in typing.get_args(fmt.annotation):
            return model
    return None


def _keys_at(loc: tuple[Any, ...]) -> list[str]:
    """The keys the model at `loc` (an error's location, less the unknown key) accepts; []
    where the location cannot be followed."""
    t: Any = Config
    for part in loc:
        t = _unwrap(t)
        if isinstance(t, type) and issubclass(t, BaseModel):
            field = t.model_fields.get(str(part))
            t = field.annotation if field is not None else None
        elif typing.get_origin(t) in (Union, types.UnionType):
            t = _member(t, part)
        elif typing.get_origin(t) in (dict, list, tuple):
            t = typing.get_args(t)[-1]
        else:
            return []
        if t is None:
            return []
    t = _unwrap(t)
    return sorted(t.model_fields) if isinstance(t, type) and issubclass(t, BaseModel) else []


def _did_you_mean(loc: tuple[Any, ...]) -> str:
    """"; did you mean 'options'?" for `option`, else the keys valid there."""
    keys = _keys_at(loc[:-1])
    if not keys:
        return ""
    close = difflib.get_close_matches(str(loc[-1]), keys, n=1, cutoff=0.6)
    if close:
        return f"; did you mean {close[0]!r}?"
    return f"; expected one of: {', '.join(keys)}"
