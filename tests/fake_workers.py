"""A fake worker process for the pool's unit tests (tests/test_pool.py): a real spawned child
that speaks the pool's messages (stoker.server.pool.messages) over its pipe, opens no dataset
and builds nothing. Its batches name no real segment: `stoker_<server>_<worker>_t<task>x<first
index>`, so a test reads from a result which worker built which task.

What it does is set by a Script, which the pool's `main` carries (functools.partial):
- `events`: a pipe end all the workers write to (no lock: a small message is one atomic
  write, and a worker killed mid-test holds nothing another needs); it says ("opened", pid,
  probe) once open, and ("task", pid, task id, first index) for each task as it receives it
  (before building any);
- `gate`: a pipe end nobody reads; the worker holds every task it receives until something was
  written to it (then builds what it holds, and everything after, at once);
- `drift`: a path; once it exists, a worker that does not probe (every replacement, and every
  worker but worker 0 at start) sees other data: DRIFTED, not SEEN.
"""

from __future__ import annotations

import multiprocessing.connection as mpc
import os
from dataclasses import dataclass
from typing import Any

from stoker.server.order.fingerprint import Fingerprint
from stoker.server.order.sampling import Ordering
from stoker.server.pool import shm
from stoker.server.pool.layout import BuiltBatch
from stoker.server.pool.messages import Built, DatasetMeta, GiveBack, Opened, Stop, Task

DATASET = "d"
SAMPLES = 40
SEEN = Fingerprint("sha256:" + "a" * 64, SAMPLES, 4000)
DRIFTED = Fingerprint("sha256:" + "b" * 64, SAMPLES + 8, 4800)


@dataclass(frozen=True)
class Script:
    events: mpc.Connection
    gate: mpc.Connection
    drift: str


def main(script: Script, config: Any, conn: mpc.Connection, probe: bool, log_level: int,
         progress: Any = None, slot: int = 0, cache_counts: Any = None) -> None:
    """The worker's body (pool/lifecycle.WorkerMain, with the Script first)."""
    seen = DRIFTED if not probe and os.path.exists(script.drift) else SEEN
    meta = {DATASET: DatasetMeta(SAMPLES, [], Ordering(SAMPLES), fingerprint=seen)}
    conn.send(Opened(meta if probe else None, {DATASET: seen}))
    script.events.send(("opened", os.getpid(), probe))
    held: list[Task] = []
    while True:
        waits = [conn, script.gate] if held else [conn]
        if conn in mpc.wait(waits):
            try:
                received = conn.recv()
            except (EOFError, OSError):
                return
            for message in received if isinstance(received, tuple) else (received,):
                match message:
                    case Task():
                        held.append(message)
                        if len(held) == 1 and progress is not None:  # building it, before
                            progress[0], progress[1] = message.task_id, -1  # it says so
                        script.events.send(("task", os.getpid(), message.task_id,
                                            int(message.indices[0])))
                    case Stop():
                        return
                    case GiveBack():
                        pass  # nothing to reuse: no segment was made
        if held and script.gate.poll():
            # Newest first: the pool must resolve each result by its task id, not its place.
            conn.send(tuple(Built(t.task_id, _batch(t)) for t in reversed(held)))
            held = []


def _batch(task: Task) -> BuiltBatch:
    name = f"{shm.worker_prefix(os.getppid(), os.getpid())}t{task.task_id}x{task.indices[0]}"
    return BuiltBatch(name, payload_bytes=64, tensors=(), num_samples=len(task.indices))
