"""The worker pipe's messages survive the pipe as they are, and stay small: batch payloads
travel in shared memory, so a message is its indices or a segment's layout plus a few bytes."""

from __future__ import annotations

import multiprocessing as mp
import pickle

import grpc
import numpy as np
import pytest

from stoker.server.order.sampling import EpochKey, Ordering
from stoker.server.pool import messages as msg
from stoker.server.pool.layout import BuiltBatch, TensorLayout

INDICES = np.arange(1024, dtype=np.int64)
BATCH = BuiltBatch(shm_name="stoker_1_2_3", payload_bytes=16384, num_samples=1024,
                   tensors=(TensorLayout("x", "float32", (1024, 2), 0, 8192),
                            TensorLayout("sample_index", "int64", (1024,), 8192, 8192)))
MESSAGES = [
    msg.Task(7, "train", INDICES, INDICES[:8], EpochKey(3, 2, True)),
    msg.GiveBack(["stoker_1_2_3"]), msg.Discard(["stoker_1_2_4"]), msg.Stop(),
    msg.Opened({"train": msg.DatasetMeta(10, [("x", "float32", (2,))], Ordering(10))}),
    msg.Opened(None),
    msg.OpenFailed("dataset 'train': ValueError: no files"),
    msg.Built(7, BATCH), msg.BuildFailed(7, msg.FailureKind.DATA_LOSS, "sample 3: bad"),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_a_message_crosses_a_real_pipe_unchanged(message) -> None:
    a, b = mp.Pipe()
    with a, b:
        a.send(message)
        got = b.recv()
    assert type(got) is type(message)
    if isinstance(message, msg.Task):
        assert np.array_equal(got.indices, message.indices) and got.key == message.key
    elif isinstance(message, msg.Opened) and message.meta:
        assert got.meta["train"].fields == message.meta["train"].fields
    else:
        assert got == message


def test_messages_are_small_beside_what_they_carry() -> None:
    task = MESSAGES[0]
    assert len(pickle.dumps(task, -1)) < task.indices.nbytes + task.ahead.nbytes + 512
    assert len(pickle.dumps(msg.Built(7, BATCH), -1)) < 512
    assert len(pickle.dumps(msg.BuildFailed(7, msg.FailureKind.INTERNAL, "x"), -1)) < 256


def test_every_failure_kind_has_the_status_its_batch_is_answered_with() -> None:
    from stoker.server.front.credits import FAILURE_CODE

    assert set(FAILURE_CODE) == set(msg.FailureKind)
    assert FAILURE_CODE[msg.FailureKind.UNAVAILABLE] == grpc.StatusCode.UNAVAILABLE
    kind = pickle.loads(pickle.dumps(msg.FailureKind.RESOURCE_EXHAUSTED))
    assert kind == "resource_exhausted" and kind is msg.FailureKind.RESOURCE_EXHAUSTED
