"""`format: python`: the user's own map-style dataset, built by `factory(**options)`; and the
user's per-sample `transform:`, which any format may have.

A python dataset may return what a torch Dataset returns: a dict of fields, a tuple or list
(`(image, label)`: fields named by the config's `fields:`, else "0", "1", ...), or one value
(field `fields[0]`, else "0"); each value a numpy array or scalar, a Python number or bool,
a tensor (anything with `.numpy()`, after `.detach().cpu()` where it has them) or an
array-like (`__array__`). `Samples` turns each into the dict of numpy arrays and numbers
that collation takes, by duck typing: the server core never imports torch.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..order.sampling import FIRST_EPOCH, EpochKey
from ._contract import DatasetParts

# What a sample may be, said by every error about one that is not.
RETURN = ("return a dict of fields ({'image': ..., 'label': ...}), a tuple or list (fields "
          "named by `fields:` in the dataset's config, else '0', '1', ...) or one value; "
          "each value a numpy array, a tensor, a numpy scalar or a Python int, float or bool")


def load_callable(spec: str, what: str) -> Any:
    """The object `module:attr.path` names; ValueError saying which part is missing."""
    module_name, _, attr = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{what} {spec!r}: cannot import {module_name!r}: {e}"
                         f"{_import_hint(module_name, e)}") from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{what} {spec!r}: {module_name!r} has no {attr!r}") from None
    if not callable(obj):
        raise ValueError(f"{what} {spec!r} is a {type(obj).__name__}, not callable")
    return obj


def _import_hint(module_name: str, e: ImportError) -> str:
    """Where the server looked, when the module itself (or a package above it) is missing; a
    module that fails on an import of its own is a dependency to install, not a path."""
    missing = getattr(e, "name", None)
    parts = module_name.split(".")
    if not isinstance(e, ModuleNotFoundError) or missing not in {
            ".".join(parts[:k]) for k in range(1, len(parts) + 1)}:
        if isinstance(e, ModuleNotFoundError) and missing:
            return (f" ({module_name!r} imports {missing!r}, which is not installed where the "
                    "server runs: install it there)")
        return ""
    cwd = os.getcwd()
    on_path = any(os.path.abspath(p or ".") == cwd for p in sys.path)
    where = ("which is on its import path" if on_path
             else "which is not on its import path (the `stoker` command does not add it)")
    return (f". The server runs in {cwd}, {where}: put the folder that holds "
            f"{parts[0]!r} on PYTHONPATH when starting the server (PYTHONPATH=/path/to/code "
            "stoker serve ...), or install it (pip install -e /path/to/code)")


def open_python(cfg: Any) -> Any:
    dataset = load_callable(cfg.factory, "factory")(**cfg.options)
    for method in ("__len__", "__getitem__"):
        if not hasattr(dataset, method):
            streamed = (": an iterable-style dataset cannot be served, as every server must "
                        "build any batch by its sample indices; return a map-style one "
                        "(sample i by dataset[i])") if hasattr(dataset, "__iter__") else ""
            raise ValueError(f"factory {cfg.factory!r} returned {type(dataset).__name__}, "
                             f"which has no {method}{streamed}")
    prepare = getattr(cfg, "prepare", None)
    if prepare is not None and callable(getattr(dataset, "sample", None)):
        raise ValueError(f"factory {cfg.factory!r} returned a dataset with its own "
                         "sample(i, key), whose samples may change with the epoch: `prepare:` "
                         "takes dataset[i], which must not. Move the random part into "
                         "`transform:`, or drop `prepare:`")
    return Samples(dataset, getattr(cfg, "fields", None),
                   load_callable(prepare, "prepare") if prepare else None)


class Samples:
    """The user's dataset, its samples turned into dicts of numpy arrays and numbers (see the
    module's docstring); `fields`: the names of a tuple's values, in order.

    With `prepare`, sample i is `prepare(dataset[i])`, its values as numpy arrays (Python
    numbers become 0-d arrays, cached or not): deterministic, so the server's prefix cache
    may keep it (see use_prefix_cache)."""

    def __init__(self, dataset: Any, fields: Sequence[str] | None = None,
                 prepare: Any = None) -> None:
        self.dataset = dataset
        self.fields = list(fields) if fields else None
        own = getattr(dataset, "sample", None)  # the optional sample(i, key), if it has one
        self._read = own if callable(own) else (lambda i, key: dataset[i])
        self.prepare = prepare
        self.cache: Any = None  # a _prefix_cache.Scope, with prepare only

    def __len__(self) -> int:
        return len(self.dataset)

    def sample(self, index: int, key: EpochKey) -> dict[str, Any]:
        if self.prepare is None:
            return as_fields(self._read(index, key), self.fields)
        hit = self.cache.get(index) if self.cache is not None else None
        if hit is not None:
            return hit
        out = {k: np.asarray(v) for k, v in
               as_fields(self.prepare(self.dataset[index]), self.fields).items()}
        if self.cache is not None:
            self.cache.put(index, out)
        return out

    def use_prefix_cache(self, scope: Any) -> None:
        if self.prepare is not None:
            spec = f"{self.prepare.__module__}:{self.prepare.__qualname__}"
            self.cache = scope("prepare", spec)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.sample(index, FIRST_EPOCH)

    def __getattr__(self, name: str) -> Any:
        # The optional parts but `sample` (source_of, fingerprint, ...; see DatasetParts): the
        # dataset's own, where it has them.
        return getattr(self.__dict__["dataset"], name)


def as_fields(raw: Any, fields: Sequence[str] | None = None) -> dict[str, Any]:
    """One sample as a dict of field name -> numpy array or Python number; TypeError saying
    what to return instead."""
    if type(raw) is dict:  # the common case, in one pass
        return {str(k): _value(str(k), v) for k, v in raw.items()}
    if isinstance(raw, Mapping):
        items = [(str(k), v) for k, v in raw.items()]
    elif isinstance(raw, tuple | list):
        if fields is not None and len(fields) != len(raw):
            raise TypeError(f"got a {type(raw).__name__} of {len(raw)} values but `fields:` "
                            f"names {len(fields)} ({', '.join(fields)}): name one per value")
        names = fields if fields is not None else [str(k) for k in range(len(raw))]
        items = list(zip(names, raw, strict=True))
    else:
        if fields is not None and len(fields) != 1:
            raise TypeError(f"got one value ({_kind(raw)}) but `fields:` names "
                            f"{len(fields)} ({', '.join(fields)}): name one per value")
        items = [(fields[0] if fields else "0", raw)]
    return {name: _value(name, v) for name, v in items}


def _value(name: str, v: Any) -> Any:
    """A field's value as numpy (or the Python number it is); TypeError naming it if none."""
    if type(v) is np.ndarray and v.dtype.kind in "biuf":  # the common case first
        return v
    if isinstance(v, np.ndarray | np.generic | bool | int | float):
        out = v
    elif hasattr(v, "numpy") and callable(v.numpy):  # a tensor: torch, tf, ...
        try:
            t = v.detach() if hasattr(v, "detach") else v
            out = (t.cpu() if hasattr(t, "cpu") else t).numpy()
        except Exception as e:  # bfloat16 and other dtypes numpy lacks
            raise TypeError(f"field {name!r}: {_kind(v)} does not convert to numpy ({e}): "
                            "return it as float32 (`.float()`) or another numpy dtype") from None
    elif hasattr(v, "__array__") or hasattr(v, "__array_interface__"):  # PIL, jax, pandas...
        out = np.asarray(v)
    else:
        hint = {str: "encode text as token ids (an int array) or leave it out",
                bytes: "decode it into an array (np.frombuffer) or leave it out",
                type(None): "every sample needs a value for every field"}.get(type(v), RETURN)
        if isinstance(v, Mapping | tuple | list):
            hint = "nested containers are not batched: give each array a field of its own"
        raise TypeError(f"field {name!r} is {_kind(v)}: {hint}")
    if isinstance(out, np.ndarray | np.generic) and out.dtype.kind not in "biuf":
        raise TypeError(f"field {name!r} has dtype {out.dtype}: only bool, int and float "
                        "dtypes are batched; encode it as numbers or leave it out")
    return out


def _kind(v: Any) -> str:
    """`a str`, `a Tensor of torch.bfloat16`: what a value is, for errors."""
    if v is None:
        return "None"
    dtype = getattr(v, "dtype", None)
    return f"a {type(v).__name__}" + (f" of {dtype}" if dtype is not None else "")


class WithTransform:
    """A dataset whose samples go through the user's `transform(sample, rng)` after the
    format's own decoding; rng is seeded by (seed, epoch, index), apart from the format's.
    It returns a dict of fields, whose values are taken as a python dataset's (tensors too)."""

    def __init__(self, dataset: Any, spec: str) -> None:
        self.dataset = dataset
        self.spec = spec
        self.fn = load_callable(spec, "transform")
        self._read = DatasetParts.of(dataset).read  # the format's sample(i, key), or [i]

    def __len__(self) -> int:
        return len(self.dataset)

    def sample(self, index: int, key: EpochKey) -> Any:
        out = self.fn(self._read(index, key), key.rng(index, stream=1))
        if not isinstance(out, Mapping):
            raise TypeError(f"transform {self.spec!r} returned {type(out).__name__}, "
                            "expected a dict of fields")
        try:
            return as_fields(out)
        except TypeError as e:
            raise TypeError(f"transform {self.spec!r}: {e}") from None

    def __getitem__(self, index: int) -> Any:
        return self.sample(index, FIRST_EPOCH)

    def __getattr__(self, name: str) -> Any:
        # The optional parts but `sample` (source_of, objects_of, ...; see DatasetParts): the
        # format's own, where it has them.
        return getattr(self.__dict__["dataset"], name)
