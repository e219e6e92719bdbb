"""Issue 20, the first hour, the command line's parts: each test is named after the item it
covers. The `stoker` commands a trainer node runs are run from a real client-only install
(a fresh venv with `torch==2.13.0`, then `.[client]`, as README.md says), against real
servers; `check` needs the server extra and runs from this environment.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tarfile
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from certs import Authority
from PIL import Image

from conftest import server_env

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "first-hour-token-0123456789abcdef"
# The first test to use the client-only install pays for making it (~25 s).
pytestmark = pytest.mark.timeout(360)


@dataclass(frozen=True)
class ClientOnly:
    """A venv with exactly the README's trainer install; `seconds`: how long it took."""

    venv: Path
    seconds: float

    def stoker(self, *args: str, env: dict[str, str] | None = None,
               cwd: Path | None = None) -> subprocess.CompletedProcess:
        clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "STOKER_TOKEN")}
        return subprocess.run([str(self.venv / "bin" / "stoker"), *args], capture_output=True,
                              text=True, timeout=60, env={**clean, **(env or {})},
                              cwd=cwd or self.venv)


def _pip(venv: Path, *args: str) -> None:
    # --no-compile: byte-compiling torch's thousands of modules took 3/4 of the install's time
    # (40 s of 50), and a module is compiled on import anyway.
    out = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet",
                          "--no-compile", *args], capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, f"pip install {' '.join(args)}:\n{out.stdout}{out.stderr}"


@pytest.fixture(scope="session")
def client_only(tmp_path_factory: pytest.TempPathFactory) -> ClientOnly:
    """`python -m venv`, `pip install torch==2.13.0`, `pip install ".[client]"` from a copy of
    this checkout (a build writes build/ and *.egg-info beside the sources: not into ours)."""
    base = tmp_path_factory.mktemp("client-only")
    started = time.monotonic()
    shutil.copytree(ROOT, base / "src", ignore=shutil.ignore_patterns(
        ".git", ".venv*", ".whl", "__pycache__", "*.egg-info", "build", "dist", ".pytest_cache",
        ".ruff_cache", ".mypy_cache", ".hypothesis", "data", "results"))
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    _pip(venv, "torch==2.13.0")
    _pip(venv, f"{base / 'src'}[client]")
    env = ClientOnly(venv, time.monotonic() - started)
    print(f"\nclient-only install: {env.seconds:.1f} s", file=sys.stderr)
    return env


def _pictures(root: Path) -> Path:
    for c, rgb in enumerate([(255, 0, 0), (0, 0, 255)]):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(4):
            Image.new("RGB", (40 + i, 32), rgb).save(root / f"c{c}" / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def plain_server(start_server_module, tmp_path_factory):
    return start_server_module({
        "pics": {"format": "image-folder", "source": str(_pictures(
            tmp_path_factory.mktemp("pics"))), "size": 24},
        "toy": {"format": "python", "factory": "toy_datasets:toy", "options": {"n": 30}}})


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("pki")
    ca = Authority(folder)
    server = ca.issue("server", server=True)
    (folder / "token").write_text(TOKEN + "\n")
    (folder / "wrong").write_text("x" * len(TOKEN) + "\n")
    return {"ca": ca.ca, "cert": server.cert, "key": server.key, "token": folder / "token",
            "wrong": folder / "wrong"}


@pytest.fixture(scope="module")
def tls_server(start_server_module, pki):
    return start_server_module(
        {"toy": {"format": "python", "factory": "toy_datasets:toy", "options": {"n": 10}}},
        server={"tls": {"cert_file": str(pki["cert"]), "key_file": str(pki["key"])},
                "auth_token_file": str(pki["token"])})


def dev_stoker(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The command from this environment (the server extra is here)."""
    return subprocess.run([sys.executable, "-m", "stoker.server.cli", *args], capture_output=True,
                          text=True, timeout=100, env={**os.environ, **(env or {})})


# -- item 1: the CLI on a trainer node ---------------------------------------------------------
def test_item1_the_cli_runs_with_only_the_client_extra(client_only, plain_server,
                                                       tmp_path: Path) -> None:
    python = str(client_only.venv / "bin" / "python")
    for module in ("yaml", "pydantic", "fastapi", "uvicorn", "boto3", "PIL"):  # truly client-only
        assert subprocess.run([python, "-c", f"import {module}"], capture_output=True,
                              timeout=60).returncode != 0, module
    out = client_only.stoker("--help")
    assert out.returncode == 0, out.stderr
    for command in ("serve", "check", "datasets", "inspect", "stats"):
        assert command in out.stdout
    out = client_only.stoker("datasets", plain_server.address)
    assert out.returncode == 0, out.stderr
    assert [r.split() for r in out.stdout.splitlines()[1:]] == [
        ["pics", "image-folder", "8"], ["toy", "python", "30"]]
    picture = tmp_path / "grid.png"
    out = client_only.stoker("inspect", plain_server.address, "pics", "--grid", str(picture))
    assert out.returncode == 0, out.stderr
    assert np.asarray(Image.open(picture)).shape[2] == 3
    # The server-only commands say which extra they need, in one line, exit code 2.
    config = tmp_path / "c.yaml"
    config.write_text("datasets: {}\n")
    for args in (["serve", "--config", str(config)], ["check", str(config)]):
        out = client_only.stoker(*args)
        assert out.returncode == 2 and out.stdout == "", out.stderr
        assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
        assert f"stoker {args[0]} needs the server extra" in out.stderr
        assert 'pip install ".[server]"' in out.stderr


# -- item 5: a first contact that fails says what to change ------------------------------------
def test_item5_first_contact_failures_name_the_option_to_pass(client_only, tls_server, pki,
                                                              ledger) -> None:
    tls = ["--tls-ca", str(pki["ca"])]
    cases: list[tuple[str, list[str], dict[str, str], list[str]]] = [
        ("plain-text CLI against a TLS server, token given", ["--token-file", str(pki["token"])],
         {}, ["may need TLS", "--tls-ca"]),
        ("TLS CLI without a token", tls, {}, ["UNAUTHENTICATED", "--token-file"]),
        ("TLS CLI with a wrong token file", [*tls, "--token-file", str(pki["wrong"])], {},
         ["refused the token from --token-file " + str(pki["wrong"])]),
        ("TLS CLI with a wrong $STOKER_TOKEN", tls, {"STOKER_TOKEN": "y" * 32},
         ["refused the token from $STOKER_TOKEN"]),
    ]
    for n, (case, extra, env, expected) in enumerate(cases):
        commands = [["datasets", tls_server.address], ["inspect", tls_server.address, "toy"]]
        for command in commands[:2 if n == 0 else 1]:  # both share the first contact
            out = client_only.stoker(*command, *extra, env=env)
            assert out.returncode == 1 and out.stdout == "", (case, out.stderr)
            assert out.stderr.startswith(tls_server.address + ": "), (case, out.stderr)
            for part in expected:
                assert part in out.stderr, (case, out.stderr)
            assert TOKEN not in out.stderr and "y" * 32 not in out.stderr
        ledger.record("security", case, tried=2 if n == 0 else 1,
                      detail=f"exit 1: {expected[-1]}")
    http = f"127.0.0.1:{tls_server.ready['http_port']}"
    out = client_only.stoker("stats", http, "--token-file", str(pki["token"]))
    assert out.returncode == 1 and "may need TLS" in out.stderr and "--tls-ca" in out.stderr
    out = client_only.stoker("stats", http, *tls)
    assert out.returncode == 1 and "401" in out.stderr and "--token-file" in out.stderr
    out = client_only.stoker("stats", http, *tls, "--token-file", str(pki["token"]))
    assert out.returncode == 0 and "toy" not in out.stderr, out.stderr
    ledger.record("security", "stats: plain HTTP to a TLS port, then no token", tried=2,
                  detail="each names the option to pass")


# -- item 9: --version, check, stats, captioned grid, example config --------------------------
def test_item9_version_comes_from_the_installed_metadata(client_only) -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    out = client_only.stoker("--version")
    assert (out.returncode, out.stdout.strip()) == (0, f"stoker {version}"), out.stderr


def test_item9_check_opens_every_dataset_and_names_the_one_that_fails(tmp_path: Path,
                                                                      ledger) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(
        "datasets:\n"
        "  toy: {format: python, factory: 'toy_datasets:toy', options: {n: 12}}\n"
        "  unreadable: {format: python, factory: 'toy_datasets:toy', "
        "options: {n: 5, fail_at: [0]}}\n"
        "  missing: {format: python, factory: 'no_such_module:make'}\n")
    out = dev_stoker("check", str(config), env=server_env())
    assert out.returncode == 1, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"{config}: valid"), lines
    by_name = {line.split()[1]: line for line in lines[1:]}
    assert by_name["toy"].startswith("ok") and "12 samples" in by_name["toy"]
    assert "sha256:" in by_name["toy"] and "label int64" in by_name["toy"]
    assert by_name["unreadable"].startswith("FAIL") and "sample 0" in by_name["unreadable"]
    assert by_name["missing"].startswith("FAIL") and "no_such_module" in by_name["missing"]
    assert "2 problems" in out.stderr
    ledger.record("config", "stoker check: a dataset whose sample 0 fails, one that does not "
                  "import", tried=2, detail="exit 1, a FAIL line naming each")
    config.write_text("datasets:\n  toy: {format: python, factory: 'toy_datasets:toy'}\n")
    out = dev_stoker("check", str(config), env=server_env())
    assert out.returncode == 0 and out.stdout.splitlines()[1].startswith("ok"), out.stderr


def test_item9_stats_shows_the_live_pages_table(client_only, plain_server) -> None:
    out = client_only.stoker("inspect", plain_server.address, "toy", "--batch-size", "10")
    assert out.returncode == 0, out.stderr  # some traffic for the table
    http = f"127.0.0.1:{plain_server.ready['http_port']}"
    out = client_only.stoker("stats", http, "--watch", "0.1", "--count", "2")
    assert out.returncode == 0, out.stderr
    tables = out.stdout.split(f"{http}: ")[1:]
    assert len(tables) == 2, out.stdout
    head, columns, *rows = [line for line in tables[-1].splitlines() if line]
    assert head.startswith("1 workers,") and "rates over the last" in head
    assert columns.split()[:5] == ["dataset", "samples/s", "batches/s", "MB/s", "streams"]
    toy = next(r.split() for r in rows if r.startswith("toy"))
    assert float(toy[1]) > 0 and float(toy[2]) > 0, rows
    out = client_only.stoker("stats", plain_server.address)  # the gRPC port by mistake
    assert out.returncode == 1 and "this is the gRPC port" in out.stderr, out.stderr


def test_item9_grid_tiles_are_captioned_with_sample_index_and_label(
        client_only, plain_server, tmp_path: Path) -> None:
    from stoker.server.tools.inspect import draw_text

    picture = tmp_path / "grid.png"
    out = client_only.stoker("inspect", plain_server.address, "pics", "--batch-size", "8",
                             "--no-shuffle", "--grid", str(picture))
    assert out.returncode == 0, out.stderr
    assert "each captioned sample index:label" in out.stdout
    grid = np.asarray(Image.open(picture))
    assert grid.shape == (24 + 7, 8 * 26 - 2, 3)  # eight 24x24 tiles, a 7-pixel caption strip
    for i in range(8):  # class folders c0 (red) then c1 (blue), four each
        tile = grid[:24, i * 26: i * 26 + 24]
        assert tuple(tile[12, 12]) == ((255, 0, 0) if i < 4 else (0, 0, 255))
        want = np.full((7, 24, 3), 255, np.uint8)
        draw_text(want, f"{i}:{i // 4}", 1, 0, 1, 24)
        assert np.array_equal(grid[24:, i * 26: i * 26 + 24], want), i


def _example_data(folder: Path) -> None:
    """Small files of every kind examples/stoker.yaml serves, where it looks for them."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from shapes import make_shapes
    finally:
        sys.path.remove(str(ROOT / "examples"))
    data = folder / "data"
    make_shapes(data / "shapes", per_class=2, size=32)
    (folder / "mydata.py").write_text(
        "import numpy as np\n\ndef make_dataset(split):\n"
        "    return [{'x': np.float32(i)} for i in range(7)]\n")
    for sub in ("reviews", "tokens", "features", "shards", "clicks", "corpus"):
        (data / sub).mkdir()
    (data / "reviews" / "a.jsonl").write_text(
        '{"emb": [0, 1, 2, 3, 4, 5, 6, 7], "stars": 4, "text": "fine"}\n' * 3)
    np.arange(1000, dtype=np.uint16).tofile(data / "tokens" / "a.bin")
    np.save(data / "features" / "x_000.npy", np.ones((6, 4), np.float16))
    np.save(data / "features" / "y_000.npy", np.arange(6))
    jpeg = BytesIO()
    Image.new("RGB", (40, 40), (0, 128, 0)).save(jpeg, "JPEG")
    with tarfile.open(data / "shards" / "000.tar", "w") as tar:
        for key in ("000", "001"):
            for ext, payload in (("jpg", jpeg.getvalue()), ("cls", b"1")):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(payload)
                tar.addfile(info, BytesIO(payload))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"dense": pa.array([[0.5] * 13] * 4, pa.list_(pa.float32(), 13)),
                             "clicked": [0, 1, 0, 1]}), data / "clicks" / "a.parquet")
    (data / "corpus" / "a.jsonl").write_text('{"text": "%s"}\n' % ("hello world " * 40) * 4)


def test_item9_the_example_config_passes_check(tmp_path: Path) -> None:
    shutil.copy(ROOT / "examples" / "stoker.yaml", tmp_path / "stoker.yaml")
    _example_data(tmp_path)
    env = {"PYTHONPATH": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    out = dev_stoker("check", str(tmp_path / "stoker.yaml"), env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    ok = [line.split()[1] for line in out.stdout.splitlines() if line.startswith("ok")]
    assert ok == ["shapes", "mine", "reviews", "owt", "features", "webdataset", "clicks",
                  "corpus"], out.stdout
    formats = {line.split()[2].rstrip(":") for line in out.stdout.splitlines()[1:]}
    assert formats == {"image-folder", "python", "jsonl", "tokens", "memmap", "tar", "parquet",
                       "text"}  # every kind


# -- item 13: a wrong address fails fast, the same way in both commands; did-you-mean ---------
@pytest.fixture
def silent_port() -> Iterator[str]:
    """A loopback port that accepts TCP connections and never answers (a wrong service, a
    stuck host): a client waits for it unless it gives up by itself."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield f"127.0.0.1:{s.getsockname()[1]}"


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # closed again on leaving: nothing listens


def test_item13_a_wrong_address_fails_fast_alike_in_datasets_and_inspect(
        client_only, silent_port, ledger) -> None:
    address = _closed_port()
    said = []
    for command in (["datasets", address], ["inspect", address, "toy"]):
        started = time.monotonic()
        out = client_only.stoker(*command)
        took = time.monotonic() - started
        assert out.returncode == 1 and took < 4, (command, took, out.stderr)
        assert out.stderr.startswith(f"{address}: connection refused"), out.stderr
        said.append(out.stderr)
    assert said[0] == said[1]
    ledger.record("network", "CLI: nothing listens at the address", tried=2,
                  detail="datasets and inspect: 'connection refused' naming it, < 4 s")
    started = time.monotonic()
    out = client_only.stoker("inspect", silent_port, "toy")  # default --timeout 30
    took = time.monotonic() - started
    assert out.returncode == 1 and took < 10, (took, out.stderr)
    assert out.stderr.startswith(f"{silent_port}: no answer within 5 s"), out.stderr
    ledger.record("network", "CLI: the address accepts TCP and never answers", tried=1,
                  detail=f"inspect gives up after 5 s ({took:.1f} s), naming the address")


def test_item13_an_unknown_config_key_suggests_the_one_meant(tmp_path: Path, ledger) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("datasets:\n  toy: {format: python, factory: 'toy_datasets:toy', "
                      "option: {n: 3}}\nserver: {prot: 1, zzz: 2}\n")
    out = dev_stoker("check", str(config), env=server_env())
    assert out.returncode == 2 and out.stdout == "", out.stderr
    lines: dict[str, Any] = {line.split(":")[0].strip(): line for line in
                             out.stderr.splitlines()[1:]}
    assert "did you mean 'options'?" in lines["datasets.toy.python.option"]
    assert "did you mean 'port'?" in lines["server.prot"]
    assert "expected one of: " in lines["server.zzz"] and "http_port" in lines["server.zzz"]
    ledger.record("config", "unknown keys: typos and a key unlike any", tried=3,
                  detail="the closest valid key, else the valid keys")
