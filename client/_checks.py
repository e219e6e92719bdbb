"""What a loader checks once a server has described the dataset: an epoch without a single
batch, and the samples `drop_last` leaves out.

Each says what was asked, what the server has, and what to change, on the `stoker.client`
logger (shown without any logging configuration: _log.py) or as a ValueError. (`prefetch`
against the servers' max_credits is the window's: fleet/window.py.)
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
    batch = o.batch_size or 0  # said only for batches of a size (not under batch_tokens)
    short = per_rank % batch if batch and o.drop_last and d.batches_per_epoch else 0
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
