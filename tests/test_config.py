"""A bad config stops the server before it opens a port, naming the file, field and problem."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TOY_DATASETS, server_env


def serve(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run(
        [sys.executable, "-m", "stoker.server", "serve", "--config", str(config), "--port", "0",
         "--http-port", "0", *args],
        capture_output=True, text=True, timeout=90, env={**os.environ, **server_env()})


def write(tmp_path: Path, text: str = "datasets: {a: {format: python, factory: "
          "'toy_datasets:toy'}}") -> Path:
    config = tmp_path / "c.yaml"
    config.write_text(text)
    return config


@pytest.mark.parametrize(("text", "expected"), [
    ("datasets: {}", ["datasets:", "at least 1"]),
    ("server: {max_credits: 0}\ndatasets: {a: {format: python, factory: 'm:f'}}",
     ["server.max_credits:", "greater than or equal to 1"]),
    ("datasets: {a: {format: feather}}", ["datasets.a:", "'python', 'image-folder'"]),
    ("datasets: {a: {format: python, factory: 'no colon'}}",
     ["datasets.a.python.factory:", "pattern"]),
    ("datasets: {a: {format: python, factory: 'm:f', typo: 1}}",
     ["datasets.a.python.typo:", "Extra inputs"]),
    ("datasets: {a: {format: image-folder, source: ./missing, size: 32}}",
     ["datasets.a.image-folder.source:", "not a directory"]),
    ("datasets: {a: {format: image-folder, source: ., size: [0, 4]}}",
     ["datasets.a.image-folder.size:", ">= 1"]),
    ("server: {tls: {cert_file: bad.yaml}}\ndatasets: {a: {format: python, factory: 'm:f'}}",
     ["server.tls.key_file:", "Field required"]),
    ("server: {tls: {cert_file: none.pem, key_file: bad.yaml}}\n"
     "datasets: {a: {format: python, factory: 'm:f'}}",
     ["server.tls.cert_file:", "not a file"]),
    ("server: {auth_token_env: STOKER_TEST_NO_SUCH_VARIABLE}\n"
     "datasets: {a: {format: python, factory: 'm:f'}}",
     ["server:", "environment variable STOKER_TEST_NO_SUCH_VARIABLE is not set"]),
    ("datasets: [a, b", ["not valid YAML"]),
    ("- just\n- a list", ["expected a mapping"]),
])
def test_bad_config_exits_non_zero_naming_file_and_field(tmp_path: Path, text: str,
                                                          expected: list[str]) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    result = serve(config)
    assert result.returncode == 2, result.stderr
    assert f"config error in {config}" in result.stderr
    for part in expected:
        assert part in result.stderr
    assert result.stdout == ""  # never became ready


def test_missing_config_file(tmp_path: Path) -> None:
    result = serve(tmp_path / "nope.yaml")
    assert result.returncode == 2 and "cannot read" in result.stderr


def test_bad_command_line_value_is_checked_like_the_file(tmp_path: Path) -> None:
    result = serve(write(tmp_path), "--workers", "0")
    assert result.returncode == 2 and "server.workers:" in result.stderr


def test_a_dataset_whose_first_sample_fails_stops_every_worker(tmp_path: Path) -> None:
    config = write(tmp_path, "datasets:\n  bad: {format: python, factory: 'toy_datasets:toy', "
                             "options: {fail_at: [0]}}\n")
    result = serve(config, "--workers", "3")  # must exit, not wait for the workers that did start
    assert result.returncode == 1
    assert f"cannot start {config}: dataset 'bad': SampleError: sample 0:" in result.stderr


def test_a_taken_port_is_one_clear_line(tmp_path: Path, start_server) -> None:
    running = start_server({"toy": TOY_DATASETS["toy"]})
    config = write(tmp_path)
    for flag, port, what in [("--port", running.ready["grpc_port"], "gRPC"),
                             ("--http-port", running.ready["http_port"], "HTTP")]:
        result = serve(config, "--workers", "1", flag, str(port))
        assert result.returncode == 1, result.stderr
        assert f"cannot listen on 127.0.0.1:{port} ({what})" in result.stderr
        assert "Traceback" not in result.stderr and "never awaited" not in result.stderr


def test_a_bad_log_level_is_a_usage_error(tmp_path: Path) -> None:
    result = serve(write(tmp_path), "--log-level", "LOUD")
    assert result.returncode == 2 and "--log-level" in result.stderr


def test_a_dataset_that_cannot_open_stops_the_start(tmp_path: Path) -> None:
    config = write(tmp_path, "datasets:\n  good: {format: python, factory: 'toy_datasets:toy'}\n"
                             "  broken: {format: python, factory: 'no_such_module:make'}\n")
    result = serve(config, "--workers", "1")
    assert result.returncode == 1
    assert f"cannot start {config}: dataset 'broken'" in result.stderr
    assert "no_such_module" in result.stderr
