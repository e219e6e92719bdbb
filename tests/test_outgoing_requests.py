"""What a stream sends (client/transport/stream.py _outgoing): credits and releases queued one
behind another go as one StreamRequest, in order; anything else goes as it is, in its place."""

from __future__ import annotations

import queue
from types import SimpleNamespace

import pytest

from stoker.client.transport.stream import BatchStream
from stoker.v1 import stoker_pb2 as pb

pytestmark = pytest.mark.timeout(30)


def sent(*requests: pb.StreamRequest | None) -> list[pb.StreamRequest]:
    q: queue.SimpleQueue = queue.SimpleQueue()
    for r in requests:
        q.put(r)
    return list(BatchStream._outgoing(SimpleNamespace(_requests=q)))  # type: ignore[arg-type]


def test_credits_and_releases_queued_together_go_as_one_message_in_order() -> None:
    out = sent(pb.StreamRequest(batch_indices=[3]), pb.StreamRequest(released=["a"]),
               pb.StreamRequest(batch_indices=[4, 5]), pb.StreamRequest(released=["b"]), None)
    assert out == [pb.StreamRequest(batch_indices=[3, 4, 5], released=["a", "b"])]


def test_a_message_with_anything_else_is_sent_alone_in_its_place() -> None:
    coords = pb.StreamRequest(coordinates=pb.Coordinates(dataset="d", epoch=1),
                              batch_indices=[0])
    report = pb.StreamRequest(report=pb.ClientReport(wait_seconds=1.0))
    out = sent(pb.StreamRequest(batch_indices=[7]), coords, pb.StreamRequest(released=["x"]),
               report, pb.StreamRequest(batch_indices=[1]), pb.StreamRequest(batch_indices=[2]),
               None)
    assert out == [pb.StreamRequest(batch_indices=[7]), coords,
                   pb.StreamRequest(released=["x"]), report,
                   pb.StreamRequest(batch_indices=[1, 2])]


def test_close_sends_what_was_queued_before_it_then_ends() -> None:
    assert sent(pb.StreamRequest(released=["a"]), None, pb.StreamRequest(released=["b"])) == [
        pb.StreamRequest(released=["a"])]
