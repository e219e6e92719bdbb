"""Epoch arithmetic on a dataset as the server opened it: a batch's sample indices and an
epoch's size, cut by count or, under batch_tokens, by the token plan."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from . import token_batches, token_windows
from .sampling import (
    ORDER_LEGACY,
    CoordinateError,
    Coordinates,
    Ordering,
    batch_samples,
    batches_per_epoch,
    samples_per_rank,
)


class EpochSource(Protocol):
    """What the arithmetic reads of a dataset (pool/messages.py's DatasetMeta has it)."""

    # Read-only: DatasetMeta is a frozen dataclass.
    @property
    def num_samples(self) -> int: ...
    @property
    def ordering(self) -> Ordering: ...
    @property
    def lengths(self) -> np.ndarray | None:
        """Each sample's token count, where the dataset knows it."""


def samples_of(meta: EpochSource, c: Coordinates, index: int) -> np.ndarray:
    """Dataset indices of batch `index`: cut by count, or by tokens under batch_tokens; less
    the excluded samples (server/order/sampling.py's Exclusion)."""
    if c.batch_tokens:
        assert meta.lengths is not None  # checked with the coordinates
        plans = token_batches if c.order == ORDER_LEGACY else token_windows
        samples = plans.batch_samples(meta.ordering, meta.lengths, c, index)
    else:
        samples = batch_samples(meta.ordering, c, index)
    return samples if c.excluded is None else c.excluded.drop(samples)


def epoch_size(meta: EpochSource, c: Coordinates) -> tuple[int, int]:
    """(batches per epoch, samples per rank) under `c`; under batch_tokens the samples of
    the epoch's steps divided by world_size (ranks' counts differ, their tokens do not)."""
    if c.batch_tokens:
        assert meta.lengths is not None
        if c.order != ORDER_LEGACY:  # windows: the positions planned, less the tail
            steps = token_windows.batches_per_epoch(meta.ordering, meta.lengths, c)
            return steps, max(meta.num_samples - c.start, 0) // c.world_size
        p = token_batches.plan(meta.ordering, meta.lengths, c)
        return p.steps, len(p.members) // c.world_size
    return batches_per_epoch(meta.num_samples, c), samples_per_rank(meta.num_samples, c)


def locate(meta: EpochSource, c: Coordinates, step: int,
           world_sizes: Sequence[tuple[int, int]] = ()) -> tuple[int, int, int]:
    """(epoch, start, batch index) at `c`'s world_size of global step `step` counted from
    epoch 0, batch 0 (`c`'s epoch and start ignored). `world_sizes`: (from_step, world_size)
    of each stretch of steps taken at another size (the first from 0, ascending, none past
    `step`); from `step` on, `c.world_size`. Each change of size is an elastic resume: the
    positions every rank had consumed (a prefix of the epoch's order) start the epoch's rest
    at the new size, whose batches go on counting steps. Cut by count, whole epochs are
    skipped by arithmetic; under batch_tokens each epoch's plan has its own steps (their
    counts cached: token_batches.STEPS). CoordinateError for a negative step, a bad
    history, or coordinates whose epochs have no batch."""
    if step < 0:
        raise CoordinateError("locate.step", f"must be >= 0, got {step}")
    history = [*(_history(world_sizes, step) or [(0, c.world_size)]), (step, c.world_size)]
    epoch, start, taken = 0, 0, 0
    for (since, world), (until, then) in itertools.pairwise(history):
        at = dataclasses.replace(c, rank=0, world_size=world)
        epoch, start, taken = _advance(meta, at, epoch, start, taken, until - since)
        if then != world:  # an elastic resume: what every rank consumed starts the rest
            here = dataclasses.replace(at, epoch=epoch, start=start)
            start, taken = consumed(meta, here, taken), 0
    return epoch, start, taken


def _history(world_sizes: Sequence[tuple[int, int]], step: int) -> list[tuple[int, int]]:
    """`world_sizes` checked (see locate); [] stands for none."""
    history = [(int(f), int(w)) for f, w in world_sizes]
    if history and history[0][0] != 0:
        raise CoordinateError("locate.world_sizes", f"the first must be from step 0, got "
                                                    f"{history[0][0]}")
    for (a, _), (b, _) in itertools.pairwise(history):
        if b <= a:
            raise CoordinateError("locate.world_sizes", f"from_step must ascend, got {b} "
                                                        f"after {a}")
    if history and history[-1][0] > step:
        raise CoordinateError("locate.world_sizes", f"from_step {history[-1][0]} is past the "
                                                    f"step located ({step})")
    bad = [w for _, w in history if w < 1]
    if bad:
        raise CoordinateError("locate.world_sizes", f"world_size must be >= 1, got {bad[0]}")
    return history


def _advance(meta: EpochSource, c: Coordinates, epoch: int, start: int, taken: int,
             steps: int) -> tuple[int, int, int]:
    """(epoch, start, taken) after `steps` more steps under `c` from batch `taken` of
    `epoch`'s positions from `start` (an epoch taken whole is the next one's beginning)."""
    while True:
        at = dataclasses.replace(c, epoch=epoch, start=start)
        if c.batch_tokens and not start and c.order == ORDER_LEGACY:  # each its plan's steps
            assert meta.lengths is not None
            epoch, taken = token_batches.locate_whole(meta.ordering, meta.lengths, at,
                                                      taken + steps)
            return epoch, 0, taken
        batches = epoch_size(meta, at)[0] if not c.batch_tokens or c.order != ORDER_LEGACY \
            else token_batches.batches_per_epoch(meta.ordering, meta.lengths, at)  # type: ignore[arg-type]
        if taken + steps < batches:
            return epoch, start, taken + steps
        if not start and batches <= 0:
            raise CoordinateError("locate.step", "these coordinates give no batch per epoch")
        steps -= batches - taken
        epoch, start, taken = epoch + 1, 0, 0
        if steps and (not c.batch_tokens or c.order != ORDER_LEGACY):  # whole epochs alike
            whole = epoch_size(meta, dataclasses.replace(c, epoch=epoch, start=0))[0]
            if whole > 0:
                skipped, steps = divmod(steps, whole)
                return epoch + skipped, 0, steps


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
        if c.order != ORDER_LEGACY:
            return token_windows.consumed(meta.ordering, meta.lengths, c, steps)
        return int(token_batches.plan(meta.ordering, meta.lengths, c).cuts[steps])
    return min(c.start + steps * c.batch_size * c.world_size, meta.num_samples)
