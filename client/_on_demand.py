"""What a RemoteLoader does beside its loop, because a batch is a pure function of its
coordinates: any batch on demand (`batch_at`), and later ones (seek, exclusions,
provenance) built on it. A RemoteLoader holds one `OnDemand` (client/_loader.py), which reads
and moves the loader's fields named in `Loader` and nothing else.

Threading: the loop's thread, like the loader; a batch_at during an iteration opens a stream
of its own (client/_oneshot.py) and uses buffers of its own, so the loop's window, buffers
and position are untouched.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from stoker.v1 import stoker_pb2 as pb

from ._oneshot import ask_sources, fetch_one
from .contact.first import first_contact
from .delivery.buffers import HostBuffers
from .delivery.images import flat_images
from .position.exclusions import Excluded
from .position.resume import LAST_EPOCH

if TYPE_CHECKING:
    import numpy as np

    from ._errors import RemoteError
    from ._options import LoaderOptions
    from ._stall import Stall
    from .contact.agreement import FingerprintCheck
    from .fleet.kept import KeptScheduler
    from .fleet.servers import ServerSet
    from .position.place import Place
    from .position.resume import Saved
    from .transport.frames import Assembled
    from .transport.stream import StreamSpec

# provenance()'s parts of a sample's source (pb.SampleSource's fields of those names)
PLACE = ("file", "offset", "nbytes", "line", "row_group", "row", "member", "component",
         "component_index")


class Loader(Protocol):
    """What the on-demand calls read and move of their loader (RemoteLoader is one; a type
    checker holds it to this where it hands itself over)."""

    _feed: Any  # a DeviceFeed, or None
    _servers: ServerSet
    _stall: Stall
    _kept: KeptScheduler

    def describe(self) -> pb.DescribeDatasetResponse: ...
    def _refuse(self, err: RemoteError) -> None: ...
    def _spec(self, coordinates: pb.Coordinates, allocate: Any = None,
              finish: Any = None) -> StreamSpec: ...


class OnDemand:
    """batch_at and the conversions it shares with the loop (see the module docstring), for
    one loader, which holds it."""

    def __init__(self, loader: Loader, place: Place, normalize: Any, options: LoaderOptions,
                 agreement: FingerprintCheck,
                 described: dict[tuple[int, int], pb.DescribeDatasetResponse],
                 ask: Callable[[pb.DescribeDatasetRequest, int, int],
                               pb.DescribeDatasetResponse]) -> None:
        self._loader = loader
        self._agreement = agreement  # the loader's fingerprint check, read here
        self._described = described  # the loader's Describe answers, by _key
        self._ask = ask  # the loader's Describe of the first server that answers
        self._place = place  # the loader's position: read here, moved by named moves
        self._normalize = normalize  # a Normalizer, or None
        self._options = options  # the loader's, read only
        self._aside: tuple[HostBuffers, Any] | None = None  # batch_at's buffers, device feed

    def seek(self, step: int, world_sizes: int | Sequence[tuple[int, int]] | None = None
             ) -> None:
        """Make the next batch global step `step` of this job: the batch every rank takes
        after `step` steps, counted from epoch 0, batch 0 at these coordinates (under
        batch_tokens, each epoch's plan's steps). After loading a model checkpoint,
        `loader.seek(model_step)` is a complete resume: no loader state is needed (but the
        exclusions, see exclude). One request, whatever the step: a server finds the epoch
        and batch (docs/client.md#any-batch-on-demand-batch_at-and-seek).

        A job that ran at another world size says so: `world_sizes=4` (every one of the
        `step` steps at 4 ranks), or `[(0, 4), (1200, 3)]` (steps from 0 at 4 ranks, from
        1200 at 3: each stretch's first step, ascending). A step is one batch of every rank
        at the size then; each change is an elastic resume (the positions consumed so far
        start the rest of the epoch, re-cut at the new size), and this loader goes on at its
        own size from `step`, exactly as `load_state_dict` of a state saved there would.

        Args:
            step: the global step the next batch is, >= 0.
            world_sizes: None (the job always ran at this loader's world_size), an int (it
                ran at that size), or (from_step, world_size) pairs, ascending from step 0.

        Raises:
            ValueError: `step` not an int >= 0, or `world_sizes` not as above.
            RemoteError: INVALID_ARGUMENT naming what the server found wrong (a stretch
                past `step`, say).

        Example::

            model_step = load_model_checkpoint()  # the steps the model has taken
            loader.seek(model_step)
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        agreed = self._agreement.fingerprint
        stretches = _stretches(world_sizes, step)
        request = pb.DescribeDatasetRequest(
            coordinates=self._place.coords.message(0, 0, agreed.digest if agreed else ""),
            locate=pb.Locate(step=step, world_sizes=[
                pb.WorldSizeFrom(from_step=f, world_size=w) for f, w in stretches]))
        # Its answer describes the epoch located, from the start located: cached there (a
        # start > 0 is possible after a change of size: not a whole epoch's sizes to warn of)
        rest = 1 if stretches else 0
        described = self._ask(request, 0, rest)
        self._described.pop(self._key(0, rest))
        located = described.located
        self._place.seek(located.epoch, located.start, located.batch_index)
        self._described[self._key(located.epoch, located.start)] = described

    def _planned(self, saved: Saved) -> int:
        """Positions consumed by the job that saved `saved` (under batch_tokens, at its
        world_size): where its epoch's plan ended step `next_batch` (one request)."""
        agreed = self._agreement.fingerprint
        at = saved.at
        theirs = dataclasses.replace(self._place.coords, rank=0,
                                     world_size=saved.world_size)
        request = pb.DescribeDatasetRequest(
            coordinates=theirs.message(at.epoch, at.start, agreed.digest if agreed else ""),
            consumed=pb.Consumed(steps=at.next_batch))
        loader, o = self._loader, self._options
        return first_contact(loader._servers, lambda: request, connect_timeout=o.connect_timeout,
                             timeout=o.timeout, tls=o.channels.tls,
                             refuse=loader._refuse).described.consumed

    # -- exclusions -------------------------------------------------------------------------
    def exclude(self, sample_indices: Iterable[int]) -> None:
        """Leave these samples (dataset indices, as in `sample_index`) out of every batch
        from the next one on, for the rest of the run: each batch that holds one has that
        many fewer rows; every other sample stays where it was (positions are not
        renumbered, so resume, `seek` and an elastic resume stay exact). The set only grows;
        `state_dict()` records it (and `load_state_dict` adds a state's to the loader's), the
        servers apply it on every rank. Call it between loops (after `break`), not inside
        one: RuntimeError. At most 100,000 samples in all: ValueError past that
        (docs/client.md#finding-and-skipping-the-data-behind-a-loss-spike).

        Args:
            sample_indices: dataset indices (ints in [0, num_samples)).

        Raises:
            RuntimeError: called inside a loop over the loader.
            ValueError: more than 100,000 samples in all.
        """
        if self._loader._stall.running:
            raise RuntimeError("exclude() inside a loop over the loader: leave the loop "
                               "(break) first; the next loop goes on without those samples")
        excluded = Excluded.union(self._place.coords.excluded, sample_indices)
        if excluded != self._place.coords.excluded:
            self._place.exclude(excluded)
            self._loader._kept.drop()  # what it fetched ahead holds the samples

    def empty_batch(self, allocate: Any) -> Any:
        """What makes the batch of 0 rows that a batch whose samples are all excluded is (on
        a receive thread): every described field, its varying axes 0, in a buffer of
        `allocate`'s; None before the dataset was described (no exclusion yet either)."""
        if self._place.coords.excluded is None:
            return None
        fields = [pb.TensorInfo(name=f.name, dtype=f.dtype, shape=[0, *(max(d, 0) for d in
                                                                         f.shape)])
                  for f in self._loader.describe().fields]

        def empty(epoch: int, index: int) -> Assembled:
            from .transport.frames import Assembled

            return Assembled(index, epoch, allocate(64)[0], fields, 0)

        return empty

    @property
    def excluded(self) -> tuple[int, ...]:
        """The samples this run leaves out (sorted), see exclude."""
        excluded = self._place.coords.excluded
        return excluded.indices if excluded else ()

    # -- sizes: a Describe per epoch under batch_tokens, one for all epochs otherwise ------
    def _key(self, epoch: int, start: int) -> tuple[int, int]:
        """Where Describe's answer for `epoch`'s positions from `start` is cached: each epoch
        of a token budget has its plan's steps; cut by count, every epoch has the same."""
        return (epoch if self._options.batch_tokens else 0, start)

    def _sizes(self, epoch: int, start: int) -> pb.DescribeDatasetResponse:
        """Describe's answer for `epoch`'s positions from `start`, asked once."""
        described = self._described.get(self._key(epoch, start))
        if described is None:
            agreed = self._agreement.fingerprint
            request = pb.DescribeDatasetRequest(coordinates=self._place.coords.message(
                epoch, start, agreed.digest if agreed else ""))
            described = self._ask(request, epoch, start)
        return described

    def following(self, epoch: int) -> pb.DescribeDatasetResponse | None:
        """The sizes of `epoch` (the next one, whose first batches are asked for while the
        loop ends its epoch) when known without a request; under batch_tokens one is made
        (its plan's steps are its own). None after the last epoch: its number would not fit
        a request."""
        if epoch > LAST_EPOCH:
            return None
        if self._options.batch_tokens:
            return self._sizes(epoch, 0)
        return self._described.get(self._key(epoch, 0))

    def batch_at(self, epoch: int, index: int) -> dict[str, Any]:
        """The batch this rank is given at batch `index` of `epoch`: the same bytes, type and
        device as iteration gives there, in one request to one server (a stream of its
        own), whatever the loop is doing. In the epoch the loader is in, after an elastic
        resume (`start`), `index` counts batches of that epoch's rest, as iteration does.
        INVALID_ARGUMENT (RemoteError) for an index past the epoch.

        Args:
            epoch: the epoch.
            index: the batch's index in it (this rank's batches).

        Returns:
            The batch, as iteration yields it.

        Raises:
            RemoteError: INVALID_ARGUMENT for an index past the epoch.

        Example::

            bad = loader.batch_at(epoch=3, index=1207)  # the batch before a loss spike
        """
        coordinates = self._coordinates_at(epoch, index)
        _, feed = self._aside_buffers()
        loader = self._loader
        spec = loader._spec(coordinates, allocate=lambda n: self._allocate_aside(n),
                            finish=lambda b: self.convert(b, feed))
        return self.handed(fetch_one(loader._servers, spec, index, self._options.timeout),
                            feed)

    def provenance(self, epoch: int, index: int) -> list[dict[str, Any]]:
        """Where each sample of `batch_at(epoch, index)` comes from, in its row order:
        `{"sample_index": i, "source": "FILE line N" | "FILE row group G row R" |
        "FILE member KEY.*" | "FILE tokens A..B" | path or s3:// key}` (a mixture's begins
        "component 'NAME' sample J, "), and the same by part, each where the format knows
        it: "file" (path or URL), "offset" and "nbytes" (the bytes read for the sample in
        it: a jsonl record, a tar member, a tokens window), "line" (jsonl), "row_group" and
        "row" (parquet), "member" (tar), "component" and "component_index" (a mixture).
        One request; no sample is read.

        Args:
            epoch: the epoch.
            index: the batch's index in it (as in batch_at).

        Returns:
            One dict per sample of the batch, in its row order.
        """
        request = pb.ProvenanceRequest(coordinates=self._coordinates_at(epoch, index),
                                       batch_index=index)
        answer = ask_sources(self._loader._servers, request, self._options.timeout)
        return [{"sample_index": s.sample_index, "source": s.source,
                 **{k: getattr(s, k) for k in PLACE if s.HasField(k)}} for s in answer.samples]

    def _coordinates_at(self, epoch: int, index: int) -> pb.Coordinates:
        """The coordinates of batch `index` of `epoch` (see batch_at), the data pinned."""
        if epoch < 0 or index < 0:
            raise ValueError(f"epoch and index must be >= 0, got epoch={epoch}, index={index}")
        self._loader.describe()  # pins the fingerprint: the batch is of the loop's data
        agreed = self._agreement.fingerprint
        start = self._place.at.start if epoch == self._place.at.epoch else 0
        return self._place.coords.message(epoch, start, agreed.digest if agreed else "")

    def _aside_buffers(self) -> tuple[HostBuffers, Any]:
        """batch_at's own buffers (and CUDA stream): the loop's pools are sized to its window
        and may all be in use."""
        if self._aside is None:
            feed = None
            if self._loader._feed is not None:
                from .delivery.device import DeviceFeed

                feed = DeviceFeed(self._options.device, max_buffers=2,
                                  normalize=self._loader._feed.normalize)
            self._aside = (HostBuffers(max_buffers=2), feed)
        return self._aside

    def _allocate_aside(self, nbytes: int) -> tuple[Any, np.ndarray]:
        host, feed = self._aside_buffers()
        if feed is not None:
            return feed.allocate(nbytes)
        buf = host.acquire(nbytes)
        return buf, buf

    def convert(self, batch: Assembled, feed: Any) -> Any:
        """An assembled batch as the caller gets it (receive threads): on `feed`'s device,
        else numpy views or CPU tensors, normalized if asked."""
        from .transport.tensors import numpy_views

        normalize = self._normalize
        if feed is not None:
            return feed.to_device(batch.buffer, batch.tensors)
        arrays = numpy_views(batch.buffer, batch.tensors)
        if self._options.output == "numpy":
            return normalize.numpy(arrays) if normalize else arrays
        import torch

        tensors = {k: torch.from_numpy(v) for k, v in arrays.items()}
        return normalize.torch(tensors) if normalize else tensors

    def handed(self, batch: Any, feed: Any) -> Any:
        """A finished batch as the loop's thread hands it out: the current CUDA stream waits
        for its copy; images in conversations made flat; packed under pack=True."""
        if feed is not None:
            batch = feed.hand_over(*batch)
        batch = flat_images(batch)
        if self._options.pack:
            from .packing import pack_padded

            batch = pack_padded(batch)
        return batch


def _stretches(world_sizes: int | Sequence[tuple[int, int]] | None, step: int
               ) -> list[tuple[int, int]]:
    """seek's `world_sizes` as (from_step, world_size) pairs; ValueError naming what is not
    (the servers check the order: from 0, ascending, none past `step`)."""
    if world_sizes is None:
        return []
    if isinstance(world_sizes, int) and not isinstance(world_sizes, bool):
        world_sizes = [(0, world_sizes)]
    try:
        pairs = [(f, w) for f, w in world_sizes]  # type: ignore[union-attr]
    except (TypeError, ValueError):
        pairs = []
    if not pairs or any(isinstance(x, bool) or not isinstance(x, int) for p in pairs
                        for x in p):
        raise ValueError(f"world_sizes must be a world size (int) or (from_step, world_size) "
                         f"pairs of ints, got {world_sizes!r}")
    if pairs[0][0] != 0 or any(b[0] <= a[0] for a, b in itertools.pairwise(pairs)):
        raise ValueError(f"world_sizes' from_steps must begin at 0 and ascend, got {pairs}")
    if pairs[-1][0] > step or min(w for _, w in pairs) < 1:
        raise ValueError(f"world_sizes must name sizes >= 1 from steps <= step={step}, got "
                         f"{pairs}")
    return pairs
