"""schemathesis against the HTTP control plane of a real server: requests generated from its
own /openapi.json (valid ones and ones the schema forbids) must never get a 5xx, and every
answer must conform to the document (status code, content type, body schema)."""

from __future__ import annotations

import json
import math
import threading
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from stoker.v1 import stoker_pb2 as pb

pytestmark = pytest.mark.timeout(180)

DATASETS = {"toy": {"format": "python", "factory": "toy_datasets:toy", "options": {"n": 40}},
            "üñí": {"format": "python", "factory": "toy_datasets:toy", "options": {"n": 8}}}
FUZZ = settings(deadline=None, derandomize=True, database=None, print_blob=False,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def server(start_server_module):
    return start_server_module(DATASETS, workers=1)


def stats(server: Any) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(server.http_url + "/v1/stats", timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read().decode()


def test_stats_while_a_client_reports_nonsense(server, ledger) -> None:
    """A ClientReport holding NaN or infinities (any gRPC client can send one) must not turn
    /v1/stats into a 500: JSON has no NaN."""
    reports = [(math.nan, 1.0), (1.0, math.nan), (math.inf, math.inf), (-math.inf, 1.0),
               (1.0, 0.0), (-5.0, 2.0)]
    coords = pb.Coordinates(dataset="toy", world_size=1, batch_size=4)
    with grpc.insecure_channel(server.address) as channel:
        call = channel.stream_stream("/stoker.v1.DataService/StreamBatches",
                                     request_serializer=pb.StreamRequest.SerializeToString,
                                     response_deserializer=pb.BatchFrame.FromString)
        for wait, loop in reports:
            done = threading.Event()

            def requests_(wait: float = wait, loop: float = loop,
                          done: threading.Event = done) -> Iterator[pb.StreamRequest]:
                yield pb.StreamRequest(coordinates=coords, batch_indices=[0], report=(
                    pb.ClientReport(wait_seconds=wait, loop_seconds=loop)))
                done.wait(30)  # the stream, and its report, stay until the stats are read

            stream = call(requests_(), timeout=30)
            next(stream)  # the batch: the report before it has arrived
            status, body = stats(server)
            done.set()
            stream.cancel()
            assert status == 200, body
            assert body["datasets"]["toy"]["streams"] == 1
            stalls = body["datasets"]["toy"]["client_stalls"]
            assert all(isinstance(s, float) and 0.0 <= s <= 1.0 for s in stalls), stalls
    ledger.record("http", "/v1/stats while gRPC clients report NaN, infinite, negative and "
                  "zero stall figures", tried=len(reports), detail="200, stalls in [0, 1]")


def test_the_openapi_document_with_schemathesis(server, ledger) -> None:
    schema = schemathesis.openapi.from_url(server.http_url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/datasets/{name}", "/v1/stats", "/readyz"}
    cases = st.one_of([op.as_strategy(generation_mode=mode) for op in operations
                       for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)])
    statuses: dict[int, int] = {}

    with requests.Session() as session:
        @settings(FUZZ, max_examples=250)
        @given(cases)
        def inner(case: Any) -> None:
            response = case.call(base_url=server.http_url, session=session, timeout=30)
            assert response.status_code < 500, (case.path, response.text[:500])
            case.validate_response(response)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1

        inner()
        # Generated names are all unknown (404): the served ones too, one of them not ASCII.
        named = schema.find_operation_by_label("GET /v1/datasets/{name}")
        for name in [*DATASETS, "..", " ", "t" * 5000]:
            case = named.Case(path_parameters={"name": name})
            response = case.call(base_url=server.http_url, session=session, timeout=30)
            case.validate_response(response)
            assert response.status_code == (200 if name in DATASETS else 404), name
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
    tried = sum(statuses.values())
    ledger.record("http", "schemathesis: requests generated from /openapi.json, valid and "
                  "schema-violating, every operation", tried=tried,
                  detail="no 5xx, every answer conforms; statuses " + ", ".join(
                      f"{k}: {v}" for k, v in sorted(statuses.items())))
    assert tried > 100
