"""Batches shared across jobs (issue 17): the jobs of a sweep that ask one server for the same
coordinates get the bytes a lone job gets, and the server builds each batch once.

Jobs are RemoteLoaders in threads of this process, started together on a barrier; a lone
job's batches come from a server with the cache off (`cache.shared_batches: 0`) that no
other job reads. The server's builds are counted by stoker_shared_batches_total.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import signal
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stoker.client import RemoteError, RemoteLoader
from stoker.server import ServerProcess, write_config
from stoker.server._config import CacheSettings
from stoker.server.front.shared_batches import LONE_SHARE, Outcome, SharedBatches
from stoker.server.order.sampling import Coordinates
from stoker.server.pool.layout import BuiltBatch
from stoker.server.pool.messages import FailureKind
from stoker.server.pool.workers import BatchFailed

from conftest import TOY_DATASETS, server_env

pytestmark = pytest.mark.timeout(120)

N, BATCH = 64, 4  # 16 batches an epoch
DATASETS = {"toy": {"format": "python", "factory": "toy_datasets:toy",
                    "options": {"n": N, "delay": 0.004}},
            "flaky": TOY_DATASETS["flaky"]}
# One epoch a job: nothing of the next is fetched ahead (and built) while it ends.
KW: dict[str, Any] = dict(batch_size=BATCH, seed=11, shuffle=True, order="legacy",
                          output="numpy", timeout=60,
                          prefetch_next_epoch=False)
Batches = list[dict[str, np.ndarray]]


def start(tmp: Path, name: str, cache: dict[str, Any] | None = None, n: int = N,
          delay: float = 0.004) -> ServerProcess:
    datasets = {**DATASETS, "toy": {**DATASETS["toy"], "options": {"n": n, "delay": delay}}}
    config = write_config(tmp / f"{name}.yaml", {"server": {"grace_seconds": 2},
                                                 "cache": cache or {}, "datasets": datasets})
    return ServerProcess(config, workers=2, env=server_env()).start()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess,
                                                                     ServerProcess]]:
    """(a server that shares, a lone job's server: the cache off and one job at a time)."""
    tmp = tmp_path_factory.mktemp("sweep")
    shared, lone = start(tmp, "shared"), start(tmp, "lone", {"shared_batches": 0})
    yield shared, lone
    for proc in (shared, lone):
        assert proc.stop() == 0, proc.stderr


def read(addresses: str | list[str], epoch: int, stop_after: int | None = None,
         on_batch: Callable[[int], None] | None = None, **kw: Any) -> Batches:
    got = []
    with RemoteLoader(addresses, kw.pop("dataset", "toy"), **{**KW, **kw}) as loader:
        loader.set_epoch(epoch)
        for k, batch in enumerate(loader):
            got.append({name: np.array(v) for name, v in batch.items()})
            if on_batch is not None:
                on_batch(k)
            if k + 1 == stop_after:
                break
    return got


def at_once(jobs: list[Callable[[], Batches]]) -> list[Batches | BaseException]:
    """Run `jobs` in threads released together; each one's batches, or what it raised."""
    out: list[Batches | BaseException] = [RuntimeError("did not run")] * len(jobs)
    gate = threading.Barrier(len(jobs))

    def run(i: int) -> None:
        gate.wait()
        try:
            out[i] = jobs[i]()
        except BaseException as e:  # handed to the test
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def same(a: Batches, b: Batches) -> bool:
    """Byte for byte: every field of every batch, dtypes and shapes included."""
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(x[k].dtype == y[k].dtype and x[k].shape == y[k].shape
                                     and x[k].tobytes() == y[k].tobytes() for k in x)
        for x, y in zip(a, b, strict=True))


def outcomes(server: ServerProcess, dataset: str = "toy") -> dict[str, float]:
    """stoker_shared_batches_total by outcome, from the server's /metrics."""
    with urllib.request.urlopen(server.http_url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    got = dict.fromkeys(("built", "joined", "cached"), 0.0)
    for m in re.finditer(r'^stoker_shared_batches_total\{dataset="([^"]*)",outcome="(\w+)"\} '
                         r"(\S+)$", text, re.M):
        if m.group(1) == dataset:
            got[m.group(2)] = float(m.group(3))
    return got


def gauge(server: ServerProcess, name: str) -> float:
    with urllib.request.urlopen(server.http_url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    assert found, f"no {name} in /metrics"
    return float(found.group(1))


def since(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def test_four_jobs_at_once_get_a_lone_jobs_bytes_from_one_build_each(pair) -> None:
    shared, lone = pair
    before = outcomes(shared)
    # Two by shared memory, two in gRPC frames: one build serves both kinds of stream.
    jobs = at_once([lambda shm=shm: read(shared.address, 0, shared_memory=shm)
                    for shm in (True, False, True, False)])
    reference = read(lone.address, 0)
    assert len(reference) == N // BATCH
    for got in jobs:
        assert not isinstance(got, BaseException), got
        assert same(got, reference)
    counts = since(before, outcomes(shared))
    assert counts["built"] == N // BATCH, counts  # each batch built once
    assert counts["joined"] + counts["cached"] == 3 * N // BATCH, counts


def test_a_job_that_comes_later_is_served_from_the_cache(pair) -> None:
    shared, lone = pair
    first = read(shared.address, 1)
    # Kept within the lone share (16 batches of 64 KiB segments: 1 MiB of 16 MiB).
    alone = gauge(shared, "stoker_shared_kept_lone_bytes")
    assert alone >= N // BATCH * (64 << 10)
    before = outcomes(shared)
    later = read(shared.address, 1)
    assert since(before, outcomes(shared)) == {"built": 0, "joined": 0, "cached": N // BATCH}
    # A second stream asked for them: theirs now, out of the lone share.
    assert gauge(shared, "stoker_shared_kept_lone_bytes") == alone - N // BATCH * (64 << 10)
    assert same(later, first) and same(later, read(lone.address, 1))
    # A lone job's server keeps nothing: each job builds its own.
    before = outcomes(lone)
    read(lone.address, 1)
    assert since(before, outcomes(lone))["built"] == N // BATCH


def test_a_job_that_leaves_does_not_break_the_builds_others_wait_for(pair, ledger) -> None:
    shared, lone = pair
    # The leaver closes its loader after its first batch, with its credits' builds (shared
    # with the stayer's) still in flight.
    leaver, stayer = at_once([lambda: read(shared.address, 2, stop_after=1, prefetch=8),
                              lambda: read(shared.address, 2, prefetch=8)])
    assert not isinstance(leaver, BaseException), leaver
    assert not isinstance(stayer, BaseException), stayer
    reference = read(lone.address, 2)
    flat = [int(i) for b in stayer for i in b["sample_index"]]
    lost, dup = ledger.compare(flat, [int(i) for b in reference for i in b["sample_index"]])
    ledger.record("clients", "one of two jobs sharing builds closes its loader mid-epoch",
                  lost=lost, duplicated=dup, detail="the other job gets the whole epoch")
    assert lost == dup == 0 and same(stayer, reference)
    assert same(read(shared.address, 2), reference)  # what was kept or rebuilt is right


def test_a_failed_build_is_told_to_every_job_waiting_for_it(pair, ledger) -> None:
    shared, _ = pair
    # flaky: sample 13 cannot be decoded; in order, batches of 4, batch 3 holds it.
    jobs = at_once([lambda: read(shared.address, 0, dataset="flaky", shuffle=False)] * 3)
    told = [j for j in jobs if isinstance(j, RemoteError)
            and j.code.name == "DATA_LOSS" and "sample 13" in str(j)]
    ledger.record("corrupt input", "a bad sample in a batch three jobs wait for at once",
                  tried=3, detail=f"{len(told)} of 3 jobs told DATA_LOSS naming the sample")
    assert len(told) == 3, jobs
    # A failure is not kept: the next job's request builds that batch again.
    before = outcomes(shared, "flaky")
    with pytest.raises(RemoteError, match="sample 13"):
        read(shared.address, 0, dataset="flaky", shuffle=False)
    assert since(before, outcomes(shared, "flaky"))["built"] >= 1


def test_sharing_jobs_lose_and_repeat_nothing_when_a_server_is_killed(tmp_path, ledger) -> None:
    # 30 batches of 2 at 10 ms a sample: the kill lands mid-epoch.
    servers = [start(tmp_path, f"s{i}", n=60, delay=0.01) for i in range(2)]
    victim = servers[0]
    try:
        def kill(k: int) -> None:
            if k == 5 and victim.proc.poll() is None:
                victim.proc.send_signal(signal.SIGKILL)

        addresses = [s.address for s in servers]
        jobs = at_once([lambda: read(addresses, 0, on_batch=kill, batch_size=2, prefetch=6)]
                       + [lambda: read(addresses, 0, batch_size=2, prefetch=6)] * 3)
        order = np.random.default_rng([KW["seed"], 0]).permutation(60).tolist()
        lost = dup = 0
        for got in jobs:
            assert not isinstance(got, BaseException), got
            flat = [int(i) for b in got for i in b["sample_index"]]
            job_lost, job_dup = ledger.compare(flat, order)
            lost, dup = lost + job_lost, dup + job_dup
            assert flat == order
        assert victim.proc.poll() is not None  # killed, while the jobs read
        ledger.record("servers", "kill -9 one of 2 mid-epoch while 4 jobs share its builds",
                      tried=4, lost=lost, duplicated=dup, detail="per job: every sample once")
        assert lost == dup == 0
        counts = outcomes(servers[1])
        assert counts["joined"] + counts["cached"] > 0, counts  # the jobs did share
    finally:
        for s in servers:
            s.stop()


# -- the sharing itself, against a pool whose builds the test finishes ---------------------------
class Pool:
    """A WorkerPool stand-in: submit() returns a future the test resolves; release() is
    recorded (the references a real pool would get back)."""

    def __init__(self) -> None:
        self.submitted: list[concurrent.futures.Future] = []
        self.released: list[tuple[str, bool]] = []

    def submit(self, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        self.submitted.append(concurrent.futures.Future())
        return self.submitted[-1]

    def release(self, batch: BuiltBatch, reuse: bool = True) -> None:
        self.released.append((batch.shm_name, reuse))


COORDS = Coordinates("toy", 1, 0, True, 0, 1, 4, True)
NO = np.zeros(0, np.int64)


def sharing(cache_bytes: int = 0, on_built: Any = None) -> tuple[Pool, SharedBatches]:
    pool = Pool()
    return pool, SharedBatches(pool, CacheSettings(shared_batches=cache_bytes,  # type: ignore[arg-type]
                                                   shared_seconds=60), on_built=on_built)


def batch(name: str = "stoker_1_2_1", nbytes: int = 100) -> BuiltBatch:
    return BuiltBatch(name, nbytes, (), 4)


def test_joined_builds_are_released_once_by_their_last_holder() -> None:
    async def go() -> None:
        pool, shared = sharing()
        a = asyncio.ensure_future(shared.get(COORDS, 0, NO, NO))
        b = asyncio.ensure_future(shared.get(COORDS, 0, NO, NO))
        other = asyncio.ensure_future(shared.get(COORDS, 1, NO, NO))  # another batch
        await asyncio.sleep(0)
        assert len(pool.submitted) == 2
        pool.submitted[0].set_result(batch())
        (got_a, how_a), (got_b, how_b) = await a, await b
        assert got_a is got_b and (how_a, how_b) == (Outcome.BUILT, Outcome.JOINED)
        shared.release(got_a)
        assert pool.released == []
        shared.release(got_b, reuse=False)  # a client may still read it: never reused
        assert pool.released == [("stoker_1_2_1", False)]
        other.cancel()  # its only waiter left: the build is dropped, not left to run
        await asyncio.gather(other, return_exceptions=True)
        assert pool.submitted[1].cancelled()

    asyncio.run(go())


def test_a_waiter_leaving_keeps_the_build_and_an_error_reaches_every_waiter() -> None:
    async def go() -> None:
        pool, shared = sharing()
        leaver = asyncio.ensure_future(shared.get(COORDS, 0, NO, NO))
        stayer = asyncio.ensure_future(shared.get(COORDS, 0, NO, NO))
        await asyncio.sleep(0)
        leaver.cancel()
        await asyncio.gather(leaver, return_exceptions=True)
        assert not pool.submitted[0].cancelled()
        pool.submitted[0].set_result(batch())
        got, _ = await stayer
        shared.release(got)
        assert pool.released == [("stoker_1_2_1", True)]
        # Failed: every waiter is told, and the next request builds again.
        waiters = [asyncio.ensure_future(shared.get(COORDS, 1, NO, NO)) for _ in range(3)]
        await asyncio.sleep(0)
        pool.submitted[1].set_exception(BatchFailed(FailureKind.DATA_LOSS, "sample 13: bad"))
        for result in await asyncio.gather(*waiters, return_exceptions=True):
            assert isinstance(result, BatchFailed) and "sample 13" in str(result)
        again = asyncio.ensure_future(shared.get(COORDS, 1, NO, NO))
        await asyncio.sleep(0)
        assert len(pool.submitted) == 3
        again.cancel()
        await asyncio.gather(again, return_exceptions=True)

    asyncio.run(go())


def test_a_build_is_counted_once_even_when_the_stream_that_asked_first_leaves() -> None:
    # The worker's figures (build seconds, a mixture's components) are counted per build,
    # not by the stream whose request started it: that one may be gone when it ends.
    async def go() -> None:
        counted: list[tuple[Coordinates, list[int], str]] = []
        pool, shared = sharing(on_built=lambda c, idx, b: counted.append(
            (c, idx.tolist(), b.shm_name)))
        samples = np.arange(4, dtype=np.int64)
        first = asyncio.ensure_future(shared.get(COORDS, 0, samples, NO))
        joined = asyncio.ensure_future(shared.get(COORDS, 0, samples, NO))
        await asyncio.sleep(0)
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        pool.submitted[0].set_result(batch())
        got, how = await joined
        assert how is Outcome.JOINED
        assert counted == [(COORDS, [0, 1, 2, 3], "stoker_1_2_1")]
        shared.release(got)
        # A build that fails is not counted as built.
        failing = asyncio.ensure_future(shared.get(COORDS, 1, samples, NO))
        await asyncio.sleep(0)
        pool.submitted[1].set_exception(BatchFailed(FailureKind.DATA_LOSS, "bad"))
        await asyncio.gather(failing, return_exceptions=True)
        assert len(counted) == 1

    asyncio.run(go())


def test_the_cache_keeps_within_its_bytes_oldest_out_first() -> None:
    async def go() -> None:
        seg = 64 << 10  # a segment's smallest size: what each kept batch counts as
        # One stream asks: its batches are kept within the cache's lone share.
        pool, shared = sharing(cache_bytes=2 * seg * LONE_SHARE)
        for i in range(3):
            job = asyncio.ensure_future(shared.get(COORDS, i, NO, NO))
            await asyncio.sleep(0)
            pool.submitted[i].set_result(batch(f"stoker_1_2_{i}"))
            got, how = await job
            assert how is Outcome.BUILT
            shared.release(got)  # sent: only the cache holds it now
        assert shared.kept_bytes == 2 * seg
        assert pool.released == [("stoker_1_2_0", True)]  # the oldest made room
        got, how = await shared.get(COORDS, 2, NO, NO)
        assert how is Outcome.CACHED and got.shm_name == "stoker_1_2_2"
        shared.release(got)
        too_big = asyncio.ensure_future(shared.get(COORDS, 3, NO, NO))
        await asyncio.sleep(0)
        pool.submitted[3].set_result(batch("stoker_1_2_3", 3 * seg))
        shared.release((await too_big)[0])
        assert pool.released[-1] == ("stoker_1_2_3", True)  # larger than the cache: not kept
        # Lent to a client that never gave it back (its stream ended): still served, then
        # unlinked (not reused) once the cache lets go of it.
        got, how = await shared.get(COORDS, 1, NO, NO)
        assert how is Outcome.CACHED
        shared.release(got, reuse=False)
        assert pool.released[-1] == ("stoker_1_2_3", True)
        got, how = await shared.get(COORDS, 1, NO, NO)
        assert how is Outcome.CACHED
        shared.release(got)
        shared.clear()
        assert shared.kept_bytes == 0 and pool.released == [
            ("stoker_1_2_0", True), ("stoker_1_2_3", True), ("stoker_1_2_1", False),
            ("stoker_1_2_2", True)]  # each segment back once

    asyncio.run(go())


def test_a_full_cache_gives_the_building_worker_one_of_its_own_segments_back() -> None:
    # Workers 2 and 3 (the pids in the names) take turns; with the cache full, each new
    # batch drops the oldest kept batch of the worker that built it, which then reuses that
    # segment instead of making a new one.
    async def go() -> None:
        seg = 64 << 10
        pool, shared = sharing(cache_bytes=3 * seg * LONE_SHARE)  # the lone share: 3 batches
        names = ["stoker_1_2_0", "stoker_1_3_0", "stoker_1_2_1", "stoker_1_3_1",
                 "stoker_1_3_2", "stoker_1_4_0"]
        for i, name in enumerate(names):
            job = asyncio.ensure_future(shared.get(COORDS, i, NO, NO))
            await asyncio.sleep(0)
            pool.submitted[i].set_result(batch(name))
            shared.release((await job)[0])
        assert pool.released == [
            ("stoker_1_3_0", True),  # worker 3's oldest, though worker 2's is older
            ("stoker_1_3_1", True),  # worker 3's again
            ("stoker_1_2_0", True),  # worker 4 has none kept: the oldest
        ]
        for i, name in ((2, "stoker_1_2_1"), (4, "stoker_1_3_2"), (5, "stoker_1_4_0")):
            got, how = await shared.get(COORDS, i, NO, NO)
            assert how is Outcome.CACHED and got.shm_name == name

    asyncio.run(go())


def test_coordinates_a_second_stream_asks_for_get_the_whole_budget() -> None:
    # A lone job's batches are kept within 1/LONE_SHARE of the budget (new segments for
    # nobody, otherwise); once another stream asks for the same coordinates, theirs are kept
    # within all of it, those already kept included.
    async def go() -> None:
        seg = 64 << 10
        pool, shared = sharing(cache_bytes=seg * LONE_SHARE)  # the lone share: one batch
        other = Coordinates("toy", 1, 0, True, 1, 2, 4, True)  # another rank's

        async def build(coords: Coordinates, i: int, name: str, stream: str) -> None:
            job = asyncio.ensure_future(shared.get(coords, i, NO, NO, stream=stream))
            await asyncio.sleep(0)
            pool.submitted[-1].set_result(batch(name))
            got, how = await job
            assert how is Outcome.BUILT
            shared.release(got)

        await build(COORDS, 0, "stoker_1_2_0", "a")
        await build(COORDS, 1, "stoker_1_2_1", "a")
        assert pool.released == [("stoker_1_2_0", True)]  # one batch kept: the newest
        assert (shared.kept_bytes, shared.lone_bytes) == (seg, seg)
        got, how = await shared.get(COORDS, 1, NO, NO, stream="b")  # a sweep's second job
        assert how is Outcome.CACHED and got.shm_name == "stoker_1_2_1"
        shared.release(got)
        assert (shared.kept_bytes, shared.lone_bytes) == (seg, 0)
        await build(COORDS, 2, "stoker_1_2_2", "a")
        await build(COORDS, 3, "stoker_1_2_3", "a")
        assert shared.kept_bytes == 3 * seg and len(pool.released) == 1  # all kept
        await build(other, 0, "stoker_1_3_0", "c")  # another rank, alone: the lone share
        await build(other, 1, "stoker_1_3_1", "c")
        assert pool.released[1:] == [("stoker_1_3_0", True)]
        assert (shared.kept_bytes, shared.lone_bytes) == (4 * seg, seg)
        for i in (2, 3):
            got, how = await shared.get(COORDS, i, NO, NO, stream="b")
            assert how is Outcome.CACHED
            shared.release(got)
        # The same stream asking again is still one stream.
        got, how = await shared.get(other, 1, NO, NO, stream="c")
        assert how is Outcome.CACHED
        shared.release(got)
        await build(other, 2, "stoker_1_3_2", "c")
        assert pool.released[-1] == ("stoker_1_3_1", True) and shared.lone_bytes == seg

    asyncio.run(go())
