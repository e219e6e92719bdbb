"""The Hugging Face Trainer (on accelerate): StokerTrainer, whose train loader is a RemoteLoader.

    from stoker.integrations.hf import StokerTrainer

    args = TrainingArguments("out", max_steps=1000, save_steps=100)
    loader = RemoteLoader("dataserver:50051", "faces", batch_size=64,
                          rank=args.process_index, world_size=args.world_size)
    trainer = StokerTrainer(model=model, args=args, train_loader=loader)
    trainer.train(resume_from_checkpoint=True)

What it changes in the Trainer, and why:
- `get_train_dataloader` gives the loader to `accelerator.prepare`, which passes anything that
  is not a torch DataLoader through as it is (no re-sharding: the loader already reads this
  rank's share); StokerTrainer checks it came back unchanged.
- Each checkpoint folder gets the loader's `state_dict()` (`stoker_loader.json`, written by
  the main process before the Trainer's own files; any rank's state is the job's position).
- `train(resume_from_checkpoint=...)` loads that state into the loader before training, so
  the loader is at the checkpoint's next batch. The Trainer would still skip the epoch's
  consumed batches by reading and discarding them (accelerate's `skip_first_batches`);
  during `train` that skip is, for this loader only, a check that the loader is where the
  Trainer expects, and nothing is read: resuming at step 10,000 costs what resuming at step
  10 does. (The Trainer has no hook for a loader that resumes itself: transformers #31441.)
The loader's epochs follow the Trainer's (`set_epoch` at each epoch). Resume at the world size
and batch size the checkpoint was saved at: the Trainer's own step arithmetic assumes it.
docs/integrations.md#hugging-face-trainer.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import transformers.trainer as hf_trainer
from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from stoker.client import RemoteLoader

__all__ = ["STATE_FILE", "StokerTrainer"]

STATE_FILE = "stoker_loader.json"  # the loader's state_dict(), in each checkpoint folder


class StokerTrainer(Trainer):
    """A `transformers.Trainer` that trains on `train_loader`, a RemoteLoader made for this
    process (`rank=args.process_index, world_size=args.world_size`), and resumes it at a
    checkpoint's position (see the module's docstring). Every other argument is Trainer's;
    `train_dataset` is not used for training."""

    def __init__(self, *args: Any, train_loader: RemoteLoader, **kwargs: Any) -> None:
        if not isinstance(train_loader, RemoteLoader):
            raise TypeError(f"train_loader must be a RemoteLoader, got "
                            f"{type(train_loader).__name__}")
        super().__init__(*args, **kwargs)
        placed = train_loader.state_dict()["coordinates"]
        ours = {"rank": self.args.process_index, "world_size": self.args.world_size}
        if {k: placed[k] for k in ours} != ours:
            raise ValueError(f"train_loader reads rank {placed['rank']} of world_size "
                             f"{placed['world_size']}, but this process is rank "
                             f"{ours['rank']} of {ours['world_size']}: make it with "
                             "rank=args.process_index, world_size=args.world_size")
        self.train_loader = train_loader

    def get_train_dataloader(self) -> RemoteLoader:  # type: ignore[override]
        prepared = self.accelerator.prepare(self.train_loader)
        if prepared is not self.train_loader:  # accelerate would have wrapped or re-sharded it
            raise RuntimeError(f"accelerator.prepare replaced the RemoteLoader with "
                               f"{type(prepared).__name__}")
        return prepared

    def _save_checkpoint(self, model: Any, trial: Any, *args: Any, **kwargs: Any) -> None:
        """The loader's position first (the main process), then the Trainer's checkpoint, whose
        trainer_state.json, written last, is what a resume reads: a checkpoint folder that has
        one has the loader's state too."""
        if self.args.should_save:
            folder = os.path.join(self._get_output_dir(trial=trial),
                                  f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, STATE_FILE), "w") as out:
                json.dump(self.train_loader.state_dict(), out, default=int)
        super()._save_checkpoint(model, trial, *args, **kwargs)  # 4.x also passes metrics

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any,
              **kwargs: Any) -> Any:
        """Trainer.train, the loader first resumed at the checkpoint's position."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No valid checkpoint found in output directory "
                                 f"({self.args.output_dir})")
        if resume_from_checkpoint:
            self._resume_loader(str(resume_from_checkpoint))
        with self._skipping_by_position():
            return super().train(resume_from_checkpoint or None, *args, **kwargs)

    def _resume_loader(self, checkpoint: str) -> None:
        path = os.path.join(checkpoint, STATE_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{checkpoint} has no {STATE_FILE}: not saved by StokerTrainer, so it does not "
                "say where the loader was (after loading it with a plain Trainer, "
                "loader.seek(global_step * gradient_accumulation_steps) goes there in one "
                "request, as long as world size and batch size are the same)")
        with open(path) as f:
            state = json.load(f)
        trainer_state = os.path.join(checkpoint, hf_trainer.TRAINER_STATE_NAME)
        if os.path.isfile(trainer_state):
            with open(trainer_state) as f:
                epoch = int(json.load(f).get("epoch") or 0)
            if epoch != state.get("epoch"):
                raise ValueError(f"{path} is at epoch {state.get('epoch')!r}, the Trainer's "
                                 f"state in {checkpoint} at epoch {epoch}: not one checkpoint")
        self.train_loader.load_state_dict(state)

    @contextmanager
    def _skipping_by_position(self) -> Iterator[None]:
        """For this loader, the Trainer's skip of a resumed epoch's first batches checks the
        loader's position instead of reading them; any other loader is skipped as usual."""
        original: Callable[..., Any] = hf_trainer.skip_first_batches
        loader = self.train_loader

        def skip(dataloader: Any, num_batches: int = 0) -> Any:
            if dataloader is not loader:
                return original(dataloader, num_batches)
            at = loader.stats()
            if at["next_batch"] != num_batches:
                raise RuntimeError(
                    f"the Trainer resumes after batch {num_batches} of its epoch, but the "
                    f"loader is at batch {at['next_batch']} of epoch {at['epoch']}: the "
                    f"checkpoint's {STATE_FILE} is not from this run's step, or the world "
                    "size, batch size or gradient accumulation changed")
            return loader

        hf_trainer.skip_first_batches = skip
        try:
            yield
        finally:
            hf_trainer.skip_first_batches = original
