"""The benchmark suite's one declaration per scenario (benchmarks/scenarios.py) holds: every
scenario's script and renderers exist, every script of benchmarks/ with a `__main__` is a
scenario's (or a peer a scenario runs), the READMEs' scenario lists are made from it,
`--stale` tells a result of older code from a current one (and exits 0 when it lists), and
each `--transport` label of benchmarks/_data.py measures exactly the path it names."""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from stoker.client import RemoteLoader

from conftest import TESTS

ROOT = TESTS.parent
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))
import scenarios  # noqa: E402  (benchmarks/ is a folder of scripts)
from _data import RAN_AS, TRANSPORTS  # noqa: E402
from _stale import stale_lines  # noqa: E402

pytestmark = pytest.mark.timeout(120)
# Scripts with a __main__ that no scenario runs, and why they may.
NOT_SCENARIOS = {
    "__main__.py": "the suite itself",
    "tfdata_peer.py": "the tf.data peer, run by tfdata_service.py in .venv-tf",
    "loader_vs_dataloader.py": "the first pipeline measure, pipeline.py's timing library; "
                               "its own smoke test (tests/test_benchmark_smoke.py)",
}


def test_every_scenario_names_a_script_and_renderers_that_exist() -> None:
    pytest.importorskip("matplotlib")
    names = [s.name for s in scenarios.SCENARIOS]
    titles = [t for s in scenarios.SCENARIOS for t, _ in s.sections]
    assert len(set(names)) == len(names) and len(set(titles)) == len(titles)
    for s in scenarios.SCENARIOS:
        assert (BENCH / s.script).is_file(), s.name
        assert s.readme and "|" not in s.readme, s.name
        for _, ref in s.sections:
            module, _, function = ref.partition(":")
            assert callable(getattr(importlib.import_module(module), function)), ref
        for path in s.paths():
            assert (ROOT / path).exists(), (s.name, path)


def test_every_script_with_a_main_is_in_the_suite() -> None:
    run = {s.script for s in scenarios.SCENARIOS}
    mains = {p.name for p in BENCH.glob("*.py")
             if any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)
                    for n in ast.parse(p.read_text()).body)}
    assert mains - run - set(NOT_SCENARIOS) == set()


def test_the_readme_lists_are_made_from_the_scenarios() -> None:
    for readme in scenarios.READMES:
        assert readme.read_text() == scenarios.readme_with_list(readme), \
            f"{readme.name}: run python -m benchmarks --readme"
    listed = scenarios.READMES[0].read_text()
    for s in scenarios.SCENARIOS:
        assert f"| `{s.name}` | {s.script} |" in listed


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_stale_lists_results_older_than_the_code_they_exercise(tmp_path: Path) -> None:
    head = _git("rev-parse", "HEAD")
    # The commit before the last one that changed server/: a result measured there is stale.
    older = _git("rev-parse", _git("log", "-1", "--format=%H", "--", "server") + "~1")
    results = tmp_path / "results"
    results.mkdir()
    for s in scenarios.SCENARIOS:
        (results / f"{s.name}.json").write_text(json.dumps(
            {"provenance": {"commit": head, "commit_date": "", "uncommitted": []}}))
    (results / "scale.json").write_text(json.dumps(
        {"provenance": {"commit": older, "commit_date": "", "uncommitted": []}}))
    (results / "stall.json").write_text(json.dumps({"started": "2026-11-23T17:18:58"}))
    (results / "memory.json").write_text(json.dumps(
        {"provenance": {"commit": head, "commit_date": "",
                        "uncommitted": ["server/front/handshake.py", "docs/design.md"]}}))
    (results / "chat.json").write_text(json.dumps(
        {"provenance": {"commit": head, "commit_date": "", "uncommitted": ["docs/x.md"]}}))
    lines = stale_lines(results)
    assert [line.split(" ")[0] for line in lines] == ["stall", "memory", "scale"]
    assert "no commit recorded" in lines[0] and "server/front/handshake.py" in lines[1]
    assert "later commit(s) changed what it exercises" in lines[2]
    done = subprocess.run([sys.executable, "-m", "benchmarks", "--stale", "--results",
                           str(results)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.splitlines() == lines, done.stderr


def test_a_scenario_that_needs_cuda_is_marked_where_there_is_none(tmp_path: Path) -> None:
    import _stale

    if _stale.cuda_here():
        pytest.skip("this machine has a CUDA device")
    assert [s.name for s in scenarios.SCENARIOS if s.needs_cuda] == ["gpu"]
    (gpu,) = [line for line in stale_lines(tmp_path) if line.startswith("gpu ")]
    assert gpu.endswith("[needs a CUDA device, which this machine does not have]")
    # Measured on today's code without CUDA: the CPU stand-in is current, the GPU part is not.
    (tmp_path / "gpu.json").write_text(json.dumps(
        {"skipped": "no CUDA device", "provenance": {"commit": _git("rev-parse", "HEAD"),
                                                     "commit_date": "", "uncommitted": []}}))
    (gpu,) = [line for line in stale_lines(tmp_path) if line.startswith("gpu ")]
    assert "without its GPU part (no CUDA device)" in gpu and gpu.endswith(
        "[needs a CUDA device, which this machine does not have]")


@pytest.mark.parametrize("label", sorted(TRANSPORTS))
def test_each_transport_label_measures_the_path_it_names(toy_server, label: str) -> None:
    """On one host (where a data connection wins over shared memory), each label's loader
    arguments make exactly its path carry the batches."""
    with RemoteLoader(toy_server.address, "toy", batch_size=8, output="numpy", shuffle=False,
                      timeout=30, **TRANSPORTS[label]) as loader:
        assert sum(1 for _ in loader) > 0
        assert loader.stats()["transport"] == RAN_AS[label]
