"""Map-style datasets for the tests, loaded by real servers through `format: python`.

Servers started by the tests have this folder on PYTHONPATH (see conftest.py).
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np


class Toy:
    """Sample i is a deterministic function of i: arrays of several dtypes and plain numbers."""

    def __init__(self, n: int = 100, dim: int = 3, fail_at: list[int] | None = None,
                 die_at: int | None = None, huge_at: int | None = None,
                 opens_log: str | None = None, max_opens: int = 0,
                 delay: float = 0.0) -> None:
        if opens_log:  # crash while opening, once max_opens processes have opened it
            with open(opens_log, "a") as log:
                log.write("open\n")
            with open(opens_log) as log:
                if len(log.readlines()) > max_opens:
                    os._exit(3)
        self.n, self.dim = n, dim
        self.delay = delay  # seconds of simulated work per sample
        self.fail_at = set(fail_at or ())
        self.die_at = die_at
        self.huge_at = huge_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if self.delay:
            time.sleep(self.delay)
        if i in self.fail_at:
            raise ValueError(f"cannot decode record {i}")
        if i == self.die_at:
            os._exit(17)  # a crash in native code, as far as the server can tell
        return {
            "x": np.arange(self.dim, dtype=np.float32) + i,
            "tokens": np.full((2, self.dim), i % 256, dtype=np.uint8),
            "label": 2**70 if i == self.huge_at else i % 7,  # int -> int64
            "weight": float(i) / 2,            # float -> float64
            "flag": bool(i % 2),               # bool -> bool
            "small": np.int16(-i),             # numpy scalar keeps its dtype
        }


def toy(**options) -> Toy:
    return Toy(**options)


class Ragged(Toy):
    def __getitem__(self, i: int) -> dict:
        return {"x": np.zeros(1 + i % 2, dtype=np.float32)}


class Noise:
    """Larger float tensors (random from the index), to exercise framing."""

    def __init__(self, n: int = 6, shape: tuple[int, ...] = (37, 129)) -> None:
        self.n, self.shape = n, tuple(shape)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        rng = np.random.default_rng(i)
        return {"big": rng.standard_normal(self.shape).astype(np.float32),
                "odd": np.arange(3, dtype=np.int8) + i, "half": np.float16(i)}


def jitter(sample: dict, rng) -> dict:
    """A user `transform:`: adds seeded noise to x, and a new field."""
    return {**sample, "x": sample["x"] + rng.normal(size=sample["x"].shape).astype(np.float32),
            "coin": np.int64(rng.integers(2))}


def not_a_dict(sample: dict, rng) -> list:
    return [sample]


class Ramp:
    """Compressible samples: sample i is a smooth uint16 ramp of `size` values, offset by i."""

    def __init__(self, n: int = 24, size: int = 200_000) -> None:
        self.n, self.size = n, size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"ramp": (np.arange(self.size, dtype=np.uint16) // 64 + i).astype(np.uint16)}


class Counting:
    """Sample i is {"i": int64 i}: costs nothing, any size (a billion samples, say)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"i": np.int64(i)}


class Hangs(Toy):
    """Toy, except that reading sample `hang_at` hangs for ever the first time, in whichever
    worker reads it first (the flag file `flag` marks that one did: later attempts read it
    normally). `reopen_delay`: seconds a worker opening the dataset after the hang takes
    (the replacement), so that a test can see it start."""

    def __init__(self, n: int = 40, hang_at: int = 13, flag: str = "",
                 reopen_delay: float = 0.0, **options) -> None:
        if reopen_delay and os.path.exists(flag):
            time.sleep(reopen_delay)
        super().__init__(n=n, **options)
        self.hang_at, self.flag = hang_at, flag

    def __getitem__(self, i: int) -> dict:
        if i == self.hang_at:
            try:
                os.close(os.open(self.flag, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                pass  # hung once already
            else:
                signal.pause()  # a read that never returns (the watchdog's SIGKILL ends it)
        return super().__getitem__(i)


class Blocks:
    """Sample i is `kib` KiB of float32, a function of i: batches of a chosen size in bytes."""

    def __init__(self, n: int = 24, kib: int = 256) -> None:
        self.n, self.size = n, kib * 256

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"block": np.full(self.size, i, dtype=np.float32)}


class Faults(Blocks):
    """Blocks made the way an image pipeline makes a sample: temporaries of the sample's size
    (a decoded image, a resized one) alive together, then freed. `minflt`: the page faults
    making it took in the worker, `pid`: which worker."""

    def __getitem__(self, i: int) -> dict:
        import resource

        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        parts = [np.full(self.size, i, dtype=np.float32) for _ in range(3)]
        block = parts[0] + parts[1] - parts[2]
        made = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        return {"block": block, "minflt": np.int64(made), "pid": np.int64(os.getpid())}
