"""Batches built in parts by several workers at once (server/pool/parts.py), through real
servers: the bytes of every batch are those a one-worker server builds, for every format, and
so are the errors; a batch takes a part's time, not a whole batch's on one worker; a worker
killed mid-part costs that part only. And the pool's bookkeeping of parts on its own.

The datasets take 1 ms a sample (part_datasets.slow, a `transform:`), so that every batch of
16 samples or more is cut into parts on a server of several workers.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import select
import signal
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from epochs import epoch
from PIL import Image

from stoker.client import RemoteError, RemoteLoader
from stoker.server import ServerProcess, write_config
from stoker.server.order.sampling import FIRST_EPOCH
from stoker.server.pool.assign import Assignment
from stoker.server.pool.batch import planned_layout
from stoker.server.pool.handle import WorkerHandle
from stoker.server.pool.messages import BatchFailed, FailureKind, Part, PartBuilt, Task
from stoker.server.pool.parts import MISFIT, RESENDS, Plan, parts_for, workers_for

from conftest import StartServer, server_env

pytestmark = pytest.mark.timeout(120)

SLOW = "part_datasets:slow"
BATCH = 32  # on 4 workers, 4 parts of 8 samples


def toy(**options: Any) -> dict[str, Any]:
    return {"format": "python", "factory": "toy_datasets:toy", "transform": SLOW,
            "options": options}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every format the parts must build byte for byte: their datasets' config."""
    root = tmp_path_factory.mktemp("parts")
    rng = np.random.default_rng(5)
    for i in range(48):  # PNGs of several sizes, in two classes
        (root / "pics" / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        h, w = 5 + i % 7, 4 + i % 5
        Image.fromarray(rng.integers(1, 256, (h, w, 3), np.uint8)).save(
            root / "pics" / f"c{i % 2}" / f"{i}.png")
    (root / "text").mkdir()
    with open(root / "text" / "a.jsonl", "w") as f:
        for k in range(300):
            words = ["tokens", "rows", "héllo", "of", "text"] * int(rng.integers(0, 12))
            f.write(json.dumps({"id": k, "text": " ".join(words)}) + "\n")
    (root / "docs").mkdir()
    lengths = rng.integers(8, 120, 200)
    with open(root / "docs" / "a.jsonl", "w") as f:
        for i in range(200):
            f.write(json.dumps({"ids": [i] * int(lengths[i]), "label": i}) + "\n")
    pq.write_table(pa.table({"label": np.arange(200), "length": lengths}),
                   root / "rows.parquet", row_group_size=50)
    component = {"format": "python", "factory": "mixture_datasets:named", "transform": SLOW}
    return {
        "numbers": toy(n=103),
        "skippy": {**toy(n=64, fail_at=[13, 30, 41]), "on_error": "skip"},
        "flaky": toy(n=64, fail_at=[13, 30]),
        "shifty": {**toy(n=64, wide_at=[20], fail_at=[28]), "factory": "part_datasets:shifty"},
        "pics": {"format": "image-folder", "source": str(root / "pics"), "size": 8,
                 "transform": SLOW},
        "native": {"format": "image-folder", "source": str(root / "pics"), "transform": SLOW},
        "text": {"format": "text", "source": str(root / "text"), "seq_len": 32,
                 "transform": SLOW},
        "docs": {"format": "jsonl", "source": str(root / "docs"), "length_column": "ids",
                 "fields": {"ids": {"dtype": "int64", "shape": [-1]},
                            "label": {"dtype": "int64"}}, "transform": SLOW},
        "rows": {"format": "parquet", "source": str(root / "rows.parquet"),
                 "fields": {"label": {}}, "length_column": "length", "transform": SLOW},
        "a": {**component, "options": {"n": 50, "name": "x"}},
        "b": {**component, "options": {"n": 37, "name": "x"}},
        "mix": {"format": "mixture", "components": {"a": 0.6, "b": 0.4},
                "samples_per_epoch": 160},
    }


@pytest.fixture(scope="module")
def servers(data: dict[str, Any], start_server_module: StartServer
            ) -> dict[int, ServerProcess]:
    """One server of 1 worker (the reference: every batch built whole) and one of 4."""
    return {n: start_server_module(data, workers=n) for n in (1, 4)}


def read(server: ServerProcess, dataset: str, **kw: Any) -> list[dict[str, np.ndarray]]:
    """An epoch at this file's coordinates (BATCH rows a batch unless batch_tokens)."""
    return epoch(server, dataset, **{"seed": 7, "shuffle": True, "drop_last": False, **(
        {} if "batch_tokens" in kw else {"batch_size": BATCH}), **kw})


def same_bytes(one: list[dict[str, np.ndarray]], many: list[dict[str, np.ndarray]]) -> None:
    assert len(one) == len(many)
    for k, (a, b) in enumerate(zip(one, many, strict=True)):
        assert a.keys() == b.keys(), k
        for name in a:
            assert (a[name].dtype, a[name].shape) == (b[name].dtype, b[name].shape), (k, name)
            assert a[name].tobytes() == b[name].tobytes(), (k, name)


@pytest.mark.parametrize(("dataset", "kw"), [
    ("numbers", {}), ("skippy", {}), ("pics", {}), ("native", {}), ("text", {}),
    ("docs", {"batch_tokens": 1024}), ("rows", {"batch_tokens": 2048}), ("mix", {})])
def test_bytes_of_every_batch_are_those_one_worker_builds(
        servers: dict[int, ServerProcess], dataset: str, kw: dict[str, Any]) -> None:
    one, many = read(servers[1], dataset, **kw), read(servers[4], dataset, **kw)
    same_bytes(one, many)
    if dataset == "skippy":  # replacements stood in, and sample_index says which
        delivered = np.concatenate([b["sample_index"] for b in many])
        assert not {13, 30, 41} & set(delivered.tolist()) and len(delivered) == 64


@pytest.mark.parametrize(("dataset", "said"), [
    ("flaky", "sample 13"),  # parts 1 and 3 fail: the lowest part's error
    ("shifty", "sample 20"),  # part 2 cannot be laid out as planned, part 3 fails
])
def test_a_bad_sample_fails_the_batch_as_one_worker_says(
        servers: dict[int, ServerProcess], dataset: str, said: str) -> None:
    errors = []
    for n in (1, 4):
        with pytest.raises(RemoteError) as info:
            read(servers[n], dataset, shuffle=False)
        errors.append((info.value.code, info.value.details))
    assert errors[0] == errors[1], errors
    assert errors[0][0] == grpc.StatusCode.DATA_LOSS and said in errors[0][1], errors


def test_the_first_batch_takes_a_part_not_a_whole_batch(start_server: StartServer) -> None:
    delay, n = 0.02, 64  # one worker: 1.28 s for the batch
    server = start_server({"slow": {"format": "python", "factory": "toy_datasets:toy",
                                    "options": {"n": n, "delay": delay}}}, workers=8)
    with RemoteLoader(server.address, "slow", batch_size=n, shuffle=False, output="numpy",
                      timeout=60) as loader:
        loader.describe()  # connected: what follows is the batch's time
        started = time.perf_counter()
        first = next(iter(loader))
        took = time.perf_counter() - started
    assert first["sample_index"].tolist() == list(range(n))
    assert took < 0.5 * n * delay, took


def test_a_worker_killed_mid_part_costs_that_part_only(
        start_server: StartServer, tmp_path: Path, ledger: Any) -> None:
    fifo, gate = tmp_path / "fifo", tmp_path / "gate"
    os.mkfifo(fifo)
    dataset = {"format": "python", "factory": "part_datasets:gated",
               "options": {"n": 96, "gate_at": 45, "gate": str(gate), "fifo": str(fifo),
                           "delay": 0.001}}
    reference = start_server({"d": dataset}, workers=1)
    server = start_server({"d": dataset}, workers=4)
    # Opened before any worker writes: the worker's open() waits for it, not the other way.
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    got: concurrent.futures.Future[list[dict[str, np.ndarray]]] = concurrent.futures.Future()

    def read_epoch() -> None:
        try:  # one batch credited at a time: each is cut over the 4 idle workers
            got.set_result(read(server, "d", shuffle=False, prefetch=1))
        except BaseException as e:
            got.set_exception(e)

    threading.Thread(target=read_epoch, daemon=True).start()
    assert select.select([reader], [], [], 60)[0], "no worker reached sample 45"
    pid = int(os.read(reader, 64).decode().split()[0])
    os.close(reader)
    gate.touch()  # the part's second build reads sample 45 as any other
    os.kill(pid, signal.SIGKILL)
    batches = got.result(90)
    want = read(reference, "d", shuffle=False)  # the gate is open: built whole, at once
    same_bytes(want, batches)
    delivered = np.concatenate([b["sample_index"] for b in batches]).tolist()
    lost, duplicated = ledger.compare(delivered, list(range(96)))
    ledger.record("servers", "kill -9 of a worker mid-part (a batch built by 4 workers)",
                  lost=lost, duplicated=duplicated)
    assert (lost, duplicated) == (0, 0)


def test_a_server_killed_mid_batch_loses_and_repeats_nothing(tmp_path: Path,
                                                             ledger: Any) -> None:
    """Two servers of 4 workers, every batch built in parts: one is killed (kill -9) while its
    workers are on a batch's parts; its batches come from the other, once each. 20 batches:
    the loop goes on long enough after the kill to credit the victim again (with 5, the
    victim could have sent all it was credited before the kill, and nobody noticed it)."""
    n = 640
    config = write_config(tmp_path / "c.yaml", {"datasets": {"d": toy(n=n, delay=0.002)}})
    victim, other = (ServerProcess(config, workers=4, env=server_env()) for _ in range(2))
    delivered: list[int] = []
    with victim, other, RemoteLoader([victim.address, other.address], "d", batch_size=BATCH,
                                     seed=3, order="legacy", output="numpy", timeout=60,
                                     shared_memory=False) as loader:
        for k, batch in enumerate(loader):
            delivered += batch["sample_index"].tolist()
            if k == 1:  # both servers hold credits now, and build them in parts
                victim.proc.kill()
        servers = loader.stats()["servers"]
    assert servers[victim.address]["state"] != "up", servers  # the client noticed the kill
    order = np.random.default_rng([3, 0]).permutation(n).tolist()
    lost, duplicated = ledger.compare(delivered, order)
    ledger.record("servers", "kill -9 one of 2 servers mid-batch (batches built by 4 workers "
                  "each, in parts)", lost=lost, duplicated=duplicated)
    assert delivered == order


# -- the pool's bookkeeping of parts, on its own -------------------------------------------------
FIELDS = [("x", "float32", (3,)), ("sample_index", "int64", ())]


class Segments:
    """The pool's own segments, as the bookkeeping sees them: names given back, counted."""

    def __init__(self) -> None:
        self.back: list[str] = []

    def give_back(self, name: str) -> None:
        self.back.append(name)


def handles(n: int) -> list[WorkerHandle]:
    nothing: Any = None
    return [WorkerHandle(process=nothing, conn=nothing, ready=True) for _ in range(n)]


def parted(jobs: Assignment, n: int, parts: int) -> concurrent.futures.Future:
    layout = planned_layout(FIELDS, n)
    assert layout is not None
    size = layout[-1].offset + layout[-1].nbytes
    with jobs.lock:
        return jobs.add_parts_locked("d", np.arange(100, 100 + n), np.arange(n), FIRST_EPOCH,
                                     Plan(layout, size, parts), "seg")


def dealt(jobs: Assignment, workers: list[WorkerHandle]) -> dict[int, list[Any]]:
    with jobs.lock:
        return {i: m for i, (w, m) in enumerate(jobs.deal_locked(workers, flush=False))}


def built(part: Part) -> PartBuilt:
    return PartBuilt(part.task_id, skipped=1, seconds=0.01)


def test_parts_go_one_to_each_worker_in_row_order_and_the_last_in_resolves_the_batch() -> None:
    jobs, back = Assignment(threading.Lock(), 60.0), Segments()
    jobs.segments = back  # type: ignore[assignment]
    workers = handles(4)
    future = parted(jobs, 32, 4)
    out = dealt(jobs, workers)
    parts = [out[i][0] for i in range(4)]
    assert [len(out[i]) for i in range(4)] == [1, 1, 1, 1]  # the least busy takes the next
    assert [(p.first, p.indices.tolist()) for p in parts] == [
        (8 * k, list(range(100 + 8 * k, 108 + 8 * k))) for k in range(4)]
    assert [p.ahead.tolist() for p in parts] == [list(range(8 * k, 8 * k + 8)) for k in range(4)]
    assert {p.segment for p in parts} == {"seg"}
    for w, p in reversed(list(zip(workers, parts, strict=True))):
        assert not future.done()
        jobs.part_built(w, built(p))
    batch = future.result(0)
    assert (batch.shm_name, batch.num_samples, batch.skipped) == ("seg", 32, 4)
    assert batch.build_seconds == pytest.approx(0.04)
    assert back.back == [] and "seg" in jobs.lent  # the front end holds it now


def test_the_lowest_failed_part_decides_and_a_misfit_sends_the_batch_whole() -> None:
    jobs, back = Assignment(threading.Lock(), 60.0), Segments()
    jobs.segments = back  # type: ignore[assignment]
    workers = handles(4)
    failing, misfitting = parted(jobs, 32, 4), parted(jobs, 32, 4)
    out = dealt(jobs, workers)
    first, second = [out[i][0] for i in range(4)], [out[i][1] for i in range(4)]
    for k, (w, p) in enumerate(zip(workers, first, strict=True)):
        if k in (1, 3):
            jobs.failed(w, p.task_id, BatchFailed(FailureKind.DATA_LOSS, f"part {k}"))
        else:
            jobs.part_built(w, built(p))
    assert str(failing.exception(0)) == "part 1" and back.back == ["seg"]
    for k, (w, p) in enumerate(zip(workers, second, strict=True)):
        if k == 3:  # a later part fails, but an earlier one misfits: the batch goes whole
            jobs.failed(w, p.task_id, BatchFailed(FailureKind.DATA_LOSS, "part 3"))
        elif k == 2:
            jobs.failed(w, p.task_id, MISFIT)
        else:
            jobs.part_built(w, built(p))
    assert not misfitting.done() and back.back == ["seg", "seg"]
    [whole] = dealt(jobs, workers)[0]
    assert isinstance(whole, Task) and whole.indices.tolist() == list(range(100, 132))


def test_a_part_whose_worker_died_is_sent_again_then_its_batch_fails() -> None:
    jobs, back = Assignment(threading.Lock(), 60.0), Segments()
    jobs.segments = back  # type: ignore[assignment]
    a, b = handles(2)
    future = parted(jobs, 16, 2)
    out = dealt(jobs, [a, b])
    first, second = out[0][0], out[1][0]
    jobs.part_built(b, built(second))
    for death in range(RESENDS + 1):
        with jobs.lock:
            building = jobs.take_back_locked(a, first.task_id)
        if death < RESENDS:  # back in the queue, for whichever worker is free
            assert building is None and not future.done()
            [again] = dealt(jobs, [a])[0]
            assert again is first
        else:
            assert building is not None
            jobs.fail_jobs([building], BatchFailed(FailureKind.INTERNAL, "worker died"))
    assert str(future.exception(0)) == "worker died" and back.back == ["seg"]


def test_a_part_whose_worker_hung_is_not_sent_again() -> None:
    jobs, back = Assignment(threading.Lock(), 60.0), Segments()
    jobs.segments = back  # type: ignore[assignment]
    [a] = handles(1)
    future = parted(jobs, 16, 2)
    first, second = dealt(jobs, [a])[0]
    with jobs.lock:  # killed by the watchdog on its first part: that part fails
        building = jobs.take_back_locked(a, first.task_id, resend=False)
    assert building is not None and [j.task for j in jobs.queue] == [second]
    jobs.fail_jobs([building], BatchFailed(FailureKind.INTERNAL, "not built within"))
    assert not future.done()  # its other part is still to come: the segment is in use
    [again] = dealt(jobs, [a])[0]
    jobs.part_built(a, built(again))
    assert str(future.exception(0)) == "not built within" and back.back == ["seg"]


@pytest.mark.parametrize(("n", "per_sample", "workers", "parts"), [
    (16, 1e-5, 8, 1),  # 64 KiB batches of 16 cheap samples: one part, as before
    (16, None, 8, 2),  # not measured yet: as many as may be
    (256, 0.002, 16, 16),  # 0.5 s of work: one part per worker
    (256, 0.0001, 16, 5),  # 26 ms of work: parts of about 5 ms
    (64, 0.02, 8, 8),
    (12, 1.0, 8, 1),  # fewer than 2 x MIN_ROWS samples
])
def test_parts_are_a_few_ms_of_work_each(n: int, per_sample: float | None, workers: int,
                                         parts: int) -> None:
    assert parts_for(n, per_sample, workers) == parts


@pytest.mark.parametrize(("n", "per_sample", "idle", "parts"), [
    (256, 0.002, 0, 5),  # 0.5 s of work on a busy pool: parts of 0.1 s (issue 49)
    (256, 0.002, 16, 16),  # ... and over every idle worker
    (32, 0.002, 0, 1),  # 64 ms (lockstep's batches): whole while no worker idles
    (32, 0.002, 3, 3),  # ... and over the idle ones
    (256, 0.002, -4, 5),  # more jobs queued than workers idle
    (256, None, 0, 1),  # not measured yet: over the idle workers only
    (1024, 0.002, 0, 16),  # 2 s of work: at most one part a ready worker
])
def test_a_busy_pool_cuts_only_batches_long_enough_for_parts_of_a_tenth_of_a_second(
        n: int, per_sample: float | None, idle: int, parts: int) -> None:
    assert parts_for(n, per_sample, workers_for(n, per_sample, idle, 16)) == parts
