"""What bad input gets, and that the server keeps serving everyone else afterwards."""

from __future__ import annotations

import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
from epochs import epoch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stoker.client import RemoteError, RemoteLoader
from stoker.server import ServerProcess
from stoker.server.pool.batch import replacement
from stoker.v1 import stoker_pb2 as pb
from stoker.v1 import stoker_pb2_grpc as pb_grpc

from toy_datasets import Toy


def still_serves(server: ServerProcess) -> None:
    with RemoteLoader(server.address, "toy", batch_size=16, output="numpy", timeout=60) as ld:
        assert sum(len(b["sample_index"]) for b in ld) == len(ld) * 16 > 0


def fail(server: ServerProcess, dataset: str = "toy", **kw) -> RemoteError:
    kw.setdefault("batch_size", 4)
    with pytest.raises(RemoteError) as info:
        with RemoteLoader(server.address, dataset, output="numpy", timeout=60, **kw) as ld:
            for _ in ld:
                pass
    return info.value


def test_unknown_dataset_is_not_found_and_lists_the_served_ones(toy_server) -> None:
    err = fail(toy_server, "faces")
    assert err.code == grpc.StatusCode.NOT_FOUND
    assert "'faces'" in err.details and "toy" in err.details and "flaky" in err.details
    still_serves(toy_server)


@pytest.mark.parametrize(("field", "kw"), [
    ("batch_size", {"batch_size": 0}),
    ("batch_size", {"batch_size": -3}),
    ("rank", {"rank": 3, "world_size": 3}),
    ("world_size", {"rank": 0, "world_size": 0}),
    ("seed", {"seed": -1}),
])
def test_bad_coordinates_are_invalid_argument_naming_the_field(toy_server, field, kw) -> None:
    err = fail(toy_server, **kw)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details.startswith(f"{field}:")
    still_serves(toy_server)


def stream(server: ServerProcess, *requests: pb.StreamRequest) -> list[bytes]:
    with grpc.insecure_channel(server.address) as channel:
        call = channel.stream_stream("/stoker.v1.DataService/StreamBatches",
                                     request_serializer=pb.StreamRequest.SerializeToString)
        return list(call(iter(requests), timeout=60))


def coords(**kw) -> pb.Coordinates:
    base = dict(dataset="toy", seed=0, epoch=0, shuffle=True, rank=0, world_size=1,
                batch_size=10, drop_last=True)
    return pb.Coordinates(**{**base, **kw})


@pytest.mark.parametrize(("field", "requests"), [
    ("epoch", [pb.StreamRequest(coordinates=coords(epoch=-2), batch_indices=[0])]),
    ("batch_index", [pb.StreamRequest(coordinates=coords(), batch_indices=[10])]),
    ("batch_index", [pb.StreamRequest(coordinates=coords(), batch_indices=[-1])]),
    ("coordinates", [pb.StreamRequest(batch_indices=[0])]),
])
def test_bad_stream_requests_are_invalid_argument(toy_server, field, requests) -> None:
    with pytest.raises(grpc.RpcError) as info:
        stream(toy_server, *requests)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(f"{field}:")
    still_serves(toy_server)


def test_a_stream_answers_its_credits_then_ends(toy_server) -> None:
    frames = stream(toy_server, pb.StreamRequest(coordinates=coords(), batch_indices=[3, 1]),
                    pb.StreamRequest(coordinates=coords(epoch=1), batch_indices=[3]))
    heads = [pb.BatchFrame.FromString(f) for f in frames]
    assert sorted((h.epoch, h.batch_index) for h in heads) == [(0, 1), (0, 3), (1, 3)]


def test_too_many_credits_are_resource_exhausted(toy_server) -> None:
    with pytest.raises(grpc.RpcError) as info:
        stream(toy_server, pb.StreamRequest(coordinates=coords(batch_size=1),
                                            batch_indices=list(range(65))))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "credits" in info.value.details()
    still_serves(toy_server)


def test_a_client_may_keep_every_credit_the_server_allows(toy_server) -> None:
    # The client credits the next batch as soon as it has taken one: the server must count
    # the answered credit back by then, or prefetch == max_credits trips the limit.
    with RemoteLoader(toy_server.address, "toy", batch_size=1, prefetch=64, output="numpy",
                      timeout=60) as ld:
        assert sum(1 for _ in ld) == 103


def test_a_failing_sample_is_data_loss_naming_it(toy_server) -> None:
    err = fail(toy_server, "flaky", shuffle=False, batch_size=4)
    assert err.code == grpc.StatusCode.DATA_LOSS
    assert "sample 13" in err.details and "cannot decode record 13" in err.details
    assert "ValueError" in err.details
    still_serves(toy_server)
    # The batches before the bad one arrive intact.
    with RemoteLoader(toy_server.address, "flaky", batch_size=4, shuffle=False, output="numpy",
                      timeout=60) as ld:
        got = []
        with pytest.raises(RemoteError):
            for batch in ld:
                got.append(batch["sample_index"].copy())
    assert np.array_equal(np.concatenate(got), np.arange(12))


def test_on_error_skip_replaces_a_bad_sample_the_same_way_every_time(toy_server) -> None:
    first, second = (epoch(toy_server, "skippy", batch_size=4, shuffle=False),
                     epoch(toy_server, "skippy", batch_size=4, shuffle=False))
    got = np.concatenate([b["sample_index"] for b in first])
    expected = np.arange(40)
    expected[13], expected[30] = replacement(13, 1, 40), replacement(30, 1, 40)
    assert expected[13] not in (13, 30) and expected[30] not in (13, 30)  # good stand-ins
    assert np.array_equal(got, expected)
    # The stand-in's data, not a copy of its index only.
    x = np.concatenate([b["x"] for b in first])
    assert np.array_equal(x[13], Toy(n=40).__getitem__(int(expected[13]))["x"])
    for a, b in zip(first, second, strict=True):  # deterministic: identical every epoch
        assert all(np.array_equal(a[k], b[k]) for k in a)


def test_a_failed_batch_is_answered_in_band_and_the_stream_goes_on(toy_server) -> None:
    frames = stream(toy_server, pb.StreamRequest(
        coordinates=coords(dataset="flaky", shuffle=False, batch_size=4),
        batch_indices=[2, 3, 4]))
    heads = {h.batch_index: h for h in map(pb.BatchFrame.FromString, frames)}
    assert sorted(heads) == [2, 3, 4]
    assert heads[3].error.code == grpc.StatusCode.DATA_LOSS.value[0]
    assert "sample 13" in heads[3].error.message and not heads[3].data
    assert not heads[2].HasField("error") and heads[4].payload_bytes > 0


def test_samples_that_cannot_be_collated_are_data_loss(toy_server) -> None:
    err = fail(toy_server, "ragged", shuffle=False, batch_size=2)
    assert err.code == grpc.StatusCode.DATA_LOSS
    assert "sample 1" in err.details and "'x'" in err.details
    still_serves(toy_server)


def test_a_crashing_worker_fails_its_batch_and_is_replaced(toy_server) -> None:
    err = fail(toy_server, "crashy", shuffle=False, batch_size=4)
    assert err.code == grpc.StatusCode.INTERNAL
    assert "worker process died" in err.details and "batch 5" in err.details
    still_serves(toy_server)
    still_serves(toy_server)


def test_only_the_batch_a_worker_died_on_fails(toy_server) -> None:
    frames = stream(toy_server, pb.StreamRequest(
        coordinates=coords(dataset="crashy", shuffle=False, batch_size=4),
        batch_indices=[5, 6, 7]))
    heads = {h.batch_index: h for h in map(pb.BatchFrame.FromString, frames)}
    assert heads[5].error.code == grpc.StatusCode.INTERNAL.value[0]
    # Batches queued behind it on the same worker go to another worker and arrive.
    assert not heads[6].HasField("error") and not heads[7].HasField("error")
    assert heads[6].payload_bytes > 0 and heads[7].payload_bytes > 0


def test_a_number_beyond_int64_is_data_loss(toy_server) -> None:
    err = fail(toy_server, "huge", shuffle=False, batch_size=4)
    assert err.code == grpc.StatusCode.DATA_LOSS and "sample 6" in err.details
    still_serves(toy_server)


def test_list_and_describe(toy_server) -> None:
    with grpc.insecure_channel(toy_server.address) as channel:
        stub = pb_grpc.DataServiceStub(channel)
        listed = stub.ListDatasets(pb.ListDatasetsRequest(), timeout=30)
        assert {(d.name, d.num_samples) for d in listed.datasets} >= {("toy", 103), ("flaky", 40)}
        desc = stub.DescribeDataset(pb.DescribeDatasetRequest(
            coordinates=coords(world_size=3, rank=2, drop_last=False)), timeout=30)
    assert (desc.num_samples, desc.samples_per_rank, desc.batches_per_epoch) == (103, 34, 4)
    fields = {f.name: (f.dtype, list(f.shape)) for f in desc.fields}
    assert fields == {"x": ("float32", [3]), "tokens": ("uint8", [2, 3]), "label": ("int64", []),
                      "weight": ("float64", []), "flag": ("bool", []), "small": ("int16", []),
                      "sample_index": ("int64", [])}


def test_workers_that_cannot_restart_fail_batches_instead_of_looping(start_server,
                                                                     tmp_path) -> None:
    opens = tmp_path / "opens.log"
    server = start_server({"once": {"format": "python", "factory": "toy_datasets:toy",
                                    "options": {"n": 40, "die_at": 5, "opens_log": str(opens),
                                                "max_opens": 1}}}, workers=1)
    for _ in range(2):  # the client retries the batch; then every batch has no worker
        with pytest.raises(RemoteError) as info:
            with RemoteLoader(server.address, "once", batch_size=4, shuffle=False,
                              output="numpy", timeout=60) as ld:
                list(ld)
        assert info.value.code == grpc.StatusCode.INTERNAL
        assert "no worker process" in info.value.details
    assert opens.read_text().count("open") == 2  # the first worker and one replacement
    # Nothing can serve: /readyz says so at once, gRPC health within a watch period (Watch
    # streams each change: no polling).
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(server.http_url + "/readyz", timeout=10)
    err.value.close()  # it holds the connection
    assert err.value.code == 503
    with grpc.insecure_channel(server.address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=""), timeout=30)
        statuses = []
        for reply in watch:
            statuses.append(reply.status)
            if reply.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
        watch.cancel()
    assert statuses[-1] == health_pb2.HealthCheckResponse.NOT_SERVING

