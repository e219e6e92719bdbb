"""What a RemoteLoader does beside its loop, because a batch is a pure function of its
coordinates: any batch on demand (`batch_at`), and later ones (seek, exclusions,
provenance) built on it. `OnDemand` is a base of RemoteLoader (client/_loader.py); it reads
the loader's fields named below and nothing else.

Threading: the loop's thread, like the loader; a batch_at during an iteration opens a stream
of its own (client/_oneshot.py) and uses buffers of its own, so the loop's window, buffers
and position are untouched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._buffers import HostBuffers
from ._oneshot import fetch_one

if TYPE_CHECKING:
    import numpy as np

    from stoker.v1 import stoker_pb2 as pb

    from ._frames import Assembled
    from ._options import LoaderOptions
    from ._pinning import Pinning
    from ._resume import Coordinates, Position
    from ._servers import ServerSet
    from ._stream import StreamSpec


class OnDemand:
    """batch_at and the conversions it shares with the loop (see the module docstring)."""

    _options: LoaderOptions
    _coords: Coordinates
    _at: Position
    _feed: Any  # a DeviceFeed, or None
    _servers: ServerSet
    _pinning: Pinning
    _normalize: Any  # a Normalizer, or None
    _aside: tuple[HostBuffers, Any] | None = None  # batch_at's buffers, and device feed

    if TYPE_CHECKING:  # RemoteLoader's
        def describe(self) -> pb.DescribeDatasetResponse: ...

        def _spec(self, coordinates: pb.Coordinates, allocate: Any = None,
                  finish: Any = None) -> StreamSpec: ...

    def batch_at(self, epoch: int, index: int) -> dict[str, Any]:
        """The batch this rank is given at batch `index` of `epoch`: the same bytes, type and
        device as iteration gives there, in one request to one server (a stream of its
        own), whatever the loop is doing. In the epoch the loader is in, after an elastic
        resume (`start`), `index` counts batches of that epoch's rest, as iteration does.
        INVALID_ARGUMENT (RemoteError) for an index past the epoch."""
        if epoch < 0 or index < 0:
            raise ValueError(f"epoch and index must be >= 0, got epoch={epoch}, index={index}")
        self.describe()  # pins the fingerprint: the batch is of the loop's data
        pin = self._pinning.pin
        start = self._at.start if epoch == self._at.epoch else 0
        coordinates = self._coords.message(epoch, start, pin.digest if pin else "")
        _, feed = self._aside_buffers()
        spec = self._spec(coordinates, allocate=lambda n: self._allocate_aside(n),
                          finish=lambda b: self._convert(b, feed))
        return self._handed(fetch_one(self._servers, spec, index, self._options.timeout), feed)

    def _aside_buffers(self) -> tuple[HostBuffers, Any]:
        """batch_at's own buffers (and CUDA stream): the loop's pools are sized to its window
        and may all be in use."""
        if self._aside is None:
            feed = None
            if self._feed is not None:
                from ._device import DeviceFeed

                feed = DeviceFeed(self._options.device, max_buffers=2,
                                  normalize=self._feed.normalize)
            self._aside = (HostBuffers(max_buffers=2), feed)
        return self._aside

    def _allocate_aside(self, nbytes: int) -> tuple[Any, np.ndarray]:
        host, feed = self._aside_buffers()
        if feed is not None:
            return feed.allocate(nbytes)
        buf = host.acquire(nbytes)
        return buf, buf

    def _convert(self, batch: Assembled, feed: Any) -> Any:
        """An assembled batch as the caller gets it (receive threads): on `feed`'s device,
        else numpy views or CPU tensors, normalized if asked."""
        from ._frames import numpy_views

        normalize = self._normalize
        if feed is not None:
            return feed.to_device(batch.buffer, batch.tensors)
        arrays = numpy_views(batch.buffer, batch.tensors)
        if self._options.output == "numpy":
            return normalize.numpy(arrays) if normalize else arrays
        import torch

        tensors = {k: torch.from_numpy(v) for k, v in arrays.items()}
        return normalize.torch(tensors) if normalize else tensors

    def _handed(self, batch: Any, feed: Any) -> Any:
        """A finished batch as the loop's thread hands it out: the current CUDA stream waits
        for its copy; packed under pack=True."""
        if feed is not None:
            batch = feed.hand_over(*batch)
        if self._options.pack:
            from .packing import pack_padded

            batch = pack_padded(batch)
        return batch
