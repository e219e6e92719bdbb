"""`RemoteLoader(normalize=...)`: uint8 image fields normalised after they arrive.

A server that leaves `normalize` out of its transforms sends images as uint8: 4x fewer bytes
than float32 (2x fewer than float16). The loader then computes (x / 255 - mean) / std itself,
as x * scale + bias, on the device the batch lands on: on a CUDA device that is two kernels on
the copy's side stream, overlapping the model's compute, instead of CPU time on either side.

The channel axis is 1 when the field's per-sample shape starts with the channel count (CHW,
stoker's default layout), else the last axis when it ends with it (HWC).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

DTYPES = ("float32", "float16", "bfloat16")


class Normalizer:
    def __init__(self, spec: Mapping[str, tuple[Sequence[float], Sequence[float]]],
                 dtype: str) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"normalize_dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        self.dtype = dtype
        self.fields: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for name, pair in spec.items():
            try:
                mean, std = (np.asarray(v, np.float64).reshape(-1) for v in pair)
            except (TypeError, ValueError):
                raise ValueError(f"normalize[{name!r}] must be (mean, std), two sequences of "
                                 f"numbers, got {pair!r}") from None
            if len(mean) != len(std) or len(mean) == 0:
                raise ValueError(f"normalize[{name!r}]: mean has {len(mean)} values, std "
                                 f"{len(std)}; one per channel each")
            if np.any(std <= 0):
                raise ValueError(f"normalize[{name!r}]: std must be > 0, got {std.tolist()}")
            self.fields[name] = (1.0 / (255.0 * std), -mean / std)
        self.axes: dict[str, int] = {}  # channel axis in the batch, set by validate()
        self._cache: dict[Any, Any] = {}

    def validate(self, fields: Sequence[Any]) -> None:
        """Check against the dataset's fields (FieldSpec: name, dtype, per-sample shape) and
        find each one's channel axis; ValueError naming what does not fit."""
        specs = {f.name: f for f in fields}
        missing = sorted(set(self.fields) - set(specs))
        if missing:
            raise ValueError(f"normalize names fields the dataset does not have: {missing} "
                             f"(fields: {sorted(specs)})")
        for name, (scale, _) in self.fields.items():
            spec, channels = specs[name], len(scale)
            shape = list(spec.shape)
            if spec.dtype != "uint8":
                raise ValueError(f"normalize[{name!r}]: the field is {spec.dtype}, not uint8: "
                                 "leave `normalize` out of the server's transforms to get "
                                 "uint8 images")
            if len(shape) >= 2 and shape[0] == channels:
                self.axes[name] = 1
            elif len(shape) >= 2 and shape[-1] == channels:
                self.axes[name] = len(shape)
            else:
                raise ValueError(f"normalize[{name!r}]: per-sample shape {shape} has no axis "
                                 f"of {channels} channels, first (CHW) or last (HWC)")

    def numpy(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = dict(batch)
        for name, (scale, bias) in self.fields.items():
            x, axis = batch[name], self.axes[name]
            shape = [1] * x.ndim
            shape[axis] = -1
            dtype = np.float16 if self.dtype == "float16" else np.float32
            y = np.multiply(x, scale.astype(np.float32).reshape(shape), dtype=np.float32)
            y += bias.astype(np.float32).reshape(shape)
            out[name] = y.astype(dtype, copy=False)
        return out

    def torch(self, batch: dict[str, Any]) -> dict[str, Any]:
        """On the tensors' own device and the current stream."""
        import torch

        out = dict(batch)
        dtype = getattr(torch, self.dtype)
        for name, (scale, bias) in self.fields.items():
            x, axis = batch[name], self.axes[name]
            key = (name, x.device, axis, x.ndim)
            if key not in self._cache:
                shape = [1] * x.ndim
                shape[axis] = -1
                self._cache[key] = tuple(
                    torch.as_tensor(v, dtype=torch.float32).reshape(shape).to(x.device)
                    for v in (scale, bias))
            s, b = self._cache[key]
            # float32 arithmetic whatever the output dtype, as the server's normalize does
            out[name] = torch.addcmul(b, x.to(torch.float32), s).to(dtype)
        return out
