"""Datasets the simulated-training benchmark serves (importable by a server: no torch)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np


def spin(seconds: float) -> None:
    """Busy for `seconds` of this thread's CPU time (a stand-in for decoding)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class Costly:
    """Sample i: a small array, after `sample_ms` of CPU work (or, busy=False, of waiting:
    a server that stands for a CPU node of its own, whose work shares no core with others
    on this machine). Map-style: DataLoader and a stoker server (`format: python`, factory
    `_sim:Costly`) both take it."""

    def __init__(self, n: int, sample_ms: float, busy: bool = True) -> None:
        self.n, self.seconds, self.busy = n, sample_ms / 1000, busy

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        if self.busy:
            spin(self.seconds)
        else:
            time.sleep(self.seconds)
        return {"x": np.full(256, i, np.float32)}


class Waiting:
    """Sample i: {"x": uint8[sample_bytes]} after `sample_ms` of wall time spent asleep: the
    decode time of a sample on a CPU node of its own, which costs this machine no core (the
    fleet scenario: server workers that stand for cores this machine lacks). The bytes are one
    preallocated array, so building a batch costs only its collation. Map-style, for
    `format: python` (factory `_sim:Waiting`).

    `quantum_ms`: the time owed is slept once it reaches this much (the rest is carried to
    the next sample), so a process waits `sample_ms` a sample on average in fewer, longer
    sleeps. A sleep is not free where the stand-in runs: on this project's VMs one costs
    about 40-65 us of CPU (a timer syscall), 2 ms of CPU a batch of 32 samples, which the
    decode it stands for would not take from the training node's cores. 0: one sleep a
    sample (of `sample_ms`; an oversleep is not paid back)."""

    def __init__(self, n: int, sample_ms: float, sample_bytes: int = 32 << 10,
                 quantum_ms: float = 0.0) -> None:
        self.n, self.seconds = n, sample_ms / 1000
        self.quantum = quantum_ms / 1000
        self.owed = 0.0
        self.x = (np.arange(sample_bytes) % 251).astype(np.uint8)  # not the zero page

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not self.quantum:
            time.sleep(self.seconds)
            return {"x": self.x}
        self.owed += self.seconds
        if self.owed >= self.quantum:
            start = time.perf_counter()
            time.sleep(self.owed)
            self.owed -= time.perf_counter() - start  # an oversleep is paid back
        return {"x": self.x}


class Free:
    """Sample i: {"i": int64 i}, at no cost: what a batch's order and collation cost alone
    (the orders scenario: 1e5 to 1e9 samples, nothing held per sample)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"i": np.int64(i)}
