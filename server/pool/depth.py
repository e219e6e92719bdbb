"""How much a worker holds: tasks queued, free segments kept, and what that asks of /dev/shm.

The rules the pool (tasks per worker), a worker's SegmentPool (segments kept), the front end's
open-file budget and the start-up /dev/shm estimate all read; kept here, in one leaf, so that
none of them copies another's.
"""

from __future__ import annotations

from typing import Any

from .shm import capacity, mib, more_shm

# Tasks a worker holds at once (the pool sends no more): DEPTH while batches are small
# (DEEP_BYTES at most: 1 MiB batches and their sample indices), SHALLOW_DEPTH otherwise.
# Small batches cost mostly their messages and wake-ups: with several queued, a worker takes
# them in one pipe read and sends their results in one write (measured at 64 KiB batches,
# 2 workers: 8 against 2 took the front end's and workers' CPU per batch down by a third).
# Large ones cost their bytes: two queued let a worker start the next without a round trip,
# and more only added fresh segments in flight (the image pipeline's batches: 4% more CPU
# per batch at 8). The pool spreads tasks over the least busy workers, so a slow batch
# holds up few others.
DEPTH = 8
SHALLOW_DEPTH = 2
DEEP_BYTES = 2 << 20
# Free segments a worker keeps for reuse (see _shm.SegmentPool): enough for the batches it
# has queued plus those on their way out, which come back in bursts; past KEEP_MIN, only
# while they hold at most KEEP_BYTES between them (64 MiB batches keep 4, 1 MiB ones 32).
# A segment dropped is made again for a later batch, its pages faulted in and zeroed: with
# 10 kept, 1 MiB batches without the shared-batch cache went into a new segment about one
# time in three (workers 0.39 CPU s/GB against 0.13 reused; 1.8-2.0 GB/s against 2.8-3.2).
KEEP_SEGMENTS = 4 * DEPTH
KEEP_MIN = 4
KEEP_BYTES = 64 << 20


# Batches that take a worker longer than this to build keep SHALLOW_DEPTH whatever their size:
# the round trip that depth hides is a fraction of a millisecond, and a worker's queued tasks
# are out of the pool's hands. 8 ranks in lockstep credited 22 batches each at start; with 8
# queued per worker (64 ms a batch), a rank's next batch waited behind half a second of others'.
QUICK_SECONDS = 0.01


def depth_for(payload_bytes: int, build_seconds: float = 0.0) -> int:
    """Tasks a worker holds at once while batches are of this size and take this long."""
    if payload_bytes <= DEEP_BYTES and build_seconds < QUICK_SECONDS:
        return DEPTH
    return SHALLOW_DEPTH


def idle_bytes(payload_bytes: int) -> int:
    """The most a worker's free segments for batches of this size hold (_shm.SegmentPool
    with KEEP_SEGMENTS, KEEP_MIN and KEEP_BYTES)."""
    return max(KEEP_MIN * payload_bytes, min(KEEP_SEGMENTS * payload_bytes, KEEP_BYTES))


# Samples per batch the start check assumes (it cannot know the batch sizes clients will ask).
NOMINAL_BATCH = 256


def capacity_warning(meta: dict[str, Any], settings: Any, size: int | None = None) -> str | None:
    """A warning when /dev/shm (`size` bytes; default: its real size) looks too small for this
    server, else None. `meta`: each dataset's DatasetMeta; `settings`: the ServerSettings.

    A batch B is the largest dataset's NOMINAL_BATCH samples (at most max_batch_bytes). Each
    worker holds depth_for(B) batches building and idle_bytes(B) of idle segments
    (above), and one stream up to max_credits batches built and not yet
    sent: for large batches about (workers * 6 + max_credits) * B. An estimate, and said as
    one: below it a server serves until /dev/shm fills, then answers the batches that find
    no room UNAVAILABLE."""
    import numpy as np  # the worker-side messages need none: imported on use

    total = capacity()[0] if size is None else size
    if not total or not meta:
        return None
    per_sample = {name: sum(np.dtype(d).itemsize * int(np.prod(s, dtype=np.int64))
                            for _, d, s in m.fields) for name, m in meta.items()}
    dataset = max(per_sample, key=lambda k: per_sample[k])
    batch = min(per_sample[dataset] * NOMINAL_BATCH, int(settings.max_batch_bytes))
    workers, credits = settings.worker_count, settings.max_credits
    need = workers * (depth_for(batch) * batch + idle_bytes(batch)) + credits * batch
    if need <= total:
        return None
    return (f"/dev/shm is {mib(total)}, and this server may need about {mib(need)} of it: "
            f"server.workers={workers} and server.max_credits={credits} with batches of "
            f"{NOMINAL_BATCH} samples of dataset {dataset!r} ({mib(batch)} each). Batches "
            f"that find it full fail with UNAVAILABLE: {more_shm(need)}, or lower "
            "server.workers or server.max_credits")
