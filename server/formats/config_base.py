"""What every dataset's config model shares: the strict base model, local paths read relative
to the config file, `source:` and the fields of every dataset read from storage, the field
types several formats use, and what a model says of itself (`DatasetBase`) so that no code
outside formats/ names a format.

Light by design: load_config imports this and every format's config module (pydantic only),
never a reader or a codec.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ByteSize,
    ConfigDict,
    Field,
    ValidationInfo,
)


# -- local paths: relative to the config file --------------------------------------------------
def relative_to_config(v: Any, info: ValidationInfo) -> Any:
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
RelativeToConfig = BeforeValidator(relative_to_config)
ConfigPath = Annotated[Path, RelativeToConfig]


class Strict(BaseModel):
    """The base of every config model: an unknown key is an error naming it; a model, once
    made, is frozen.

    Attributes:
        None of its own: every model's fields are its subclass's.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)


class S3Settings(Strict):
    """How to reach S3 or an S3-compatible store (MinIO...). Credentials come from boto3's
    standard chain (environment, profile, instance role), never from this file.

    Attributes:
        endpoint_url: E.g. `http://minio:9000`; null: AWS.
        region: Null: from the environment or profile.
        profile: A profile in `~/.aws/config`.
        max_pool_connections: 1-1024, HTTP connections per worker process; null: enough for its
            threads.
        connect_timeout: Seconds, > 0.
        read_timeout: Seconds, > 0.
        max_attempts: 1-100; tries per request (and per body read), backoff with jitter between.
        retry_mode: Botocore's retry mode; `adaptive` also slows down when throttled.
        range_bytes: >= 1 MiB; larger objects are fetched as parallel ranged GETs of this size.
        range_concurrency: 1-64; ranges of one object in flight at once.
    """

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


# fn(sample: dict of arrays, rng: numpy Generator) -> dict, applied to every sample after the
# format's own decoding and transforms; rng is seeded by (seed, epoch, sample index).
UserTransform = Field(None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$",
                      description='"module:callable", importable on the server')


def _local_root_exists(v: str) -> str:
    from ..sources import split_source

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
    return relative_to_config(v, info)


# A local path (relative to the config file) or an s3:// URL; either may end in a glob.
Source = Annotated[str, AfterValidator(_local_root_exists), BeforeValidator(_path_unless_url)]


def _suffixes(v: tuple[str, ...]) -> tuple[str, ...]:
    if not v or any(not e.startswith(".") for e in v):
        raise ValueError("extensions: a list of suffixes starting with '.', e.g. ['.mp4']")
    return tuple(e.lower() for e in v)


# File name suffixes, compared ignoring case (class-folder formats' `extensions:`).
Suffixes = Annotated[tuple[str, ...], AfterValidator(_suffixes)]


class DatasetBase(Strict):
    """A dataset's config model. What the server asks of a dataset's kind is asked of its
    model, here: class variables and properties, none of them a key of the config.

    Attributes:
        None of its own: a format's keys are its model's (`Sourced` has a stored dataset's).
    """

    # Its batches are what its storage listed, and its fingerprint hashes that listing; false:
    # the user's own dataset, fingerprinted by its config, length and own fingerprint().
    described_by_listing: ClassVar[bool] = True
    # Its reader is given the cache folder (cache_dir=), for the files it derives from the
    # data (a tokenized corpus, uncompressed shards), shared by the workers.
    uses_cache_dir: ClassVar[bool] = False
    if TYPE_CHECKING:  # each model's own `format: Literal[...]`, the union's discriminator
        format: str

    @property
    def draws_from(self) -> tuple[str, ...]:
        """The other datasets of the config it is made of: they open first, and its failures
        and paths are theirs."""
        return ()

    @property
    def runs_user_code(self) -> bool:
        """Whether its samples pass through the user's code (a `transform:`, a factory): a
        failure then shows the client the user's traceback."""
        return getattr(self, "transform", None) is not None

    def check_among(self, name: str, datasets: Mapping[str, DatasetBase]) -> None:
        """Raise ValueError, naming `datasets.<name>`, where it does not fit the config's
        other datasets."""


class Sourced(DatasetBase):
    """Fields every dataset read from storage has.

    Attributes:
        source: A local path (relative to the config file) or `s3://bucket/prefix`; the part from
            the first segment with `*`, `?` or `[` on is a glob matched against keys under the rest
            (`*`, `?` stay within a folder, `/` spans folders): `data/*.jsonl`,
            `s3://b/shards//*.tar`.
        s3: Fields of the top-level `s3:` to override for this dataset.
        on_error: A bad sample: fail its batch (DATA_LOSS naming the sample and where it came from),
            or replace it deterministically (see design.md); `python` has it too.
        shuffle: With the client's `shuffle=True`: any sample after any other, or shards in random
            order with samples mixed within windows (see design.md).
        shuffle_window: >= 1; shards per window for `shuffle: block`.
        transform: The user's per-sample function `fn(sample, rng) -> dict`, applied after the
            format's own decoding and `transforms:`; `sample` is the dict of numpy arrays and
            numbers the format made, `rng` a `numpy.random.Generator` seeded by (seed, epoch, sample
            index), so the result is the same on every server and worker count.
        follow_symlinks_outside_root: Local sources: a symlink under the root that leads outside it
            stops the server at start (the error names the link and its target); `true` allows it.
    """

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


NumberDtype = Literal["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                      "uint64", "float16", "float32", "float64"]


def check_text(is_text: bool, max_bytes: int | None) -> None:
    if is_text and max_bytes is None:
        raise ValueError("max_bytes is required for utf8 text")
    if not is_text and max_bytes is not None:
        raise ValueError("max_bytes applies to utf8 text only")


# A value put in place of a null (JSON null, Parquet null: what pandas writes for NaN).
Fill = Annotated[bool | int | float | str | None,
                 Field(description="the value a null becomes; default: a null fails")]


def check_fill(fill: Any, text: bool) -> None:
    if fill is None:
        return
    if text != isinstance(fill, str):
        raise ValueError("fill must be a string for utf8 or tokens, a number for numbers, "
                         f"got {fill!r}")


# Token budgets (batch_tokens) read each sample's length from this field (jsonl) or column
# (parquet): a list (its length) or an integer (the length itself). See docs/configuration.md.
LengthColumn = Field(None, min_length=1)


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
    return v if v == "byte" else relative_to_config(v, info)


# "byte" (a name), or a tokenizer file: a local path like a local source.
Tokenizer = Annotated[str, AfterValidator(_tokenizer_file), BeforeValidator(_path_unless_byte)]
