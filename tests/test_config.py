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
     ["datasets.a.image-folder.source:", "no such file or directory"]),
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


# -- every kind of bad config: exit code 2 and a message naming the field path --------------
PY = "{format: python, factory: 'toy_datasets:toy'}"
OK = f"datasets: {{a: {PY}}}"
IMG = "datasets: {a: {format: image-folder, source: src, %s}}"
TRANSFORM = IMG % "transforms: [%s]"
FILE = "datasets: {a: {format: %s, source: src, %s}}"

# (case, config text, fragments the message must hold): the first fragment is the field path.
BAD_CONFIGS = [
    # the file as a whole
    ("empty file", "", ["expected a mapping with `datasets:`"]),
    ("only a comment", "# nothing here\n", ["expected a mapping"]),
    ("top level a list", "- a\n- b", ["expected a mapping"]),
    ("top level a scalar", "42", ["expected a mapping"]),
    ("bad YAML syntax", "datasets: {a: [", ["not valid YAML"]),
    ("a tab for indentation", "datasets:\n\ta: 1", ["not valid YAML", "'\\t'"]),
    ("a python tag", "datasets: !!python/object:os.system {}", ["not valid YAML"]),
    ("not UTF-8", b"datasets: {a: \xff\xfe}", ["not UTF-8 text"]),
    ("unknown top-level key", f"typo: 1\n{OK}", ["typo:", "Extra inputs"]),
    ("datasets missing", "server: {}", ["datasets:", "Field required"]),
    ("datasets empty", "datasets: {}", ["datasets:", "at least 1"]),
    ("datasets null", "datasets:", ["datasets:", "valid dictionary"]),
    ("datasets a list", "datasets: [a, b]", ["datasets:", "valid dictionary"]),
    ("dataset name not a string", f"datasets: {{1: {PY}}}", ["datasets.1.[key]:", "string"]),
    # server:
    ("server a list", f"server: [1, 2]\n{OK}", ["server:", "valid dictionary"]),
    ("server a string", f"server: fast\n{OK}", ["server:", "valid dictionary"]),
    ("server unknown key", f"server: {{prot: 1}}\n{OK}", ["server.prot:", "Extra inputs"]),
    ("port a string", f"server: {{port: http}}\n{OK}", ["server.port:", "valid integer"]),
    ("port out of range", f"server: {{port: 70000}}\n{OK}", ["server.port:", "65535"]),
    ("http_port negative", f"server: {{http_port: -1}}\n{OK}",
     ["server.http_port:", "greater than or equal to 0"]),
    ("data_port a float", f"server: {{data_port: 1.5}}\n{OK}",
     ["server.data_port:", "fractional part"]),
    ("workers zero", f"server: {{workers: 0}}\n{OK}", ["server.workers:", "greater than"]),
    ("max_credits too many", f"server: {{max_credits: 5000}}\n{OK}",
     ["server.max_credits:", "4096"]),
    ("frame_bytes too small", f"server: {{frame_bytes: 100}}\n{OK}",
     ["server.frame_bytes:", "4096"]),
    ("frame_bytes too large", f"server: {{frame_bytes: 1073741824}}\n{OK}",
     ["server.frame_bytes:", "33554432"]),
    ("grace_seconds negative", f"server: {{grace_seconds: -1}}\n{OK}",
     ["server.grace_seconds:", "greater than or equal to 0"]),
    ("shared_memory not a bool", f"server: {{shared_memory: maybe}}\n{OK}",
     ["server.shared_memory:", "valid boolean"]),
    ("host a list", f"server: {{host: [a]}}\n{OK}", ["server.host:", "valid string"]),
    # s3:
    ("s3 unknown key", f"s3: {{secret_key: x}}\n{OK}", ["s3.secret_key:", "Extra inputs"]),
    ("s3 retry_mode", f"s3: {{retry_mode: fast}}\n{OK}", ["s3.retry_mode:", "'adaptive'"]),
    ("s3 max_attempts zero", f"s3: {{max_attempts: 0}}\n{OK}",
     ["s3.max_attempts:", "greater than or equal to 1"]),
    ("s3 timeout zero", f"s3: {{connect_timeout: 0}}\n{OK}",
     ["s3.connect_timeout:", "greater than 0"]),
    ("s3 range_bytes too small", f"s3: {{range_bytes: 1KiB}}\n{OK}",
     ["s3.range_bytes:", "1048576"]),
    ("s3 pool connections", f"s3: {{max_pool_connections: 0}}\n{OK}",
     ["s3.max_pool_connections:", "greater than or equal to 1"]),
    ("s3 a list", f"s3: [x]\n{OK}", ["s3:", "valid dictionary"]),
    # cache:
    ("cache max_bytes not a size", f"cache: {{max_bytes: lots}}\n{OK}",
     ["cache.max_bytes:", "could not parse"]),
    ("cache max_bytes too small", f"cache: {{max_bytes: 10}}\n{OK}",
     ["cache.max_bytes:", "1048576"]),
    ("cache prefetch negative", f"cache: {{prefetch_bytes: -1}}\n{OK}",
     ["cache.prefetch_bytes:"]),
    ("cache dir a list", f"cache: {{dir: [a]}}\n{OK}", ["cache.dir:", "valid path"]),
    # datasets: format and the python format
    ("dataset null", "datasets: {a: null}", ["datasets.a:", "valid dictionary"]),
    ("format missing", "datasets: {a: {factory: 'm:f'}}", ["datasets.a:", "'format'"]),
    ("unknown format", "datasets: {a: {format: feather}}", ["datasets.a:", "'python'"]),
    ("python factory missing", "datasets: {a: {format: python}}",
     ["datasets.a.python.factory:", "Field required"]),
    ("python factory pattern", "datasets: {a: {format: python, factory: 'os.system'}}",
     ["datasets.a.python.factory:", "pattern"]),
    ("python options a list", "datasets: {a: {format: python, factory: 'm:f', options: [1]}}",
     ["datasets.a.python.options:", "valid dictionary"]),
    ("on_error bad", "datasets: {a: {format: python, factory: 'm:f', on_error: retry}}",
     ["datasets.a.python.on_error:", "'skip'"]),
    ("user transform pattern", "datasets: {a: {format: python, factory: 'm:f', "
     "transform: 'x y'}}", ["datasets.a.python.transform:", "pattern"]),
    # storage-backed formats
    ("source nonexistent", (FILE % ("jsonl", "fields: {x: {}}")).replace("src", "nowhere"),
     ["datasets.a.jsonl.source:", "no such file or directory"]),
    ("source empty", (FILE % ("jsonl", "fields: {x: {}}")).replace("src", "''"),
     ["datasets.a.jsonl.source:", "at least 1 character"]),
    ("source blank", (FILE % ("jsonl", "fields: {x: {}}")).replace("src", "' '"),
     ["datasets.a.jsonl.source:", "empty"]),
    ("source a number", (FILE % ("jsonl", "fields: {x: {}}")).replace("src", "5"),
     ["datasets.a.jsonl.source:", "valid string"]),
    ("shuffle bad", FILE % ("jsonl", "fields: {x: {}}, shuffle: random"),
     ["datasets.a.jsonl.shuffle:", "'block'"]),
    ("shuffle_window zero", FILE % ("tar", "fields: {x: {ext: cls, decode: int}}, "
                                           "shuffle_window: 0"),
     ["datasets.a.tar.shuffle_window:", "greater than or equal to 1"]),
    ("dataset s3 unknown key", FILE % ("jsonl", "fields: {x: {}}, s3: {bucket: b}"),
     ["datasets.a.jsonl.s3.bucket:", "Extra inputs"]),
    ("jsonl fields empty", FILE % ("jsonl", "fields: {}"),
     ["datasets.a.jsonl.fields:", "at least 1"]),
    ("jsonl dtype bad", FILE % ("jsonl", "fields: {x: {dtype: complex64}}"),
     ["datasets.a.jsonl.fields.x.dtype:", "'utf8'"]),
    ("jsonl utf8 without max_bytes", FILE % ("jsonl", "fields: {x: {dtype: utf8}}"),
     ["datasets.a.jsonl.fields.x:", "max_bytes is required"]),
    ("tokens seq_len zero", FILE % ("tokens", "seq_len: 0"),
     ["datasets.a.tokens.seq_len:", "greater than or equal to 1"]),
    ("tokens dtype", FILE % ("tokens", "seq_len: 8, dtype: int8"),
     ["datasets.a.tokens.dtype:", "'uint16'"]),
    ("tokens header_bytes negative", FILE % ("tokens", "seq_len: 8, header_bytes: -4"),
     ["datasets.a.tokens.header_bytes:", "greater than or equal to 0"]),
    ("memmap fields a list", FILE % ("memmap", "fields: [a]"),
     ["datasets.a.memmap.fields:", "valid dictionary"]),
    ("tar decode bad", FILE % ("tar", "fields: {x: {ext: jpg, decode: webp}}"),
     ["datasets.a.tar.fields.x.decode:", "'image'"]),
    ("tar json without dtype", FILE % ("tar", "fields: {x: {ext: json, decode: json}}"),
     ["datasets.a.tar.fields.x:", "decode: json needs dtype"]),
    ("tar path without json", FILE % ("tar", "fields: {x: {ext: cls, decode: int, path: a}}"),
     ["datasets.a.tar.fields.x:", "apply to decode: json only"]),
    ("parquet dtype bad", FILE % ("parquet", "fields: {x: {dtype: str}}"),
     ["datasets.a.parquet.fields.x.dtype:", "'float32'"]),
    ("text seq_len one", FILE % ("text", "seq_len: 1"),
     ["datasets.a.text.seq_len:", "greater than or equal to 2"]),
    ("text tokenizer missing", FILE % ("text", "seq_len: 8, tokenizer: none.json"),
     ["datasets.a.text.tokenizer:", "tokenizer file not found"]),
    ("text tokenizer kind", FILE % ("text", "seq_len: 8, tokenizer: vocab.txt"),
     ["datasets.a.text.tokenizer:", "expected 'byte'"]),
    ("text bos_id negative", FILE % ("text", "seq_len: 8, bos_id: -1"),
     ["datasets.a.text.bos_id:", "greater than or equal to 0"]),
    ("text tiktoken_pattern without tiktoken", FILE % ("text", "seq_len: 8, "
                                                               "tiktoken_pattern: x"),
     ["datasets.a.text:", "tiktoken_pattern applies"]),
    # image-folder and its transforms
    ("image size and transforms", IMG % "size: 8, transforms: [{center_crop: {size: 4}}]",
     ["datasets.a.image-folder:", "not both"]),
    ("image size zero", IMG % "size: [0, 4]", ["datasets.a.image-folder.size:", ">= 1"]),
    ("image layout bad", IMG % "size: 8, layout: nchw",
     ["datasets.a.image-folder.layout:", "'chw'"]),
    ("transforms empty", IMG % "transforms: []",
     ["datasets.a.image-folder.transforms:", "same size"]),
    ("transform unknown", TRANSFORM % "{blur: {}}",
     ["datasets.a.image-folder.transforms.0:", "one-key mapping"]),
    ("transform a bare name", TRANSFORM % "resize",
     ["datasets.a.image-folder.transforms.0:", "one-key mapping"]),
    ("transform two keys", TRANSFORM % "{resize: {size: 4}, center_crop: {size: 4}}",
     ["datasets.a.image-folder.transforms.0:", "one-key mapping"]),
    ("transform unknown argument", TRANSFORM % "{center_crop: {size: 4, x: 1}}",
     ["datasets.a.image-folder.transforms.0.center_crop.x: Extra inputs"]),
    ("transform missing argument", TRANSFORM % "{center_crop: {}}",
     ["datasets.a.image-folder.transforms.0.center_crop.size: Field required"]),
    ("resize size zero", TRANSFORM % "{resize: {size: [0, 3]}}",
     ["datasets.a.image-folder.transforms.0.resize", "size:", ">= 1"]),
    ("resize short not an int", TRANSFORM % "{resize: {short: [3, 4]}}",
     ["datasets.a.image-folder.transforms.0.resize", "short: the shorter side"]),
    ("resize short and size", TRANSFORM % "{resize: {short: 3, size: 3}}",
     ["datasets.a.image-folder.transforms.0.resize", "either size or short"]),
    ("flip probability", TRANSFORM % "{center_crop: {size: 4}}, {horizontal_flip: {p: 2}}",
     ["datasets.a.image-folder.transforms.1.horizontal_flip", "p:", "less than or equal"]),
    ("crop scale above one", TRANSFORM % "{random_resized_crop: {size: 4, scale: [0.5, 2]}}",
     ["datasets.a.image-folder.transforms.0.random_resized_crop", "scale:", "at most 1"]),
    ("crop ratio reversed", TRANSFORM % "{random_resized_crop: {size: 4, ratio: [2, 1]}}",
     ["datasets.a.image-folder.transforms.0.random_resized_crop", "ratio:", "low <= high"]),
    ("normalize std zero", TRANSFORM % "{center_crop: {size: 4}}, {normalize: {std: [0, 1, 1]}}",
     ["datasets.a.image-folder.transforms.1.normalize", "std:", "> 0"]),
    ("normalize dtype", TRANSFORM % "{center_crop: {size: 4}}, {normalize: {dtype: int8}}",
     ["datasets.a.image-folder.transforms.1.normalize", "dtype:", "'float16'"]),
    ("normalize not last", TRANSFORM % "{normalize: {}}, {center_crop: {size: 4}}",
     ["datasets.a.image-folder.transforms:", "normalize must be the last"]),
    ("no fixed output size", TRANSFORM % "{resize: {size: 8}}",
     ["datasets.a.image-folder.transforms:", "same size"]),
]
# Through the real command for a few of each kind; the rest in-process (same loader, fast).
CLI_CASES = {"not UTF-8", "server a list", "transform a bare name", "top level a scalar"}


@pytest.mark.parametrize(("case", "text", "expected"), BAD_CONFIGS,
                         ids=[c[0].replace(" ", "-") for c in BAD_CONFIGS])
def test_every_kind_of_bad_config(tmp_path: Path, ledger, case: str, text: str | bytes,
                                  expected: list[str]) -> None:
    from stoker.server._config import ConfigError, load_config

    (tmp_path / "src").mkdir()
    config = tmp_path / "bad.yaml"
    if isinstance(text, bytes):
        config.write_bytes(text)
    else:
        config.write_text(text)
    if case in CLI_CASES:
        result = serve(config)
        assert result.returncode == 2, result.stderr
        assert result.stdout == "" and "Traceback" not in result.stderr
        message = result.stderr
    else:
        with pytest.raises(ConfigError) as info:
            load_config(config)
        message = str(info.value)
    assert message.startswith(f"config error in {config}:"), message
    for part in expected:
        assert part in message, message
    if ":" in expected[0] and not expected[0].startswith(("not ", "expected ")):
        # the field path starts a line of its own
        assert f"\n  {expected[0].split(':')[0]}" in message or expected[0].startswith(
            "datasets.a.image-folder.transforms.0."), message
    ledger.record("config", case, tried=1,
                  detail=("exit code 2: " if case in CLI_CASES else "ConfigError: ")
                  + expected[0])


# -- local paths: relative to the config file, whatever field holds them ----------------------
def test_a_path_field_of_any_model_is_relative_to_the_config_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new path field needs only the path type: no resolver names it."""
    from pydantic import BaseModel

    from stoker.server.formats.config_base import ConfigPath

    class Keys(BaseModel):
        key: ConfigPath
        extra: list[ConfigPath] = []

    class Settings(BaseModel):
        keys: Keys | None = None

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    raw = {"keys": {"key": "keys/a.pem", "extra": ["/etc/b.pem", "~/c.pem", "../d.pem"]}}
    got = Settings.model_validate(raw, context={"base": tmp_path / "conf"})
    assert got.keys is not None
    assert got.keys.key == tmp_path / "conf" / "keys" / "a.pem"
    assert got.keys.extra == [Path("/etc/b.pem"), tmp_path / "home" / "c.pem",
                              tmp_path / "conf" / ".." / "d.pem"]
    # built in code, with no config file to be relative to: taken as given
    assert Settings.model_validate(raw).keys == Keys(key=Path("keys/a.pem"), extra=[
        Path("/etc/b.pem"), Path("~/c.pem"), Path("../d.pem")])


def test_every_path_in_a_config_file_is_relative_to_its_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from stoker.server._config import load_config
    from stoker.server.formats.text_config import TextDataset

    conf, home = tmp_path / "conf", tmp_path / "home"
    for folder in (conf / "data", conf / "keys", home / "shards"):
        folder.mkdir(parents=True)
    for name in ("tok.json", "keys/cert.pem", "keys/key.pem", "keys/ca.pem", "keys/token"):
        (conf / name).write_text("x")
    config = conf / "c.yaml"
    config.write_text(
        "server:\n  auth_token_file: keys/token\n"
        "  tls: {cert_file: keys/cert.pem, key_file: ./keys/key.pem, client_ca_file: keys/ca.pem}\n"
        "cache: {dir: cache}\n"
        "datasets:\n"
        "  text: {format: text, source: 'data/*.jsonl', seq_len: 8, tokenizer: tok.json}\n"
        "  home: {format: tokens, source: ~/shards, seq_len: 8}\n"
        "  remote: {format: tar, source: 's3://bucket/p/*.tar', fields: {x: {ext: cls, "
        "decode: int}}}\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)  # not the config's folder
    cfg = load_config("conf/c.yaml")
    assert cfg.server.auth_token_file == conf / "keys" / "token"
    assert cfg.server.tls is not None
    assert (cfg.server.tls.cert_file, cfg.server.tls.key_file, cfg.server.tls.client_ca_file) \
        == (conf / "keys" / "cert.pem", conf / "keys" / "key.pem", conf / "keys" / "ca.pem")
    assert cfg.cache.dir == conf / "cache"
    text = cfg.datasets["text"]
    assert isinstance(text, TextDataset)
    assert (text.source, text.tokenizer) == (f"{conf}/data/*.jsonl", str(conf / "tok.json"))
    assert cfg.datasets["home"].source == str(home / "shards")
    assert cfg.datasets["remote"].source == "s3://bucket/p/*.tar"


def test_every_path_field_of_the_config_is_relative_to_the_config_file() -> None:
    """A field typed `Path` without the path type would be read from the working directory."""
    import typing

    from pydantic import BaseModel

    from stoker.server._config import Config
    from stoker.server.formats.config_base import RelativeToConfig

    def unmarked(annotation: object, metadata: list[object]) -> list[str]:
        if typing.get_origin(annotation) is typing.Annotated:
            inner, *more = typing.get_args(annotation)
            return unmarked(inner, [*metadata, *more])
        if annotation is Path:
            return [] if any(m is RelativeToConfig for m in metadata) else ["Path"]
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            return [f"{annotation.__name__}.{name}: {problem}"
                    for name, field in annotation.model_fields.items()
                    for problem in unmarked(field.annotation, field.metadata)]
        return [p for arg in typing.get_args(annotation) for p in unmarked(arg, [])]

    assert unmarked(Config, []) == []
