"""What a loader checks once a server has described the dataset: an epoch without a single
batch, the samples `drop_last` leaves out, and `prefetch` against the server's `max_credits`;
and the `Window` of batches in flight that follows from them and from the batches' size.

Each says what was asked, what the server has, and what to change, on the `stoker.client`
logger (shown without any logging configuration: _log.py) or as a ValueError.
"""

from __future__ import annotations

import logging

from stoker.v1 import stoker_pb2 as pb

from ._log import say
from ._options import LoaderOptions

# drop_last leaving out at least this share of a rank's samples each epoch is a warning
# (with shuffle=False, any: the same samples are never used); less is a DEBUG line.
DROPPED_WARN = 0.10


def _shares(d: pb.DescribeDatasetResponse, o: LoaderOptions) -> str:
    """`dataset 'x' has 80 samples` (and this rank's share, with several ranks)."""
    text = f"dataset {o.dataset!r} has {d.num_samples} samples"
    if o.world_size > 1:
        text += f" ({d.samples_per_rank} for each of world_size={o.world_size} ranks)"
    return text


def check_epoch(d: pb.DescribeDatasetResponse, o: LoaderOptions) -> None:
    """ValueError when an epoch has no batch at all (the loop would run empty, silently)."""
    if d.batches_per_epoch == 0 and o.batch_tokens is not None:
        raise ValueError(f"{_shares(d, o)}: batch_tokens={o.batch_tokens} gives no batch per "
                         "epoch (fewer samples than ranks)")
    if d.batches_per_epoch == 0:
        more = (" or pass drop_last=False (one short batch per epoch)" if o.drop_last else "")
        raise ValueError(
            f"{_shares(d, o)}: batch_size={o.batch_size} with drop_last={o.drop_last} gives "
            f"no batch per epoch (len(loader) == 0, every epoch empty): lower batch_size"
            + more)


def say_dropped(d: pb.DescribeDatasetResponse, o: LoaderOptions) -> None:
    """Say how many samples each epoch leaves out: drop_last's short batch, and the ranks'
    remainder (as DistributedSampler(drop_last=True) cuts the order, drop_last or not)."""
    per_rank = d.samples_per_rank
    short = per_rank % o.batch_size if o.drop_last and d.batches_per_epoch else 0
    remainder = d.num_samples - per_rank * o.world_size
    if not short and not remainder:
        return
    parts = []
    if short:
        parts.append(f"drop_last=True leaves out the last {short} of this rank's {per_rank} "
                     f"samples every epoch (batch_size={o.batch_size} makes "
                     f"{d.batches_per_epoch} full batches; drop_last=False keeps them as a "
                     "short last batch)")
    if remainder:
        parts.append(f"{remainder} samples (num_samples % world_size) are in no rank's share "
                     "of an epoch")
    which = ("with shuffle=False they are the same samples every epoch: never used"
             if not o.shuffle else "with shuffle=True they are other samples each epoch")
    dropped = short * o.world_size + remainder
    loud = not o.shuffle or dropped >= DROPPED_WARN * d.num_samples
    say(logging.WARNING if loud else logging.DEBUG, "%s: %s; %s", _shares(d, o),
        "; ".join(parts), which)


# What a server allows when it does not say (server.max_credits' default): the most batches
# prefetch_bytes keeps in flight then.
MAX_CREDITS = 64


def credit_window(prefetch: int, max_credits: int, address: str) -> int:
    """`prefetch`, or the server's `max_credits` where that is lower (0: the server did not
    say), with a warning: one server may hold every credit (when the others fail), and more
    than max_credits ends its stream with RESOURCE_EXHAUSTED."""
    if not max_credits or prefetch <= max_credits:
        return prefetch
    say(logging.WARNING, "prefetch=%d is more than the server's max_credits=%d (%s): one "
        "stream may hold at most that many batch requests, and when the other servers fail "
        "one server holds them all; prefetching %d batches instead (lower prefetch, or raise "
        "server.max_credits)", prefetch, max_credits, address, max_credits)
    return max_credits


class Window:
    """The batches a loader keeps in flight (`size`): `prefetch`, under every server's
    max_credits once they said it, widened once for small batches (`fit`).

    Threading: the loop's thread, but for `batch_bytes`, which receive threads set as they
    allocate a batch (the latest wins: batches of one loader keep their size, near enough).
    """

    def __init__(self, prefetch: int) -> None:
        self.size = prefetch
        self.max_credits = MAX_CREDITS  # the lowest the servers said
        self.sized = False  # fitted to the batches' size (see fit)
        self.widened = False  # ... and widened for small batches
        self.batch_bytes = 0  # of the latest batch received

    def heed(self, max_credits: int, address: str) -> None:
        """A server said its max_credits: the window stays under it, and so does any
        widening of it later (0: a server that did not say)."""
        self.size = credit_window(self.size, max_credits, address)
        if max_credits:
            self.max_credits = min(self.max_credits, max_credits)

    def fit(self, prefetch_bytes: int) -> int | None:
        """Once the first batch's size is known: small batches are kept in flight by
        prefetch_bytes, not prefetch (each costs the servers a fixed time, which more in
        flight, asked for in groups, hides). The new, wider size, for the caller to grow its
        buffers and streams to, or None. Once per loader (`sized`)."""
        if not self.batch_bytes:
            return None
        self.sized = True
        if not prefetch_bytes:
            return None
        # As many as prefetch_bytes holds, at most half the servers' max_credits: failover
        # and hedges credit on top of it.
        window = min(prefetch_bytes // max(self.batch_bytes, 1), self.max_credits // 2)
        if window <= self.size:
            return None
        self.size, self.widened = window, True
        return window
