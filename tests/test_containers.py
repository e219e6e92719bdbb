"""The Dockerfiles and docker-compose.yml agree with the repository, checked without an engine.

Nothing here builds or runs a container: the files are parsed and cross-checked against
pyproject.toml, the server's config loader and each other (paths, ports, extras, users).
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from packaging.specifiers import SpecifierSet  # a pytest dependency

from stoker.server import load_config

from s3_endpoint import moto_endpoint_fixture, s3_client, s3_env  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "docker-compose.yml"
SERVER_DOCKERFILE = REPO / "docker" / "Dockerfile.server"
TRAINER_DOCKERFILE = REPO / "docker" / "Dockerfile.trainer"
DOCKERFILES = [SERVER_DOCKERFILE, TRAINER_DOCKERFILE]


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case
    args: str  # the rest of the (joined) line


def parse_dockerfile(path: Path) -> list[Instruction]:
    """Instructions with continuation lines joined and comment lines dropped (as Docker does)."""
    instructions: list[Instruction] = []
    pending = ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#"):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        if full:
            keyword, _, args = full.partition(" ")
            instructions.append(Instruction(keyword.upper(), args.strip()))
    assert not pending, f"{path}: the last instruction ends with a line continuation"
    return instructions


def instructions(path: Path, keyword: str) -> list[Instruction]:
    return [i for i in parse_dockerfile(path) if i.keyword == keyword]


def exec_form(args: str) -> list[str]:
    """ENTRYPOINT/CMD in exec (JSON) form; shell form would wrap the server in /bin/sh -c, and
    SIGTERM would reach the shell instead of the server."""
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def only(path: Path, keyword: str) -> Instruction:
    found = instructions(path, keyword)
    assert len(found) == 1, f"{path.name}: expected one {keyword}, found {len(found)}"
    return found[0]


def copy_sources(instruction: Instruction) -> list[str]:
    """The build-context paths a COPY reads (empty for COPY --from=another stage)."""
    args = (exec_form(instruction.args) if instruction.args.startswith("[")
            else shlex.split(instruction.args))
    flags = [a for a in args if a.startswith("--")]
    if any(f.startswith("--from=") for f in flags):
        return []
    paths = [a for a in args if not a.startswith("--")]
    assert len(paths) >= 2, f"COPY needs a source and a destination: {instruction.args}"
    return paths[:-1]


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """One .dockerignore pattern (Go filepath.Match plus `**`) as a regex over a posix path."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def dockerignored(rel_path: str) -> bool:
    """Whether .dockerignore keeps `rel_path` out of the build context (a pattern matching a
    folder excludes what is inside; the last matching pattern wins, `!` re-includes)."""
    ignore = REPO / ".dockerignore"
    if not ignore.is_file():
        return False
    rules = [line.strip() for line in ignore.read_text().splitlines()]
    rules = [r for r in rules if r and not r.startswith("#")]
    parts = Path(rel_path).parts
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for rule in rules:
        negate = rule.startswith("!")
        regex = _pattern_regex(rule.lstrip("!").strip("/"))
        if any(regex.match(p) for p in prefixes):
            excluded = not negate
    return excluded


@cache
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def service(name: str) -> dict[str, Any]:
    services = compose()["services"]
    assert name in services, f"docker-compose.yml has no `{name}` service"
    return services[name]


def dockerfile_of(name: str) -> Path:
    build = service(name)["build"]
    return (REPO / build["context"] / build.get("dockerfile", "Dockerfile")).resolve()


@cache
def pyproject() -> dict[str, Any]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


@cache
def server_config_text() -> str:
    return (REPO / "docker" / "config.yaml").read_text()


def server_config_host_path() -> Path:
    """The host file the server service mounts at the path the image's CMD reads."""
    cmd = exec_form(only(SERVER_DOCKERFILE, "CMD").args)
    target = cmd[cmd.index("--config") + 1]
    for volume in service("server")["volumes"]:
        source, container, *_ = volume.split(":")
        if container == target:
            return (REPO / source).resolve()
    raise AssertionError(f"the server service mounts nothing at {target}, where CMD reads it")


def test_compose_names_its_services() -> None:
    assert {"minio", "data", "upload", "server", "trainer"} <= set(compose()["services"])


def test_build_contexts_and_dockerfiles_exist() -> None:
    built = [(n, s["build"]) for n, s in compose()["services"].items() if "build" in s]
    assert built, "no service builds an image"
    for name, build in built:
        context = REPO / build["context"]
        assert context.is_dir(), f"{name}: build.context {build['context']} is not a folder"
        dockerfile = context / build.get("dockerfile", "Dockerfile")
        assert dockerfile.is_file(), f"{name}: {dockerfile} does not exist"
    assert dockerfile_of("server") == dockerfile_of("data") == dockerfile_of("upload") == (
        SERVER_DOCKERFILE)
    assert dockerfile_of("trainer") == TRAINER_DOCKERFILE


def test_services_sharing_an_image_tag_build_it_from_the_same_dockerfile() -> None:
    by_tag: dict[str, set[Path]] = {}
    for name, svc in compose()["services"].items():
        if "image" in svc and "build" in svc:
            by_tag.setdefault(svc["image"], set()).add(dockerfile_of(name))
    for tag, files in by_tag.items():
        assert len(files) == 1, f"{tag} is built from more than one Dockerfile: {files}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_copied_path_exists_and_is_in_the_build_context(dockerfile: Path) -> None:
    copies = instructions(dockerfile, "COPY") + instructions(dockerfile, "ADD")
    assert copies, f"{dockerfile.name} copies nothing"
    for instruction in copies:
        for source in copy_sources(instruction):
            assert (REPO / source).exists(), f"{dockerfile.name}: COPY {source}: not in the repo"
            assert not dockerignored(source), \
                f"{dockerfile.name}: COPY {source}: excluded by .dockerignore"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_package_folder_is_copied_for_the_build(dockerfile: Path) -> None:
    """setuptools fails when a folder named in package-dir is missing from the build."""
    folders = pyproject()["tool"]["setuptools"]["package-dir"].values()
    copied = {s.strip("/") for i in instructions(dockerfile, "COPY") for s in copy_sources(i)}
    assert "pyproject.toml" in copied
    for folder in folders:
        assert folder.strip("/") in copied, f"{dockerfile.name} does not COPY {folder}/"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_base_image_is_python_311_slim_and_fits_requires_python(dockerfile: Path) -> None:
    base = only(dockerfile, "FROM").args
    assert base == "python:3.11-slim"
    requires = SpecifierSet(pyproject()["project"]["requires-python"])
    assert requires.contains("3.11"), f"the image's Python 3.11 does not satisfy {requires}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_runs_as_an_unprivileged_user(dockerfile: Path) -> None:
    steps = parse_dockerfile(dockerfile)
    users = [n for n, i in enumerate(steps) if i.keyword == "USER"]
    assert users, f"{dockerfile.name} has no USER: it would run as root"
    user = steps[users[-1]].args.split(":")[0]
    assert user not in ("root", "0")
    runs_after = [i.args for i in steps[users[-1]:] if i.keyword == "RUN"]
    assert not runs_after, f"{dockerfile.name}: RUN after USER (would run unprivileged)"
    created = " ".join(i.args for i in steps if i.keyword == "RUN")
    assert re.search(rf"useradd\b[^&]*\b{re.escape(user)}\b", created), \
        f"{dockerfile.name}: user {user} is never created"


def test_volume_mounted_host_paths_and_named_volumes_exist() -> None:
    declared = set(compose().get("volumes") or {})
    for name, svc in compose()["services"].items():
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith((".", "/")):
                assert (REPO / source).exists(), f"{name}: mounts {source}, which does not exist"
            else:
                assert source in declared, f"{name}: named volume {source} is not declared"


def test_server_config_validates_with_the_servers_loader(tmp_path: Path) -> None:
    """The mounted config passes `load_config` as it is (its data is in the object store)."""
    config_path = server_config_host_path()
    assert config_path == REPO / "docker" / "config.yaml"
    config = load_config(config_path, host="0.0.0.0")
    assert list(config.datasets) == ["shapes"]
    shapes = config.datasets["shapes"]
    assert (shapes.format, shapes.size, shapes.layout) == ("image-folder", (32, 32), "chw")


def test_data_reaches_the_server_through_the_object_store() -> None:
    """data writes the dataset into a volume; upload sends that folder to the bucket and
    prefix the server's config reads, at the store the config names, with the store's
    credentials; each step waits for the one before."""
    config = yaml.safe_load(server_config_text())
    source = config["datasets"]["shapes"]["source"]
    endpoint = config["s3"]["endpoint_url"]
    data, upload, minio = service("data"), service("upload"), service("minio")
    assert data["entrypoint"] == ["python", "examples/shapes.py"]
    folder = data["command"][0]
    assert upload["entrypoint"] == ["python", "docker/upload.py"]
    assert upload["command"] == [folder, source, "--endpoint", endpoint]
    copied = {s for i in instructions(SERVER_DOCKERFILE, "COPY") for s in copy_sources(i)}
    assert {"examples/shapes.py", "docker/upload.py"} <= copied

    def mount(name: str) -> tuple[str, str, list[str]]:
        for volume in service(name)["volumes"]:
            src, target, *mode = volume.split(":")
            if Path(folder).is_relative_to(target):
                return src, target, mode
        raise AssertionError(f"{name} mounts nothing that holds {folder}")

    assert mount("data")[0] == mount("upload")[0] and mount("upload")[2] == ["ro"]
    assert urlsplit(endpoint).hostname == "minio" and urlsplit(endpoint).port == 9000
    env = minio["environment"]
    for name in ("upload", "server"):
        creds = service(name)["environment"]
        assert creds["AWS_ACCESS_KEY_ID"] == env["MINIO_ROOT_USER"]
        assert creds["AWS_SECRET_ACCESS_KEY"] == env["MINIO_ROOT_PASSWORD"]
    assert upload["depends_on"] == {"data": {"condition": "service_completed_successfully"},
                                    "minio": {"condition": "service_healthy"}}
    assert service("server")["depends_on"]["upload"]["condition"] == (
        "service_completed_successfully")
    assert "healthcheck" in minio


def test_ports_agree_across_config_expose_cmd_healthcheck_and_compose() -> None:
    settings = yaml.safe_load(server_config_text())["server"]
    grpc_port, http_port = settings["port"], settings["http_port"]
    exposed = {int(p.split("/")[0]) for e in instructions(SERVER_DOCKERFILE, "EXPOSE")
               for p in e.args.split()}
    assert exposed == {grpc_port, http_port}

    cmd = exec_form(only(SERVER_DOCKERFILE, "CMD").args)
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0", "a container must listen beyond loopback"
    for flag, port in (("--port", grpc_port), ("--http-port", http_port)):
        if flag in cmd:
            assert int(cmd[cmd.index(flag) + 1]) == port

    health = only(SERVER_DOCKERFILE, "HEALTHCHECK").args
    probe = exec_form(health[health.index("CMD") + 3:].strip())
    found = re.search(r"http://[^'\"]+", " ".join(probe))
    assert found, f"the HEALTHCHECK probes no http:// URL: {probe}"
    url = urlsplit(found.group(0))
    assert (url.port, url.path) == (http_port, "/healthz")
    assert probe[0] == "python" and "urllib" in probe[-1]

    for mapping in service("server").get("ports", []):
        container = int(str(mapping).split(":")[-1].split("/")[0])
        assert container in exposed
        assert ":" not in str(mapping), \
            f"server port {mapping} pins a host port: `--scale server=N` would collide on it"

    command = service("trainer")["command"]
    target = command[command.index("--address") + 1]
    # dns:/// so that one trainer uses every replica `--scale server=N` starts.
    assert target.startswith("dns:///"), target
    host, _, port = target.removeprefix("dns:///").rpartition(":")
    assert host == "server" and int(port) == grpc_port
    assert service("trainer")["depends_on"]["server"]["condition"] == "service_healthy"


def test_server_stops_on_sigterm_and_is_given_time_to_drain() -> None:
    assert only(SERVER_DOCKERFILE, "STOPSIGNAL").args == "SIGTERM"
    grace = yaml.safe_load(server_config_text())["server"].get("grace_seconds", 10)
    stop = service("server").get("stop_grace_period", "10s")
    match = re.fullmatch(r"(\d+)s", stop)
    assert match and int(match.group(1)) > grace, \
        f"stop_grace_period {stop} does not outlast the {grace} s drain"


def test_entrypoint_is_a_declared_console_script() -> None:
    entrypoint = exec_form(only(SERVER_DOCKERFILE, "ENTRYPOINT").args)
    assert entrypoint == ["stoker", "serve"]
    target = pyproject()["project"]["scripts"][entrypoint[0]]
    module, _, func = target.partition(":")
    assert callable(getattr(importlib.import_module(module), func))
    cmd = exec_form(only(SERVER_DOCKERFILE, "CMD").args)
    assert cmd[:2] == ["--config", "/etc/stoker/config.yaml"]


def test_server_image_installs_the_server_video_and_lake_extras_and_not_torch() -> None:
    runs = " ".join(i.args for i in instructions(SERVER_DOCKERFILE, "RUN"))
    assert re.search(r"pip install [^&]*\.\[server,video,lake\]", runs), \
        "the project, [server,video,lake]"
    assert "['optional-dependencies']['server']" in runs, "the dependency layer reads [server]"
    assert "['optional-dependencies']['video']" in runs, "the dependency layer reads [video] (PyAV)"
    assert "['optional-dependencies']['lake']" in runs, "the dependency layer reads [lake]"
    extras = pyproject()["project"]["optional-dependencies"]
    lake = " ".join(extras["lake"])
    assert all(lib in lake for lib in ("pyiceberg", "deltalake", "pylance")), lake
    assert "lake" in " ".join(extras["dev"]), "make test installs the lake extra (dev pulls it)"
    assert not any("torch" in d for d in extras["video"] + extras["lake"])
    assert "torch" not in runs.lower()
    assert not any("torch" in d for d in pyproject()["project"]["optional-dependencies"]["server"])
    assert not any("torch" in d for d in pyproject()["project"]["dependencies"])


def test_trainer_image_installs_torch_the_client_extra_and_the_examples() -> None:
    runs = [i.args for i in instructions(TRAINER_DOCKERFILE, "RUN")]
    torch_step = next(n for n, r in enumerate(runs) if "torch==" in r)
    project_step = next(n for n, r in enumerate(runs) if re.search(r"\.\[client\]", r))
    assert torch_step < project_step, "torch is installed first (largest, most stable layer)"
    assert "['optional-dependencies']['client']" in " ".join(runs)
    copied = {s.strip("/") for i in instructions(TRAINER_DOCKERFILE, "COPY")
              for s in copy_sources(i)}
    assert "examples" in copied
    entrypoint = exec_form(only(TRAINER_DOCKERFILE, "ENTRYPOINT").args)
    assert entrypoint == ["python", "examples/demo.py"]
    assert (REPO / entrypoint[1]).is_file()


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dependencies_are_installed_before_the_sources_are_copied(dockerfile: Path) -> None:
    """Editing a .py file must not invalidate the dependency layers."""
    steps = parse_dockerfile(dockerfile)
    first_source = next(n for n, i in enumerate(steps) if i.keyword == "COPY"
                        and any(s.strip("/") in ("server", "client") for s in copy_sources(i)))
    deps = next(n for n, i in enumerate(steps) if i.keyword == "RUN"
                and "requirements.txt" in i.args)
    pyproject_copy = next(n for n, i in enumerate(steps) if i.keyword == "COPY"
                          and copy_sources(i) == ["pyproject.toml"])
    assert pyproject_copy < deps < first_source


@pytest.mark.parametrize("rel_path", ["data/x.jpg", "tests/test_x.py", ".git/HEAD",
                                      "server/__pycache__/a.pyc", "stoker.egg-info/PKG-INFO"])
def test_dockerignore_keeps_local_and_bulky_paths_out(rel_path: str) -> None:
    assert dockerignored(rel_path)


def test_the_upload_job_fills_a_real_s3_endpoint_once(moto_endpoint, tmp_path: Path) -> None:
    folder = tmp_path / "shapes"
    (folder / "circle").mkdir(parents=True)
    for i in range(3):
        (folder / "circle" / f"{i}.png").write_bytes(bytes([i]) * (10 + i))
    cmd = [sys.executable, str(REPO / "docker" / "upload.py"), str(folder),
           "s3://compose-demo/shapes", "--endpoint", moto_endpoint.url]
    env = {**os.environ, **s3_env(moto_endpoint.url)}
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert first.returncode == 0, first.stderr
    assert "uploaded 3 files, 0 were there already" in first.stdout
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert "uploaded 0 files, 3 were there already" in again.stdout
    keys = [o["Key"] for o in s3_client(moto_endpoint.url).list_objects_v2(
        Bucket="compose-demo")["Contents"]]
    assert sorted(keys) == [f"shapes/circle/{i}.png" for i in range(3)]
