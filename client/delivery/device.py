"""Host-to-device copies that overlap the model's compute.

Received batches are assembled in pinned host buffers from a BufferPool; each is copied to the
device with non_blocking=True on a side CUDA stream, whose event guards the buffer's reuse.
When the consumer takes the batch, its current stream waits for the copy and the tensors are
recorded on that stream, so the caching allocator does not reuse their memory early.

Threading: to_device() runs on the receive thread, hand_over() on the consumer's thread.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .buffers import BufferPool


class DeviceFeed:
    def __init__(self, device: Any, max_buffers: int, normalize: Any = None) -> None:
        import torch

        self.torch = torch
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"device must be a CUDA device (or None for CPU), got {device!r}")
        if not torch.cuda.is_available():
            raise RuntimeError(f"device={device!r} but CUDA is not available")
        self.stream = torch.cuda.Stream(self.device)
        self.normalize = normalize  # a Normalizer, run on the side stream after the copy
        self.pool: BufferPool[Any] = BufferPool(
            lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True),
            lambda t: t.numel(), max_buffers)

    def allocate(self, nbytes: int) -> tuple[Any, np.ndarray]:
        buf = self.pool.acquire(nbytes)
        return buf, buf.numpy()

    def to_device(self, buf: Any, tensors: list[Any]) -> tuple[dict[str, Any], Any]:
        """Start the copy of every tensor in pinned `buf`; return device tensors and the event."""
        torch = self.torch
        out = {}
        with torch.cuda.stream(self.stream):
            for t in tensors:
                host = buf[t.offset : t.offset + t.nbytes].view(_torch_dtype(torch, t.dtype))
                out[t.name] = host.view(tuple(t.shape)).to(self.device, non_blocking=True)
            if self.normalize is not None:
                out = self.normalize.torch(out)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.pool.release(buf, event)
        return out, event

    def hand_over(self, batch: dict[str, Any], event: Any) -> dict[str, Any]:
        """Make the consumer's current stream wait for the copy; protect the memory."""
        current = self.torch.cuda.current_stream(self.device)
        current.wait_event(event)
        for t in batch.values():
            t.record_stream(current)
        return batch


def _torch_dtype(torch: Any, name: str) -> Any:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"no torch dtype for {name!r}")
    return dtype
