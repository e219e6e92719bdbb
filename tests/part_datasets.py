"""Datasets and a transform for tests/test_parts.py (batches built in parts by several workers),
loaded by real servers through `format: python` and `transform:`.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np

from toy_datasets import Toy

# Seconds `slow` spends per sample, without CPU: every batch of 16 samples or more is then
# worth cutting into parts (see server/pool/parts.py).
SLOW = 0.001


def slow(sample: dict, rng) -> dict:
    """A user `transform:` that leaves the sample as it is, and takes SLOW seconds."""
    time.sleep(SLOW)
    return sample


class Shifty(Toy):
    """Toy, except the samples in `wide_at`, whose `x` has one more element (a batch holding
    one cannot be laid out as the probe said)."""

    def __init__(self, wide_at: list[int] | None = None, **options) -> None:
        super().__init__(**options)
        self.wide_at = set(wide_at or ())

    def __getitem__(self, i: int) -> dict:
        sample = super().__getitem__(i)
        if i in self.wide_at:
            sample["x"] = np.arange(self.dim + 1, dtype=np.float32)
        return sample


def shifty(**options) -> Shifty:
    return Shifty(**options)


class Gated(Toy):
    """Toy, except sample `gate_at`: until the file `gate` exists, the first worker reading it
    writes its pid into the FIFO `fifo` (the test reads it there: it is mid-part now) and then
    waits to be killed (any other waits for `gate`); once `gate` exists, the sample is read
    as any other."""

    def __init__(self, gate_at: int, gate: str, fifo: str, **options) -> None:
        super().__init__(**options)
        self.gate_at, self.gate, self.fifo = gate_at, gate, fifo

    def __getitem__(self, i: int) -> dict:
        if i == self.gate_at and not os.path.exists(self.gate):
            try:  # one worker is the test's to kill; another one there (the next epoch's
                # batch, asked ahead) waits for the gate instead of blocking on the FIFO
                os.close(os.open(self.gate + ".claimed", os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                # A poll: the gate is a file the test makes in another process, which no
                # event of ours reports; bounded (the test's own wait is 90 s).
                deadline = time.monotonic() + 90
                while not os.path.exists(self.gate) and time.monotonic() < deadline:
                    time.sleep(0.01)
                return super().__getitem__(i)
            with open(self.fifo, "w") as f:  # blocks until the test reads
                f.write(f"{os.getpid()}\n")
            while True:  # until the test kills this worker
                signal.pause()
        return super().__getitem__(i)


def gated(**options) -> Gated:
    return Gated(**options)
