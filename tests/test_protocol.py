"""The wire: generated code is fresh; batches travel as ordinary protobuf frames of at most
frame_bytes and reassemble byte-exactly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from stoker.client import RemoteLoader
from stoker.server.pool.depth import KEEP_SEGMENTS
from stoker.v1 import stoker_pb2 as pb

from toy_datasets import Noise

ROOT = Path(__file__).resolve().parents[1]
FRAME = 4096
NOISE = {"noise": {"format": "python", "factory": "toy_datasets:Noise", "options": {"n": 6}}}


def test_generated_code_is_fresh() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "protos" / "generate.py"), "--check"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


@pytest.fixture(scope="module")
def framed(start_server_module):
    # No batches kept for later jobs: the segment counts below are the workers' pools alone.
    return start_server_module(NOISE, server={"frame_bytes": FRAME},
                               cache={"shared_batches": 0})


def noise_stream(channel: grpc.Channel, batch_indices: list[int]) -> Any:
    """A raw StreamBatches call for batches of 3 noise samples, in dataset order."""
    coords = pb.Coordinates(dataset="noise", seed=0, epoch=0, shuffle=False, rank=0,
                            world_size=1, batch_size=3, drop_last=True)
    method = channel.stream_stream("/stoker.v1.DataService/StreamBatches",
                                   request_serializer=pb.StreamRequest.SerializeToString)
    return method(iter([pb.StreamRequest(coordinates=coords, batch_indices=batch_indices)]),
                  timeout=60)


def test_a_batch_travels_as_ordered_frames_of_ordinary_protobuf(framed) -> None:
    with grpc.insecure_channel(framed.address) as channel:
        raw = list(noise_stream(channel, [1]))
    frames = [pb.BatchFrame.FromString(r) for r in raw]
    total = frames[0].payload_bytes
    assert len(frames) == -(-total // FRAME) > 1
    assert [f.offset for f in frames] == list(range(0, total, FRAME))
    assert all(len(f.data) <= FRAME and f.batch_index == 1 for f in frames)
    assert [t.name for t in frames[0].tensors] == ["big", "odd", "half", "sample_index"]
    assert all(not f.tensors for f in frames[1:])
    assert all(t.offset % 64 == 0 for t in frames[0].tensors)
    payload = b"".join(f.data for f in frames)
    big = frames[0].tensors[0]
    got = np.frombuffer(payload[big.offset : big.offset + big.nbytes], "<f4").reshape(big.shape)
    assert np.array_equal(got[0], Noise()[3]["big"])


@pytest.mark.parametrize("output", ["numpy", "torch"])
def test_reassembled_batches_equal_the_samples(framed, output: str) -> None:
    ds = Noise()
    # shared_memory=False: the frames over the socket are what is tested here (a client on
    # the server's host otherwise reads payloads from shared memory; test_samehost.py).
    with RemoteLoader(framed.address, "noise", batch_size=4, drop_last=False, output=output,
                      timeout=60, shared_memory=False) as loader:
        for batch in loader:
            for row, i in enumerate(batch["sample_index"].tolist()):
                for key, value in ds[i].items():
                    have = np.asarray(batch[key][row])
                    assert have.dtype == value.dtype and np.array_equal(have, value), key


def test_a_stream_cancelled_mid_batch_frees_it_and_the_server_goes_on(framed) -> None:
    pid = framed.proc.pid

    def held() -> list[Path]:
        return sorted(Path("/dev/shm").glob(f"stoker_{pid}_*"))

    for _ in range(KEEP_SEGMENTS + 2):  # a leak of 2 segments per stream would show
        with grpc.insecure_channel(framed.address) as channel:
            call = noise_stream(channel, [0, 1])
            first = pb.BatchFrame.FromString(next(call))
            assert first.offset == 0 and first.payload_bytes > FRAME  # more were to come
            call.cancel()
        with RemoteLoader(framed.address, "noise", batch_size=2, timeout=60) as loader:
            assert len(list(loader)) == 3
    # Both batches of each cancelled stream went back to the worker's pool (one worker):
    # segments are reused, never more than the pool keeps plus none in flight.
    if Path("/dev/shm").is_dir():
        assert 0 < len(held()) <= KEEP_SEGMENTS
    assert "Traceback" not in framed.stderr
