"""torch.distributed.checkpoint: a RemoteLoader's position as one entry of a DCP checkpoint.

    from stoker.integrations.dcp import LoaderState

    state = {"model": model.state_dict(), "loader": LoaderState(loader)}
    dcp.save(state, checkpoint_id=path)       # every rank, at the same step
    ...
    dcp.load(state, checkpoint_id=path)       # every rank of the new job, any world size

A RemoteLoader is already a `torch.distributed.checkpoint.stateful.Stateful` (it has
state_dict and load_state_dict), and `dcp.save({"loader": loader})` works; loading it back is
where it goes wrong. DCP flattens a Stateful's nested dict into one entry per leaf and, on
load, fills only the leaves the destination's own state_dict() has: a fresh loader's state has
no `fingerprint` (it has not asked a server yet) and no `coordinates.start` (only an epoch
resumed at another size has one), so those are silently dropped, and a job resumed twice at
other sizes (N -> M -> K) would go on from the wrong place. LoaderState keeps the whole
position as one opaque value (JSON text), which DCP saves and loads whole.

Keying: one key for the whole job, the same on every rank. Any rank's state is the job's
position (the ranks step together; docs/client.md#resuming), DCP keeps one copy of an entry
that every rank saves under one key, and at load every rank of a job of any size reads that
copy: at a new world size there is no per-rank state to find (torchtitan keys its loaders per
data-parallel rank because their state is per rank; stoker's is not). docs/integrations.md.
"""

from __future__ import annotations

import json
from typing import Any

from torch.distributed.checkpoint.stateful import Stateful

from stoker.client import RemoteLoader

__all__ = ["LoaderState"]

KEY = "position"  # LoaderState's one entry: the loader's state_dict() as JSON text


class LoaderState(Stateful):
    """`loader`'s position for a DCP state dict: `{"position": "<its state_dict(), JSON>"}`.

    Save it on every rank at the same step, under the same key; load it on every rank of the
    new job, at this world_size and batch_size or others (RemoteLoader.load_state_dict, whose
    `allow_changed_data` this passes on)."""

    def __init__(self, loader: RemoteLoader, *, allow_changed_data: bool = False) -> None:
        if not isinstance(loader, RemoteLoader):
            raise TypeError(f"LoaderState keeps a RemoteLoader's position, got "
                            f"{type(loader).__name__}")
        self.loader = loader
        self.allow_changed_data = allow_changed_data

    def state_dict(self) -> dict[str, Any]:
        return {KEY: json.dumps(self.loader.state_dict(), sort_keys=True, default=int)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        text = state_dict.get(KEY) if isinstance(state_dict, dict) else None
        if not isinstance(text, str):
            raise ValueError(f"not a LoaderState: expected {{{KEY!r}: <JSON text>}}, got "
                             f"{state_dict!r:.200}")
        self.loader.load_state_dict(json.loads(text),
                                    allow_changed_data=self.allow_changed_data)
