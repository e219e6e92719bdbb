"""The first hour, as the docs tell it (issue 20, items 9 to 11): the quickstart and the security
page run as written (tools/docwalk.py executes their blocks against this checkout), every yaml
config in the docs is one the server accepts, and what a newcomer copies (install lines, the
docker run example, the curl example, the project's pointers) works."""

from __future__ import annotations

import re
import shlex
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import docwalk  # noqa: E402
from docwalk import Kind, Outcome  # noqa: E402

pytestmark = pytest.mark.timeout(120)

PAGES = docwalk.pages()
TEXT_FILES = [*PAGES, REPO / "docker" / "README.md", REPO / "docker" / "Dockerfile.server",
              REPO / "docker" / "Dockerfile.trainer", REPO / "Makefile",
              *sorted((REPO / "examples").glob("*.py"))]


def by_line(results: list[docwalk.Result]) -> dict[int, docwalk.Result]:
    return {r.block.line: r for r in results}


def failures(results: list[docwalk.Result]) -> str:
    return "\n\n".join(f"{r.block.where}: {r.detail}" for r in results
                       if r.outcome is Outcome.FAILED)


def test_the_walker_reports_what_fails(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# t\n\n    echo fine\n    false\n\n```python\nraise SystemExit('no')\n```\n\n"
                    "```yaml\ndatasets:\n  x: {format: python}\n```\n\n"
                    "<!-- docwalk: skip shown only -->\n    echo no && false\n\n"
                    "```python\nprint(undefined_name)\n```\n")
    results = docwalk.walk(page, run=True)
    got = [(r.block.kind, r.outcome) for r in results]
    assert got == [(Kind.BASH, Outcome.FAILED), (Kind.PYTHON, Outcome.FAILED),
                   (Kind.YAML, Outcome.FAILED), (Kind.BASH, Outcome.SKIPPED),
                   (Kind.PYTHON, Outcome.SKIPPED)]
    assert "false\nexit 1" in results[0].detail
    assert "factory" in results[2].detail  # the loader's own complaint
    assert results[4].detail == "sketch: uses undefined_name"


def test_quickstart_runs_as_written_to_a_first_batch_of_your_own_dataset() -> None:
    """Item 9: data made by examples/shapes.py, served, inspected, a first batch, then a
    `format: python` dataset of the reader's own, served and trained from."""
    results = docwalk.walk(REPO / "docs" / "quickstart.md", run=True, fast=True)
    assert failures(results) == ""
    ran = {r.block.line: r for r in results if r.outcome is Outcome.OK}
    texts = [r.block.text for r in ran.values()]
    assert any("examples/shapes.py" in t for t in texts)  # it makes its own data
    assert any("format: python" in t for t in texts)
    assert any("RemoteLoader" in t and "points" in t for t in texts)  # trains on it
    skipped = [r for r in results if r.outcome is Outcome.SKIPPED]
    assert all("slow" in r.detail for r in skipped), [r.detail for r in skipped]
    assert "/data/pets" not in (REPO / "docs" / "quickstart.md").read_text()


def test_readme_fast_blocks_run() -> None:
    results = docwalk.walk(REPO / "README.md", run=True, fast=True)
    assert failures(results) == ""


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_yaml_block_parses_and_every_config_is_accepted(page: Path) -> None:
    """Configs go through the server's loader (files and folders that only exist on a server
    aside); fragments are marked <!-- docwalk: fragment -->, refused examples `refused`."""
    results = [r for r in docwalk.walk(page, run=False) if r.block.kind is Kind.YAML]
    assert failures(results) == ""


def test_security_page_makes_certificates_and_serves_mutual_tls_as_written() -> None:
    """Item 9 and 11: openssl makes the CA, server and client certificates; the mutual-TLS
    server, the client, the CLI and curl (with --cert/--key) work with them."""
    page = REPO / "docs" / "security.md"
    results = docwalk.walk(page, run=True, fast=True)
    assert failures(results) == ""
    ok = [r.block.text for r in results if r.outcome is Outcome.OK]
    assert any("openssl req -x509" in t and "client.crt" in t for t in ok)
    assert any("client_ca_file: ca.crt" in t for t in ok)
    assert any("RemoteLoader" in t and '"cert"' in t for t in ok)


def test_curl_examples_present_a_client_certificate_under_mutual_tls() -> None:
    text = (REPO / "docs" / "security.md").read_text()
    curls = [ln for ln in text.splitlines() if re.search(r"\bcurl .*https://", ln)]
    assert curls
    for line in curls:
        assert {"--cacert", "--cert", "--key"} <= set(shlex.split(line.strip())), line


@pytest.mark.parametrize("path", TEXT_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_nothing_installs_stoker_from_a_package_index(path: Path) -> None:
    """Item 11: `pip install "stoker[client]"` resolves the name on an index, where stoker is not
    (and where anyone may publish it): install from a checkout, or `stoker[...] @ git+URL`."""
    from_index = re.compile(r"pip3? install[^\n#]*?(?<![\w./@-])[\"']?stoker(\[[\w,]+\])?[\"']?"
                            r"(?!\s*@)(?=\s|$)")
    assert from_index.findall(path.read_text()) == []


def test_the_index_check_catches_an_index_install() -> None:
    pattern = re.compile(r"pip3? install[^\n#]*?(?<![\w./@-])[\"']?stoker(\[[\w,]+\])?[\"']?"
                         r"(?!\s*@)(?=\s|$)")
    assert pattern.search('pip install "stoker[client]"')
    assert pattern.search("pip install stoker")
    assert not pattern.search('pip install ".[client]"')
    assert not pattern.search('pip install "stoker[client] @ git+URL"')


def test_the_docker_run_example_serves_local_data_alone() -> None:
    """Item 11: the header's example mounts a config that reads only what it mounts."""
    header = (REPO / "docker" / "Dockerfile.server").read_text().split("\nFROM ")[0]
    run = re.search(r"docker run (.*?)stoker-server\n", header.replace("\\\n#", ""), re.S)
    assert run, header
    args = shlex.split(run.group(1).replace("$PWD", str(REPO)))
    mounts = dict(a.split(":")[:2] for a in (args[i + 1] for i, x in enumerate(args) if x == "-v"))
    config = Path(next(host for host, inside in mounts.items()
                       if inside == "/etc/stoker/config.yaml"))
    data = {inside for inside in mounts.values() if inside != "/etc/stoker/config.yaml"}
    raw = yaml.safe_load(config.read_text())
    assert "s3" not in raw
    for name, ds in raw["datasets"].items():
        assert any(ds["source"].startswith(d + "/") for d in data), name
    assert docwalk.config_problems(config.read_text()) == []
    assert "examples/shapes.py data/" in header  # the host side of /data is made first


def test_tokens_may_name_one_file(tmp_path: Path) -> None:
    """Item 10: the tokens section said the source must not name a file directly; it may."""
    import numpy as np

    from stoker.server import load_config

    np.arange(300, dtype=np.uint16).tofile(tmp_path / "train.bin")
    (tmp_path / "c.yaml").write_text("datasets:\n  t: {format: tokens, source: train.bin, "
                                     "seq_len: 8}\n")
    assert load_config(tmp_path / "c.yaml").datasets["t"].source == str(tmp_path / "train.bin")
    assert "must not name a file" not in (REPO / "docs" / "configuration.md").read_text()


def test_tuning_says_the_data_connection_wins_over_shared_memory_on_one_host() -> None:
    """The rule changed (issue 41): on one host the data connection wins; shared memory is
    the fallback and the path under TLS (the table itself: tests/test_transport_rule.py)."""
    text = (REPO / "docs" / "tuning.md").read_text()
    assert not re.search(r"`compression` and `data_socket` are\s+ignored", text)
    assert re.search(r"data connection too, and it wins over shared\s+memory", text)


def test_deployment_steps_build_the_image_and_create_what_the_manifests_need() -> None:
    """Item 10: the image is built and pushed, the Secrets are made, the trainer's address
    names the namespace the kustomization sets, and the production set is there."""
    text = (REPO / "docs" / "deployment.md").read_text()
    assert "docker build -f docker/Dockerfile.server" in text and "docker push" in text
    for folder in ("deploy/kubernetes", "deploy/kubernetes/production"):
        namespace = yaml.safe_load((REPO / folder / "kustomization.yaml").read_text())["namespace"]
        assert f"kubectl apply -k {folder}\n" in text
        assert f"stoker-server.{namespace}.svc.cluster.local:50051" in text, folder
    assert "create secret tls stoker-tls" in text and "create secret generic stoker-token" in text
    assert "PersistentVolume" in text and "NetworkPolicy" in text
    for path in set(re.findall(r"`(deploy/[\w/.-]+)`", text)):
        assert (REPO / path).exists(), path


def test_pyproject_points_at_files_that_exist() -> None:
    """Item 11: pyproject.toml pointed at a DESIGN.md that is not there."""
    text = (REPO / "pyproject.toml").read_text()
    tomllib.loads(text)
    named = set(re.findall(r"\b((?:[\w-]+/)*[\w-]+\.(?:md|py|yaml|yml))\b", text))
    assert "docs/design.md" in named
    for path in named:
        assert (REPO / path).exists(), path
    assert "## Where things live" in (REPO / "docs" / "design.md").read_text()
