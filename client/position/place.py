"""Where a loader is: `Place`, its coordinates and its position in them, written only here.

Threading: the loop's thread (the loader's); plain values, no lock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from .exclusions import Excluded
from .resume import Coordinates, Position, Saved


class Place:
    """A loader's coordinates but the epoch (`coords`: dataset, seed, shuffle, order version,
    rank, world_size, batch size, exclusions) and its position in them (`at`: the epoch, the
    positions consumed before these coordinates took over, the batch next). It alone writes
    them, through the named moves below; everything else reads them.

    Args:
        coords: the loader's coordinates; the position starts at epoch 0, batch 0.
    """

    def __init__(self, coords: Coordinates) -> None:
        self._coords = coords
        self._at = Position(0)

    @property
    def coords(self) -> Coordinates:
        """The coordinates but the epoch."""
        return self._coords

    @property
    def at(self) -> Position:
        """The position: epoch, start, next batch."""
        return self._at

    def next_batch(self) -> None:
        """The batch at the position was handed out: the next one is next."""
        self._at = self._at.advanced()

    def new_epoch(self) -> None:
        """The epoch is over: the next one's beginning."""
        self._at = self._at.following()

    def set_epoch(self, epoch: int) -> None:
        """Select `epoch`: its beginning if it is another epoch, else the same place.

        Args:
            epoch: the epoch (RemoteLoader.set_epoch checks its range).
        """
        if epoch != self._at.epoch:
            self._at = Position(epoch)

    def seek(self, epoch: int, start: int, batch_index: int) -> None:
        """Go where a server located a global step.

        Args:
            epoch: the step's epoch.
            start: the positions of that epoch consumed before (an elastic resume's).
            batch_index: the step's batch in the epoch's rest.
        """
        self._at = Position(epoch, start, batch_index)

    def exclude(self, excluded: Excluded | None) -> None:
        """Leave `excluded`'s samples out from here on.

        Args:
            excluded: the whole set the run leaves out (it only grows).
        """
        self._coords = dataclasses.replace(self._coords, excluded=excluded)

    def reorder(self, order: int) -> None:
        """Go on in order version `order` (that of a state being loaded: the run goes on in
        the order it began in).

        Args:
            order: the order version (ORDER_VERSIONS' values).
        """
        self._coords = dataclasses.replace(self._coords, order=order)

    def pin_snapshot(self, snapshot: str) -> None:
        """Read a lake table's `snapshot` from here on: the one first contact resolved, or
        the one a state being loaded read.

        Args:
            snapshot: the table's snapshot id, as the servers name it.
        """
        self._coords = dataclasses.replace(self._coords, snapshot=snapshot)

    def load_state_dict(self, saved: Saved, planned: Callable[[Saved], int] | None) -> None:
        """Resume where `saved` was (after `reorder` and `exclude` to its order and
        exclusions): its position, or under another world_size or batch_size an elastic
        resume (the positions every rank had consumed start the rest of the epoch).

        Args:
            saved: the state_dict read back.
            planned: where a token budget's plan ended a saved step (a server's answer).
        """
        self._at = saved.position_for(self._coords, planned)
