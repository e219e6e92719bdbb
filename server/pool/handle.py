"""One worker process as the pool sees it: the process, its pipe, and the pool's bookkeeping of
it (the `Job`s it holds); and the one way to write to its pipe.

Threading: `process`, `conn` and `progress` are set at spawn and never change. `ready`, `freed`,
`dropped`, `jobs` and `head_since` are guarded by the pool's lock (see workers.py). `on_loop`
and `poller` belong to the pipe's handover (see loop_side.py): set by the thread that hands the
pipe to the loop before the loop's first read, cleared on the loop after its last.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing.connection as mpc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .messages import Part, Task, ToWorker

if TYPE_CHECKING:
    from .layout import BuiltBatch
    from .parts import Assembly


@dataclass(frozen=True)
class Job:
    """A task (or a part of a batch) handed to a worker, and who waits for its batch."""

    task: Task | Part  # what the worker is sent
    future: concurrent.futures.Future[BuiltBatch]  # who waits for the batch
    batch: Assembly | None = None  # a Part's batch, and which part it is
    part: int = 0


@dataclass(eq=False)  # a worker is itself: compared (`in`, `index`) by identity
class WorkerHandle:
    """One worker process and the pool's bookkeeping of it (the module doc says who owns
    which field)."""

    process: Any
    conn: mpc.Connection
    ready: bool = False
    # Segments the front end has finished with, to send back with the next task.
    freed: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # unlinked: the worker forgets them
    # Tasks sent to this worker by id, oldest first: the first is the one it is building.
    jobs: dict[int, Job] = field(default_factory=dict)
    head_since: float = 0.0  # monotonic time the first of `jobs` started
    # Shared int64 [task id, sample] the worker writes as it goes (read without the lock).
    progress: Any = None
    # Its pipe is read by the event loop (see loop_side.py); `poller` polls the pipe without
    # a new selector.
    on_loop: bool = False
    poller: Any = None


def send(w: WorkerHandle, message: ToWorker | tuple[ToWorker, ...]) -> bool:
    """Send to a worker (a tuple: several messages in one pipe write, taken in order);
    False if its pipe is broken: it died, and its sentinel will say so on the dispatcher's
    next wait (where the pool replaces it and deals with its tasks)."""
    try:
        w.conn.send(message)
    except OSError:
        return False
    return True
