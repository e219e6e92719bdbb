"""Dataset formats: each turns a `format:` block of the config into a map-style dataset.

A format is a config model (in a light `<name>_config.py`: pydantic only) and a reader (in
`<name>.py`), and one line of `FORMATS`; the config's `datasets:` union is assembled from it.
What the server asks of a format (does it draw from other datasets, run the user's code...)
it asks of the config model (`config_base.DatasetBase`), never by the format's name.

What a dataset must have (`Dataset`: `__len__`, `__getitem__`) and what it may have (the
optional parts: `sample`, `source_of`, `shard_starts`, `objects_of`, `storage`, `fingerprint`)
is written once, in _contract.py; the server looks the optional parts up once per dataset, into a
`DatasetParts`. Formats read bytes only through a `Storage` (see sources/), never by opening
paths themselves; those with shards number their samples through one `ShardIndex`.
"""

from __future__ import annotations

import importlib
import typing
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._contract import Dataset, DatasetParts, DrawnFrom

__all__ = ["FORMATS", "OPTIONAL", "Dataset", "DatasetParts", "DrawnFrom", "config_models",
           "open_dataset"]

# format -> (its config model, its reader), as "module:name" under formats/, in the order the
# config's errors list the formats. load_config imports every config model (their modules are
# light); a reader only when a dataset of its format opens, so a server imports only the codecs
# it serves.
FORMATS: dict[str, tuple[str, str]] = {
    "python": ("python_config:PythonDataset", "python:open_python"),
    "image-folder": ("image_folder_config:ImageFolderDataset", "image_folder:ImageFolder"),
    "jsonl": ("jsonl_config:JsonlDataset", "jsonl:Jsonl"),
    "tokens": ("tokens_config:TokensDataset", "tokens:Tokens"),
    "memmap": ("memmap_config:MemmapDataset", "memmap:Memmap"),
    "tar": ("tar_config:TarDataset", "tar:Tar"),
    "parquet": ("parquet_config:ParquetDataset", "parquet:Parquet"),
    "text": ("text_config:TextDataset", "text:Text"),
    "chat": ("chat_config:ChatDataset", "chat:Chat"),
    "mds": ("mds_config:MdsDataset", "mds:Mds"),
    "litdata": ("litdata_config:LitdataDataset", "litdata:Litdata"),
    "mixture": ("mixture_config:MixtureDataset", "mixture:Mixture"),
    # TensorFlow's and Grain's records (serialized tf.train.Example, or raw bytes)
    "tfrecord": ("tfrecord_config:TfrecordDataset", "tfrecord:Tfrecord"),
    "array_record": ("array_record_config:ArrayRecordDataset", "array_record:ArrayRecord"),
    # video and audio (PyAV, the `video` extra): issue 40
    "video": ("video_config:VideoDataset", "video:Video"),
    "audio": ("audio_config:AudioDataset", "audio:Audio"),
    # tables in lakes, pinned to a snapshot (the `lake` extra): issue 52
    "iceberg": ("iceberg_config:IcebergDataset", "iceberg:Iceberg"),
    "delta": ("delta_config:DeltaDataset", "delta:Delta"),
    "lance": ("lance_config:LanceDataset", "lance:Lance"),
}


def _load(where: str) -> Any:
    module, name = where.split(":")
    return getattr(importlib.import_module(f".{module}", __name__), name)


def config_models() -> list[Any]:
    """Every format's config model, in FORMATS order; each names its format in `format:`."""
    models = [_load(model) for model, _ in FORMATS.values()]
    for fmt, model in zip(FORMATS, models, strict=True):
        if typing.get_args(model.model_fields["format"].annotation) != (fmt,):
            raise TypeError(f"FORMATS[{fmt!r}]: {model.__name__} is not format {fmt!r}")
    return models


def __getattr__(name: str) -> Any:
    # The contract needs numpy: loaded on use, so that load_config, which imports the config
    # models from this package, does not import it.
    if name in ("OPTIONAL", "Dataset", "DatasetParts", "DrawnFrom"):
        from . import _contract

        return getattr(_contract, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def open_dataset(name: str, config: Any, cache: Any = None,
                 opened: dict[str, DatasetParts] | None = None, cfg: Any = None) -> Dataset:
    """Open dataset `name` of a validated Config (in the calling process). `cache` is the
    process's DiskCache (needed for s3:// sources). A dataset drawn from others (a mixture)
    takes them from `opened` (datasets this process opened already), else opens them here.
    `cfg`: the dataset's config to open instead of the config's own (a lake table pinned to
    one snapshot)."""
    from ..sources import open_storage, split_source
    from ._contract import DatasetParts
    from ._lake_config import LakeDataset
    from .config_base import Sourced

    cfg = cfg or config.datasets[name]
    reader = _load(FORMATS[cfg.format][1])
    if isinstance(cfg, LakeDataset):
        from ._lake import Access

        s3 = config.s3_for(name)
        dataset = reader(cfg, Access(s3, lambda root: open_storage(
            root, s3, cache, int(config.cache.prefetch_bytes))))
    elif cfg.draws_from:
        opened = opened or {}
        parts = {c: opened.get(c) or DatasetParts.of(open_dataset(c, config, cache))
                 for c in cfg.draws_from}
        return reader(cfg, parts, {c: config.datasets[c] for c in cfg.draws_from})
    elif not isinstance(cfg, Sourced):  # the user's own dataset, from their factory
        dataset = reader(cfg)
    else:
        root, pattern = split_source(cfg.source)
        storage = open_storage(root, config.s3_for(name), cache,
                               int(config.cache.prefetch_bytes), cfg.follow_symlinks_outside_root)
        extra = {"cache_dir": config.cache.dir} if cfg.uses_cache_dir else {}
        dataset = reader(cfg, storage, pattern, **extra)
    if cfg.transform is not None:
        from .python import WithTransform

        dataset = WithTransform(dataset, cfg.transform)
    return dataset
