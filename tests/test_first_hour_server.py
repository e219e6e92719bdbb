"""The data server's first-hour surprises (issue 20, items 3, 8, 9, 12, 13), each met the way a
new user meets it: a real server in a child process (its datasets in
tests/first_hour_datasets.py, torch Datasets as people have them), a real client."""

from __future__ import annotations

import re
import socket
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from stoker.client import RemoteError, RemoteLoader
from stoker.server import ServerProcess, write_config

from conftest import TESTS, server_env

pytestmark = pytest.mark.timeout(120)

DATASETS = {
    "pets": {"format": "python", "factory": "first_hour_datasets:Pets",
             "fields": ["image", "label"]},
    "pets_unnamed": {"format": "python", "factory": "first_hour_datasets:Pets"},
    "plain": {"format": "python", "factory": "first_hour_datasets:Plain"},
    "mixed": {"format": "python", "factory": "first_hour_datasets:Mixed"},
    "captions": {"format": "python", "factory": "first_hour_datasets:Captions",
                 "fields": ["x", "label"]},
    "broken": {"format": "python", "factory": "first_hour_datasets:Broken"},
    "heavy": {"format": "python", "factory": "first_hour_datasets:Heavy"},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    """One server at log level INFO (what an operator runs with), two workers."""
    config = write_config(tmp_path_factory.mktemp("first-hour") / "config.yaml",
                          {"server": {"max_batch_bytes": 2048}, "datasets": DATASETS})
    with ServerProcess(config, workers=2, env=server_env(), log_level="INFO") as proc:
        yield proc
    assert proc.proc is not None and proc.proc.returncode == 0, proc.stderr


def read(url: str) -> tuple[int, str, bytes]:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.status, r.headers.get("content-type", ""), r.read()


def logged(server: ServerProcess, pattern: str, timeout: float = 30.0) -> str:
    """The server's stderr once a line matches `pattern` (it is written a moment after the
    event: a stream's end reaches the server's loop after the client has let go)."""
    return server.wait_for_stderr(pattern, timeout)


def children_of(pid: int) -> list[int]:
    """Every child of `pid`, whichever of its threads started it."""
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            if f"\nPPid:\t{pid}\n" in status.read_text():
                found.append(int(status.parent.name))
        except OSError:
            pass  # exited meanwhile
    return found


def batches(server: ServerProcess, dataset: str, **kw) -> list[dict[str, np.ndarray]]:
    """One epoch, and nothing of the next fetched ahead: what a server sends is that epoch."""
    with RemoteLoader(server.address, dataset, batch_size=4, output="numpy", timeout=60,
                      prefetch_next_epoch=False, **kw) as loader:
        return list(loader)


def failed_start(tmp_path: Path, datasets: dict, server: dict | None = None,
                 **kw) -> tuple[str, float]:
    """(stderr, seconds) of a server that must not start."""
    config = write_config(tmp_path / "config.yaml", {"server": server or {},
                                                     "datasets": datasets})
    proc = ServerProcess(config, workers=1, env=server_env(), **kw)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="did not become ready") as e:
        proc.start()
    return str(e.value), time.monotonic() - started


def test_item3_python_format_takes_what_torch_datasets_return(server, ledger) -> None:
    # (image tensor, label int), fields named by the config
    [first, *_] = batches(server, "pets", shuffle=False)
    assert sorted(first) == ["image", "label", "sample_index"]
    assert first["image"].dtype == np.float32 and first["image"].shape == (4, 3, 4, 4)
    assert first["image"][:, 0, 0, 0].tolist() == [0, 1, 2, 3]
    assert first["label"].dtype == np.int64 and first["label"].tolist() == [0, 1, 2, 0]
    # no fields: given: positional names
    [first, *_] = batches(server, "pets_unnamed", shuffle=False)
    assert sorted(first) == ["0", "1", "sample_index"] and first["1"].tolist() == [0, 1, 2, 0]
    # one tensor (needing grad): field "0"
    [first, *_] = batches(server, "plain", shuffle=False)
    assert sorted(first) == ["0", "sample_index"] and first["0"][1].tolist() == [1, 2, 3, 4]
    # a dict of tensors, numpy scalars, bools and an array-like
    [first, *_] = batches(server, "mixed", shuffle=False)
    assert first["x"].dtype == np.int32 and first["x"][3].tolist() == [3, 4]
    assert first["w"].dtype == np.float32 and first["ok"].tolist() == [True, False, True, False]
    assert first["m"].dtype == np.uint8 and first["m"].shape == (4, 2, 2)
    # what still cannot be batched says what to return instead
    with pytest.raises(RemoteError) as e:
        batches(server, "captions", shuffle=False)
    assert e.value.code.name == "DATA_LOSS"
    assert "sample 5" in str(e.value) and "field 'label' is a str" in str(e.value)
    assert "encode text as token ids" in str(e.value)
    ledger.record("corrupt input", "a torch Dataset sample holding a str field", tried=1)


def test_item8_logs_say_what_the_server_does_and_user_tracebacks_reach_the_client(
        server, ledger) -> None:
    with pytest.raises(RemoteError) as e:
        batches(server, "broken", shuffle=False)
    err = e.value
    assert err.code.name == "DATA_LOSS"
    assert "sample 7: ValueError: record 7 is truncated" in str(err)
    # The user's own frames, by import path; not the server's folders, nor its own frames.
    tb = err.remote_traceback
    assert tb is not None and tb.startswith("Traceback (most recent call last):"), str(err)
    assert 'File "first_hour_datasets.py"' in tb and "in _decode" in tb and "in __getitem__" in tb
    assert tb.rstrip().endswith("ValueError: record 7 is truncated")
    assert str(TESTS) not in str(err) and "pool/worker_main" not in tb and "pool/batch.py" not in tb
    # The server's log: the stream opened and closed, the DATA_LOSS with the full traceback.
    log = logged(server, r"stream \d+ from .*dataset 'broken'.* closed after")
    assert re.search(r"INFO .*stream \d+ from ipv4:127\.0\.0\.1:\d+ \(dataset 'broken', "
                     r"rank 0/1, epoch 0\) opened, by (data_socket|shm|frames)", log), log
    warned = re.search(r"WARNING .*dataset 'broken'.*answered DATA_LOSS: .*record 7 is "
                       r"truncated\n(Traceback.*\n(?:  .*\n)+ValueError: record 7)", log)
    assert warned and str(TESTS / "first_hour_datasets.py") in warned.group(1), log
    assert re.search(r"dataset 'broken'.* closed after [\d.]+ s: \d+ batches sent, [1-9]\d* "
                     r"failed; ", log), log
    # RESOURCE_EXHAUSTED (a batch over max_batch_bytes): a warning saying what and why.
    with pytest.raises(RemoteError, match="RESOURCE_EXHAUSTED"):
        batches(server, "heavy")
    logged(server, r"WARNING .*dataset 'heavy'.*answered RESOURCE_EXHAUSTED: .*max_batch_bytes")
    ledger.record("corrupt input", "a python dataset raising in its own helper: traceback "
                  "carried to the client and logged", tried=1)
    ledger.record("bad requests", "a batch over max_batch_bytes: warned in the server log",
                  tried=1)


def test_item8_docs_are_served_by_the_server_itself(server) -> None:
    for page in ("/docs", "/redoc"):
        status, _, body = read(server.http_url + page)
        html = body.decode()
        assert status == 200 and "http://" not in html and "https://" not in html, html
        assets = re.findall(r"""(?:src|href)=["']([^"']+)["']""", html)
        assert any(a.endswith(".js") for a in assets), html
        for asset in assets:
            assert asset.startswith("/"), asset
            status, _, data = read(server.http_url + asset)
            assert status == 200 and len(data) > 1000, asset


def test_item12_each_transport_has_its_own_metric_label(server) -> None:
    def counts() -> dict[str, float]:
        body = read(server.http_url + "/metrics")[2].decode()
        return {k: float(v) for k, v in re.findall(
            r'stoker_batches_total\{dataset="pets",transport="(\w+)"\} (\S+)', body)}

    before = counts()
    assert len(batches(server, "pets", shared_memory=False, data_socket=False)) == 3
    assert len(batches(server, "pets")) == 3  # the data connection, on the same host too
    assert len(batches(server, "pets", data_socket=False)) == 3  # shared memory
    after = counts()
    sent = {k: after[k] - before.get(k, 0.0) for k in after}
    # The other streams of this module's tests may count too; these three were alone.
    assert sent == {"frames": 3, "data_socket": 3, "shm": 3}, (before, after)
    assert "socket" not in after


def test_item13_worker_processes_are_named(server) -> None:
    assert server.proc is not None
    pid = server.proc.pid
    titles = {}
    for child in children_of(pid):
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")[0].decode()
        if cmdline.startswith("stoker worker"):
            titles[cmdline] = Path(f"/proc/{child}/comm").read_text().strip()
    served = ", ".join(DATASETS)
    assert sorted(titles) == [f"stoker worker {i} (server {pid}): {served}" for i in (0, 1)]
    assert sorted(titles.values()) == ["stoker worker 0", "stoker worker 1"], titles


def test_item13_a_port_clash_names_every_taken_port(tmp_path: Path, ledger) -> None:
    holders = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    grpc_port, http_port = (s.getsockname()[1] for s in holders)
    with holders[0], holders[1]:
        config = write_config(tmp_path / "config.yaml", {"datasets": {
            "pets": DATASETS["pets"]}})
        proc = ServerProcess(config, workers=1, env=server_env(), port=grpc_port,
                             http_port=http_port)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="did not become ready") as e:
            proc.start()
    line = next(x for x in str(e.value).splitlines() if "cannot start" in x)
    assert f"127.0.0.1:{grpc_port} (gRPC): Address already in use" in line, line
    assert f"127.0.0.1:{http_port} (HTTP): Address already in use" in line, line
    assert time.monotonic() - started < 30  # before any worker starts
    ledger.record("config", "gRPC and HTTP ports both taken: one error names both", tried=1)


def test_item9_a_factory_that_cannot_be_imported_suggests_pythonpath(tmp_path: Path,
                                                                     ledger) -> None:
    message, _ = failed_start(tmp_path, {"mine": {"format": "python",
                                                  "factory": "mycode.data:make"}})
    assert "cannot import 'mycode.data': No module named 'mycode'" in message, message
    assert "put the folder that holds 'mycode' on PYTHONPATH" in message, message
    assert f"The server runs in {Path.cwd()}" in message, message
    ledger.record("config", "a factory whose module is not on the server's path", tried=1)


def test_item8_a_factory_that_raises_logs_its_traceback(tmp_path: Path, ledger) -> None:
    message, _ = failed_start(tmp_path, {"mine": {"format": "python",
                                                  "factory": "first_hour_datasets:exploding"}})
    assert "dataset 'mine': ConnectionError: cannot reach db://nowhere" in message, message
    assert re.search(r"dataset 'mine' did not open:\nTraceback.*\n(?:  .*\n)*.*in exploding"
                     r"\n(?:  .*\n)*.*in _connect\n(?:  .*\n)*ConnectionError", message), message
    ledger.record("config", "a factory raising at start: its traceback in the server's log",
                  tried=1)
