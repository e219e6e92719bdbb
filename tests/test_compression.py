"""compression="zstd": frames compressed per stream, for links slower than the CPUs."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from epochs import epoch

from stoker.client import RemoteLoader
from stoker.v1 import stoker_pb2 as pb

pytestmark = pytest.mark.timeout(120)
zstandard = pytest.importorskip("zstandard")

DATASETS = {"ramp": {"format": "python", "factory": "toy_datasets:Ramp",
                     "options": {"n": 24, "size": 200_000}},
            "toy": {"format": "python", "factory": "toy_datasets:toy", "options": {"n": 8}}}


@pytest.fixture(scope="module")
def server(start_server_module):
    return start_server_module(DATASETS, workers=2)


READ = {"batch_size": 4, "seed": 3, "shared_memory": False}  # every epoch() here


def test_compressed_batches_equal_plain_ones_in_far_fewer_bytes(server) -> None:
    read = epoch(server, "ramp", **READ)
    plain, plain_bytes = read.arrays(), read.stats["bytes"]
    read = epoch(server, "ramp", compression="zstd", **READ)
    packed, packed_bytes = read.arrays(), read.stats["bytes"]
    for k in plain:
        assert plain[k].dtype == packed[k].dtype and np.array_equal(plain[k], packed[k]), k
    assert plain_bytes >= 24 * 200_000 * 2  # every payload byte on the wire
    assert packed_bytes < plain_bytes / 10  # ramps compress well


def raw_first_frame(server, compression: str, dataset: str) -> pb.BatchFrame:
    coords = pb.Coordinates(dataset=dataset, seed=0, epoch=0, shuffle=False, rank=0,
                            world_size=1, batch_size=4, drop_last=True)
    with grpc.insecure_channel(server.address) as channel:
        call = channel.stream_stream(
            "/stoker.v1.DataService/StreamBatches",
            request_serializer=pb.StreamRequest.SerializeToString,
            response_deserializer=pb.BatchFrame.FromString)(iter([pb.StreamRequest(
                coordinates=coords, batch_indices=[0], compression=compression)]), timeout=60)
        return next(call)


def test_frames_say_how_they_are_compressed(server) -> None:
    big = raw_first_frame(server, "zstd", "ramp")
    assert big.compression == "zstd" and big.offset == 0
    assert len(zstandard.ZstdDecompressor().decompress(big.data)) == big.payload_bytes
    small = raw_first_frame(server, "zstd", "toy")  # a few hundred bytes: not worth it
    assert small.compression == "" and len(small.data) == small.payload_bytes


def test_an_unknown_compression_is_invalid_argument_and_the_server_goes_on(server) -> None:
    with pytest.raises(grpc.RpcError) as info:
        raw_first_frame(server, "lz5", "ramp")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "compression: 'lz5'" in info.value.details()
    assert len(epoch(server, "toy", **READ).arrays()["sample_index"]) == 8
    with pytest.raises(ValueError, match="compression must be None or 'zstd'"):
        RemoteLoader(server.address, "toy", batch_size=4, compression="gzip")
