"""Where a loader is, and how a saved position resumes: `Coordinates`, `Position`, `Saved`.

A checkpoint stores the coordinates and the next batch, nothing else (docs/client.md#resuming):
`state_of` writes that dict, `Saved.read` checks one read back, and `Saved.position_for` maps
its position onto this loader's coordinates, at the same world_size and batch_size or others
(an elastic resume: the rest of the epoch's one global order, re-partitioned).

The dict's format is users' checkpoints: keys are only ever added, and only where a value is
not the one an older stoker implied (`start` 0; no `batch_tokens` without a token budget), so
that older states still load and states older stokers would misread are refused by them.

Threading: plain values, used from the loop's thread (the loader's).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from stoker.v1 import stoker_pb2 as pb

from .exclusions import Excluded
from .fingerprint import Fingerprint, data_digest, short

_MISSING = object()

# state_dict()["coordinates"] keys that may differ between the loader that saved a state and
# the one that loads it (an elastic resume): the rest of the epoch's order is re-partitioned.
# Every other key (dataset, seed, shuffle, drop_last) fixes the order or its tail: equal.
ELASTIC = ("rank", "world_size", "batch_size", "start")
# The last epoch a request can name (Coordinates.epoch is an int64): it iterates, and no
# request is made for the epoch after it.
LAST_EPOCH = 2**63 - 1
# Keys a state carries into the loader that loads it: the samples the run left out (added to
# the loader's own), and the order version (a run goes on in the order it began in). An older
# stoker refuses such a state (its coordinates differ).
CARRIED = ("excluded", "order", "snapshot")
# A shuffled epoch's order versions by name (Coordinates.order, as on the wire): "index" is a
# keyed bijection evaluated per position, what new loaders use; "legacy" the whole epoch's
# numpy permutation of stoker before it, which states saved then (no "order" key) resume.
ORDER_VERSIONS = {"legacy": 1, "index": 2}
LEGACY = ORDER_VERSIONS["legacy"]


@dataclass(frozen=True)
class Coordinates:
    """A loader's coordinates but the epoch (and the start of a resumed one): with the epoch,
    they fix the sequence of batches. `batch_size` is 0 under a token budget
    (`batch_tokens`, balanced across ranks by `token_cost`)."""

    dataset: str
    seed: int
    shuffle: bool
    rank: int
    world_size: int
    batch_size: int
    drop_last: bool
    batch_tokens: int | None = None
    token_cost: str = "tokens"
    excluded: Excluded | None = None  # samples the run leaves out (RemoteLoader.exclude)
    order: int = ORDER_VERSIONS["index"]  # the order version (ORDER_VERSIONS)
    # A lake table's snapshot the job reads ("": not a lake table, or not known yet: the
    # server's config pin or the table's current snapshot, which first contact then sets).
    snapshot: str = ""

    def fields(self) -> dict[str, Any]:
        """pb.Coordinates' fields, and state_dict()'s "coordinates", in that order;
        batch_tokens and token_cost only under a token budget, `order` only where it is not
        the legacy one (older state_dicts match); never `excluded` (state_of and message add
        it where there is one)."""
        found = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        del found["excluded"]
        if self.batch_tokens is None:
            del found["batch_tokens"], found["token_cost"]
        if self.order == LEGACY:
            del found["order"]
        if not self.snapshot:
            del found["snapshot"]
        return found

    def message(self, epoch: int, start: int = 0, fingerprint: str = "") -> pb.Coordinates:
        """What a request carries: these coordinates at `epoch` (its positions from `start`
        on), expecting the data whose digest is `fingerprint` ("": any)."""
        ex = self.excluded
        return pb.Coordinates(epoch=epoch, start=start, **self.fields(),
                              fingerprint=fingerprint, excluded=ex.indices if ex else (),
                              excluded_digest=ex.digest if ex else "")


@dataclass(frozen=True)
class Position:
    """An epoch, the positions of its order consumed before these coordinates took over
    (`start`: an elastic resume; 0 for every epoch that starts here), and the batch next."""

    epoch: int
    start: int = 0
    next_batch: int = 0

    def following(self) -> Position:
        """The next epoch's beginning."""
        return Position(self.epoch + 1)

    def advanced(self) -> Position:
        """The batch after the next one."""
        return Position(self.epoch, self.start, self.next_batch + 1)


def state_of(coords: Coordinates, at: Position, agreed: Fingerprint | None) -> dict[str, Any]:
    """state_dict(): `at` (a finished epoch already given as the next one's start) under
    `coords`, with the fingerprint of the data it is a position in."""
    # `start` only where it is not 0: such a state stays what stoker saved before it had
    # elastic resume, and an older stoker refuses (coordinates differ) the states it
    # would resume at the wrong place.
    saved = {**coords.fields(), "start": at.start} if at.start else coords.fields()
    if coords.excluded is not None:
        saved["excluded"] = list(coords.excluded.indices)
    state = {"coordinates": saved, "epoch": at.epoch, "next_batch": at.next_batch}
    if agreed is not None and agreed.digest:
        state["fingerprint"] = agreed.state()
    return state


@dataclass(frozen=True)
class Saved:
    """A state_dict() read back: its position, the world_size and batch_size it was saved at,
    its fingerprint's record (None if it has none), and the samples it left out."""

    at: Position
    world_size: int
    batch_size: int
    fingerprint: Mapping[str, Any] | None
    excluded: Excluded | None = None
    order: int = LEGACY  # the order version it was saved in (none recorded: legacy)
    snapshot: str = ""  # the lake table's snapshot it read ("": none)

    @classmethod
    def read(cls, state: Any, coords: Coordinates) -> Saved:
        """`state`, to resume under `coords`: ValueError when it is no state_dict, when a key
        other than ELASTIC differs from `coords` (naming it), or when a position's key holds
        no such value."""
        saved = state.get("coordinates") if isinstance(state, Mapping) else None
        if not isinstance(saved, Mapping):
            raise ValueError("state_dict has no 'coordinates': not a RemoteLoader.state_dict() "
                             f"(keys: {sorted(state) if isinstance(state, Mapping) else state!r})")
        ours = coords.fields()
        differ = [f"{k}: saved {saved.get(k, '(missing)')!r}, this loader "
                  f"{ours.get(k, '(missing)')!r}"
                  for k in sorted(set(saved) | set(ours))
                  if k not in ELASTIC + CARRIED
                  and saved.get(k, _MISSING) != ours.get(k, _MISSING)]
        if differ:
            raise ValueError("state_dict is for other coordinates (" + "; ".join(differ)
                             + "): a position is only valid in the epoch order it was saved "
                             "in (rank, world_size and batch_size may differ)")
        found = _numbers(state, saved)
        excluded = saved.get("excluded", [])
        if not isinstance(excluded, list | tuple):
            raise ValueError(f"state_dict's 'excluded' must be a list of sample indices, got "
                             f"{excluded!r}")
        order = saved.get("order", LEGACY)
        if isinstance(order, bool) or order not in ORDER_VERSIONS.values():
            raise ValueError(f"state_dict's 'order' must be one of "
                             f"{sorted(ORDER_VERSIONS.values())} ({', '.join(ORDER_VERSIONS)}), "
                             f"got {order!r}: saved by a newer stoker?")
        snapshot = saved.get("snapshot", "")
        if not isinstance(snapshot, str):
            raise ValueError(f"state_dict's 'snapshot' must be a string (a table's snapshot "
                             f"id), got {snapshot!r}")
        return cls(Position(found["epoch"], found["start"], found["next_batch"]),
                   found["world_size"], found["batch_size"], state.get("fingerprint") or None,
                   Excluded.union(None, excluded), order, snapshot)

    @property
    def digest(self) -> str:
        """The digest of the data it was saved against ("": none recorded)."""
        return (self.fingerprint or {}).get("digest") or ""

    def check_data(self, dataset: str, agreed: Fingerprint | None) -> None:
        """ValueError when the servers' data (`agreed`) is not the data it was saved against:
        the rest of the epoch would not be the rest of that order. Only the data's part of
        the digests counts: a state saved before the servers changed their image decode
        resumes at the same samples (with the same crop boxes)."""
        if (agreed is None or not agreed.digest or not self.digest
                or data_digest(agreed.digest) == data_digest(self.digest)):
            return
        saved = self.fingerprint or {}
        raise ValueError(
            f"state_dict was saved against dataset {dataset!r} "
            f"{short(self.digest, saved.get('objects'), saved.get('bytes'))}; "
            f"the servers now have {short(agreed.digest, agreed.objects, agreed.bytes)} (from "
            f"{agreed.address}): the rest of the epoch would not be the rest of that "
            "order; pass load_state_dict(state, allow_changed_data=True) to go on "
            "anyway")

    def position_for(self, coords: Coordinates,
                     planned: Callable[[Saved], int] | None = None) -> Position:
        """Its position under `coords`: itself at the same world_size and batch_size; else
        the positions every rank had consumed, as `start` of the epoch's rest. Under a token
        budget the steps were cut by a plan the client does not see: `planned(self)` asks a
        server where the plan ended step `next_batch` (ValueError without it)."""
        at = self.at
        if (self.world_size, self.batch_size) == (coords.world_size, coords.batch_size):
            return at
        if coords.batch_tokens:
            if planned is None:
                raise ValueError("under batch_tokens an elastic resume needs a server: "
                                 "RemoteLoader.load_state_dict asks one")
            return Position(at.epoch, planned(self))
        # Every rank of the saving job had consumed its first next_batch batches, all
        # full (only an epoch's last batch can be short, and a finished epoch is saved as
        # the next one's start): the epoch's positions [0, consumed), a prefix.
        consumed = at.start + at.next_batch * self.batch_size * self.world_size
        return Position(at.epoch, consumed)


def _numbers(state: Mapping[str, Any], coords: Mapping[str, Any]) -> dict[str, int]:
    """A state's epoch, start and next_batch, and the world_size and batch_size it was saved
    at (`start` 0 where absent: saved before elastic resume, or at an epoch's beginning);
    ValueError naming the key that holds no such value."""
    found = {}
    for key, where, least in (("epoch", state, 0), ("next_batch", state, 0),
                              ("start", coords, 0), ("world_size", coords, 1),
                              ("batch_size", coords, 0 if coords.get("batch_tokens") else 1)):
        value = where.get(key, 0 if key == "start" else _MISSING)
        try:  # ints, numpy's included; not bools, floats or strings
            number = -1 if isinstance(value, bool) else operator.index(value)
        except TypeError:
            number = -1
        if number < least:
            raise ValueError(f"state_dict's {key!r} must be an int >= {least}, got "
                             f"{'(missing)' if value is _MISSING else repr(value)}")
        found[key] = number
    return found
