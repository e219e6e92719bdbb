"""PyTorch Lightning: a LightningDataModule whose train loader is a RemoteLoader.

    from stoker.integrations.lightning import StokerDataModule

    data = StokerDataModule("dataserver:50051", "faces", batch_size=64)
    trainer = L.Trainer(strategy="ddp", devices=2, max_epochs=3)
    trainer.fit(model, datamodule=data, ckpt_path="last")

What it relies on in Lightning (2.x), and why resuming is exact: the fit loop saves the
`state_dict()` of every train loader that has state_dict/load_state_dict (Lightning's
`_Stateful`) into the checkpoint (`loops.fit_loop.state_dict.combined_loader`) and loads it
back before it iterates again, so `trainer.fit(ckpt_path=...)` goes on at the loader's next
batch. A loader with a length is not read ahead by Lightning's fetcher, so the saved position
is the step's. Lightning leaves anything that is not a torch DataLoader as it is (no
DistributedSampler, no re-sharding). This module adds what Lightning cannot know: the rank and
world size (the trainer's, given to the loader), and one loader for the whole run
(`train_dataloader()` returns the same one each time Lightning asks, so a reload does not
restart the epoch). docs/integrations.md#pytorch-lightning.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning as L

from stoker.client import RemoteLoader

__all__ = ["StokerDataModule"]


class StokerDataModule(L.LightningDataModule):
    """Train batches from stoker data servers.

    `address`, `dataset`, `batch_size` and `**options` are RemoteLoader's (docs/client.md),
    but for `rank` and `world_size`, which are the trainer's global rank and world size. The
    loader is made once, when Lightning first asks for it, and kept: `loader` is it (None
    before). Validation data is the LightningModule's, or a subclass's `val_dataloader`.
    """

    def __init__(self, address: str | Sequence[str], dataset: str, batch_size: int | None = None,
                 **options: Any) -> None:
        super().__init__()
        for name in ("rank", "world_size"):
            if name in options:
                raise TypeError(f"StokerDataModule takes no {name!r}: the trainer's global "
                                "rank and world size are the loader's")
        self.address, self.dataset, self.batch_size = address, dataset, batch_size
        self.options = options
        self.loader: RemoteLoader | None = None

    def _placement(self) -> dict[str, int]:
        trainer = self.trainer
        if trainer is None:
            raise RuntimeError("StokerDataModule's loaders are made for a Trainer: pass it to "
                               "trainer.fit(model, datamodule=...)")
        return {"rank": trainer.global_rank, "world_size": trainer.world_size}

    def train_dataloader(self) -> RemoteLoader:
        if self.loader is None:
            self.loader = RemoteLoader(self.address, self.dataset, self.batch_size,
                                       **self._placement(), **self.options)
        return self.loader

    def teardown(self, stage: str) -> None:
        """Close the loader once Lightning is done with it."""
        if self.loader is not None:
            self.loader.close()
        self.loader = None
