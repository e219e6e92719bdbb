"""Epoch arithmetic on a dataset as the server opened it: a batch's sample indices and an
epoch's size, cut by count or, under batch_tokens, by the token plan."""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from . import token_batches
from .sampling import (
    CoordinateError,
    Coordinates,
    Ordering,
    batch_samples,
    batches_per_epoch,
    samples_per_rank,
)


class EpochSource(Protocol):
    """What the arithmetic reads of a dataset (pool/messages.py's DatasetMeta has it)."""

    num_samples: int
    ordering: Ordering
    lengths: np.ndarray | None  # each sample's token count, where the dataset knows it


def samples_of(meta: EpochSource, c: Coordinates, index: int) -> np.ndarray:
    """Dataset indices of batch `index`: cut by count, or by tokens under batch_tokens; less
    the excluded samples (server/order/exclusion.py)."""
    if c.batch_tokens:
        assert meta.lengths is not None  # checked with the coordinates
        samples = token_batches.batch_samples(meta.ordering, meta.lengths, c, index)
    else:
        samples = batch_samples(meta.ordering, c, index)
    return samples if c.excluded is None else c.excluded.drop(samples)


def epoch_size(meta: EpochSource, c: Coordinates) -> tuple[int, int]:
    """(batches per epoch, samples per rank) under `c`; under batch_tokens the samples of
    the epoch's steps divided by world_size (ranks' counts differ, their tokens do not)."""
    if c.batch_tokens:
        assert meta.lengths is not None
        p = token_batches.plan(meta.ordering, meta.lengths, c)
        return p.steps, len(p.members) // c.world_size
    return batches_per_epoch(meta.num_samples, c), samples_per_rank(meta.num_samples, c)


def locate(meta: EpochSource, c: Coordinates, step: int) -> tuple[int, int]:
    """(epoch, batch index) of global step `step` of `c` counted from epoch 0, batch 0 (`c`'s
    epoch and start ignored). Cut by count, every epoch has the same batches: arithmetic.
    Under batch_tokens each epoch's plan has its own steps: the plans of the epochs before
    the step are made (cached in PLANS), one per epoch skipped. CoordinateError for a
    negative step, or coordinates whose epochs have no batch."""
    if step < 0:
        raise CoordinateError("locate.step", f"must be >= 0, got {step}")
    epoch = 0
    while True:
        at = dataclasses.replace(c, epoch=epoch, start=0)
        steps = epoch_size(meta, at)[0]
        if steps <= 0:
            raise CoordinateError("locate.step", "these coordinates give no batch per epoch")
        if not c.batch_tokens:
            return divmod(step, steps)
        if step < steps:
            return epoch, step
        step -= steps
        epoch += 1


def consumed(meta: EpochSource, c: Coordinates, steps: int) -> int:
    """Positions of `c`'s epoch consumed once every rank has taken `steps` batches from
    `c.start`: a prefix of the order, [0, consumed). Cut by count, `steps` full batches of
    every rank; under batch_tokens, where the epoch's plan ends step `steps`.
    CoordinateError for steps outside [0, the epoch's batches]."""
    batches = epoch_size(meta, c)[0]
    if not 0 <= steps <= batches:
        raise CoordinateError("consumed.steps", f"must be in [0, {batches}] for this epoch, "
                                                f"got {steps}")
    if c.batch_tokens:
        assert meta.lengths is not None
        return int(token_batches.plan(meta.ordering, meta.lengths, c).cuts[steps])
    return min(c.start + steps * c.batch_size * c.world_size, meta.num_samples)
