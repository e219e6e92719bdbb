"""`format: mixture`: other datasets of the config, drawn with weights (see server/order/mixture.py
for which sample fills each position).

The dataset's indices are the mixture's index space: `component_epoch * period + offset + i`
reads component sample i under the key (seed, component_epoch, shuffle), so a component's
augmentation and packing plan (`format: text`) are those of its own epoch, not the mixture's.
Every sample gets `source` (int64): the component's position in `components:`. Components
open before the mixture (the worker opens them once, for themselves and for every mixture);
their fields, renamed by each component's `fields:`, must agree in names, dtypes and shapes,
or the mixture does not open and says which differ.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..order.fingerprint import decode_version, fingerprint
from ..order.mixture import MixtureOrdering, Phase, locate, quantize
from ..order.sampling import FIRST_EPOCH, EpochKey, Ordering
from ..sources import ObjectInfo
from ._contract import DatasetParts
from .samples import Padded, fetch_sample

SOURCE = "source"


class Mixture:
    def __init__(self, cfg: Any, components: dict[str, DatasetParts],
                 configs: dict[str, Any]) -> None:
        self.cfg = cfg
        self.names = list(cfg.components)
        self.parts = [components[n] for n in self.names]
        self.configs = [configs[n] for n in self.names]
        # this component's field -> the mixture's name for it
        self.renames: list[dict[str, str]] = [{own: common for common, own in c.fields.items()}
                        for c in cfg.components.values()]
        sizes = [len(p.dataset) for p in self.parts]
        for name, n in zip(self.names, sizes, strict=True):
            if n == 0:
                raise ValueError(f"component {name!r} has no samples")
        self.sizes = np.array(sizes, dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        self.period = int(self.sizes.sum())
        self._starts = self.offsets.tolist()
        self._sources = [np.int64(c) for c in range(len(self.names))]
        self.samples_per_epoch = cfg.samples_per_epoch or self.period
        self._check_fields()
        self.storage = _Storages(self)

    # -- the Dataset protocol and its optional parts ---------------------------------------
    def decode_version(self) -> str:
        """Its components' image decode (server/images.py), the latest where they differ."""
        return max((decode_version(p) for p in self.parts), default="")

    def __len__(self) -> int:
        return self.period

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.sample(index, FIRST_EPOCH)

    def locate(self, index: int) -> tuple[int, int, int]:
        """(component, component epoch, component index) of index-space value `index`.
        Plain Python: called once a sample, where numpy's scalar calls cost more than the
        arithmetic."""
        epoch, rest = divmod(int(index), self.period)
        c = bisect.bisect_right(self._starts, rest) - 1
        return c, epoch, rest - self._starts[c]

    def sample(self, index: int, key: EpochKey) -> dict[str, Any]:
        c, epoch, i = self.locate(index)
        raw = self.parts[c].read(i, EpochKey(key.seed, epoch, key.shuffle))
        out = self._renamed(c, raw)
        out[SOURCE] = self._sources[c]
        return out

    def source_of(self, index: int) -> str:
        c, _, i = self.locate(index)
        part = self.parts[c]
        where = part.source_of(i) if part.source_of is not None else ""
        return f"component {self.names[c]!r} sample {i}" + (f", {where}" if where else "")

    def place_of(self, index: int) -> dict[str, Any]:
        c, _, i = self.locate(index)
        part = self.parts[c]
        inner = part.place_of(i) if part.place_of is not None else {}
        return {"component": self.names[c], "component_index": i, **inner}

    def objects_of(self, indices: np.ndarray) -> list[str]:
        comp, _, local = locate(np.asarray(indices, dtype=np.int64), self.offsets, self.period)
        keys: list[str] = []
        for c in np.unique(comp).tolist():
            part = self.parts[c]
            if part.objects_of is not None and part.storage is not None:
                keys += [f"{self.names[c]}/{k}" for k in part.objects_of(local[comp == c])]
        return keys

    # -- for the worker ----------------------------------------------------------------------
    def lengths(self, components: list[np.ndarray | None]) -> np.ndarray | None:
        """Each sample's token count over one period of the index space (an index's is that
        of index % period: server/order/token_batches.py), given each component's own, in
        `components:` order; None unless every component knows its lengths."""
        if any(c is None for c in components):
            return None
        return np.concatenate(components).astype(np.int64)  # type: ignore[arg-type]

    def ordering(self, components: list[Ordering]) -> MixtureOrdering:
        """The positions -> indices map, given each component's own Ordering."""
        phases = [Phase(start, quantize(weights))
                  for start, weights in self.cfg.phase_weights()]
        return MixtureOrdering(self.names, components, phases, self.samples_per_epoch)

    # -- fields ------------------------------------------------------------------------------
    def _renamed(self, c: int, raw: Any) -> dict[str, Any]:
        if not isinstance(raw, dict):
            return raw  # fetch_sample names what it got
        renames = self.renames[c]
        if not renames:
            return dict(raw)  # a copy: `source` goes in, the component may reuse its dict
        return {renames[k] if k in renames else k: v for k, v in raw.items()}

    def _check_fields(self) -> None:
        """Components' sample 0, renamed, must have the same fields, dtypes and shapes."""
        seen = []
        for c, part in enumerate(self.parts):
            own = fetch_sample(part, 0)
            missing = sorted(set(self.renames[c]) - set(own))
            if missing:
                raise ValueError(
                    f"component {self.names[c]!r}: fields: renames {', '.join(missing)}, which "
                    f"it does not have; its fields: {', '.join(sorted(own))}")
            fields = {self.renames[c].get(k, k): v for k, v in own.items()}
            if SOURCE in fields:
                raise ValueError(
                    f"component {self.names[c]!r} has a field {SOURCE!r}, which a mixture "
                    f"adds itself: rename it under the component, e.g. {{weight: ..., "
                    f"fields: {{{SOURCE}_: {SOURCE}}}}}")
            seen.append(fields)
        first = seen[0]
        for c, fields in enumerate(seen[1:], 1):
            if fields.keys() != first.keys():
                raise ValueError(
                    f"components' fields differ: {self.names[0]!r} has "
                    f"{', '.join(sorted(first))}; {self.names[c]!r} has "
                    f"{', '.join(sorted(fields))}. Give them common names with `fields:` "
                    f"under a component, e.g. {self.names[c]}: {{weight: ..., fields: "
                    "{mixture_name: its_name}}")
            for name, v in fields.items():
                w = first[name]
                ragged = isinstance(v, Padded) or isinstance(w, Padded)
                if v.dtype != w.dtype or (v.ndim != w.ndim if ragged else v.shape != w.shape):
                    raise ValueError(
                        f"field {name!r}: component {self.names[0]!r} gives "
                        f"{w.dtype}{list(w.shape)}, {self.names[c]!r} gives "
                        f"{v.dtype}{list(v.shape)}: a batch needs the same dtype and shape")


class _Storages:
    """The components' storages as one, for what the server asks of a dataset's storage:
    prefetch and verify (keys `component/key`), and `listed`, which makes the mixture's
    fingerprint cover every component's fingerprint and listing."""

    def __init__(self, mixture: Mixture) -> None:
        self._mixture = mixture
        self.listed = self
        self.url = "mixture:" + ",".join(mixture.names)

    def values(self) -> Iterator[ObjectInfo]:
        m = self._mixture
        for name, part, cfg in zip(m.names, m.parts, m.configs, strict=True):
            # The component's config and data as one line: a change to either changes ours.
            # Its decode is the mixture's decode_version, after the data's digest.
            own = fingerprint(cfg, part)
            yield ObjectInfo(f"{name}/", 0, own.digest.partition("+")[0])
            if part.storage is not None:
                for o in part.storage.listed.values():
                    yield ObjectInfo(f"{name}/{o.key}", o.size, o.version)

    def _split(self, keys: list[str]) -> dict[int, list[str]]:
        by: dict[int, list[str]] = {}
        index = {n: c for c, n in enumerate(self._mixture.names)}
        for key in keys:
            name, _, rest = key.partition("/")
            by.setdefault(index[name], []).append(rest)
        return by

    def prefetch(self, keys: list[str]) -> None:
        for c, own in self._split(keys).items():
            storage = self._mixture.parts[c].storage
            if storage is not None:
                storage.prefetch(own)

    def verify(self, keys: list[str]) -> None:
        for c, own in self._split(keys).items():
            storage = self._mixture.parts[c].storage
            if storage is not None:
                storage.verify(own)
