"""The map of the code holds: no import circle at run time, nor one only type checkers see;
every module imports only what its layer may (tools/where.py's LAYERS), no private module of
the other package, modules and classes of a size one can read (a class counted without its
docstrings), and docs/modules.md (the module map) made from the code."""

from __future__ import annotations

import ast
import sys

import pytest

from conftest import TESTS

ROOT = TESTS.parent

sys.path.insert(0, str(ROOT / "tools"))
import where  # noqa: E402  (tools/ is not a package)

MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 300


def test_no_import_circle_at_run_time() -> None:
    assert where.circles(where.read()) == []


def test_every_module_imports_only_what_its_layer_may() -> None:
    assert where.violations(where.read()) == []


def test_the_rules_catch_an_import_that_points_back_up() -> None:
    modules = where.read()
    sampling = modules["stoker.server.order.sampling"]
    sampling.runtime.add("stoker.server.front.service")  # pure math reaching the front end
    assert any("order.sampling imports stoker.server.front.service" in v
               for v in where.violations(modules))
    modules["stoker.server.front.service"].runtime.add("stoker.server.order.sampling")
    assert ["stoker.server.front.service", "stoker.server.order.sampling"] in [
        [m for m in group if m in ("stoker.server.front.service",
                                   "stoker.server.order.sampling")]
        for group in where.circles(modules)]
    client = modules["stoker.client._loader"]
    client.runtime.add("stoker.server.pool.shm")
    assert any("client._loader imports stoker.server.pool.shm" in v
               for v in where.violations(modules))


def test_modules_and_classes_stay_readable() -> None:
    too_big = []
    for name, path in where.all_modules().items():
        source = path.read_text()
        if (n := len(source.splitlines())) > MAX_MODULE_LINES:
            too_big.append(f"{name}: {n} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                if (n := _code_lines(node)) > MAX_CLASS_LINES:
                    too_big.append(f"{name}.{node.name}: {n} lines")
    assert too_big == []


def _code_lines(cls: ast.ClassDef) -> int:
    """A class's lines but its docstrings' (its own and its methods'): the API docstrings
    tests/test_docstrings.py asks for (Args, Returns, examples) are not what makes a class too
    big to read."""
    docs = 0
    for node in ast.walk(cls):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                and ast.get_docstring(node) is not None:
            doc = node.body[0]
            docs += doc.end_lineno - doc.lineno + 1
    return cls.end_lineno - cls.lineno + 1 - docs


def test_the_module_page_is_made_from_the_code() -> None:
    assert where.current_page()[1] == where.section(where.read()), \
        "run: python tools/where.py --write"


def test_the_client_rooms_catch_an_import_that_points_back_up() -> None:
    modules = where.read()
    # position/ holds plain values: reaching the scheduler would make them hold its lock
    modules["stoker.client.position.resume"].runtime.add("stoker.client.fleet.scheduler")
    # transport/ runs on receive threads: it must not drive the fleet that drives it
    modules["stoker.client.transport.stream"].runtime.add("stoker.client.fleet.servers")
    # fleet/ must not reach the loader on top of it
    modules["stoker.client.fleet.window"].runtime.add("stoker.client._options")
    found = where.violations(modules)
    for here, there in (("position.resume", "fleet.scheduler"),
                        ("transport.stream", "fleet.servers"),
                        ("fleet.window", "client._options")):
        assert any(f"client.{here} imports stoker.client.{there}" in v or
                   f"client.{here} imports stoker.{there}" in v for v in found), (here, found)


def test_no_import_circle_even_for_type_checkers(capsys: pytest.CaptureFixture[str]) -> None:
    """Two modules that import each other, if only under `if TYPE_CHECKING:`, cannot be
    understood apart: each shared declaration lives with its owner (issue 51)."""
    assert where.circles(where.read(), types=True) == []
    assert where.main(["--circles"]) == 0
    assert capsys.readouterr().out.startswith(
        "import circles in server/, client/, integrations/ and protos/: 0 at run time, "
        "0 type-only")


def test_type_only_circles_are_found_and_the_client_has_none() -> None:
    modules = where.read()
    assert [c for c in where.circles(modules, types=True)
            if c[0].startswith("stoker.client")] == []
    modules["stoker.client.fleet.rates"].types.add("stoker.client.fleet.servers")
    assert ["stoker.client.fleet.rates", "stoker.client.fleet.servers"] in where.circles(
        modules, types=True)
    assert ["stoker.client.fleet.rates", "stoker.client.fleet.servers"] not in where.circles(
        modules)
    lines, count = where.circle_report(modules)
    assert count == 1 and lines[1:] == [
        "  type-only: stoker.client.fleet.rates <-> stoker.client.fleet.servers"]


def test_every_package_folder_is_installed() -> None:
    """A folder with an __init__.py that pyproject's packages leaves out is missing from a
    wheel (an editable install still finds it, so only a fresh install would fail)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = {name for name, path in where.all_modules().items() if path.name == "__init__.py"}
    assert found - listed == set()


def test_a_batchs_path_touches_no_private_name_of_another_class() -> None:
    path, touches = where.batch_path()
    assert touches == []
    # The path reaches the batch's every step: iteration, receive, buffers, conversion.
    for step in ("_epoch_pass:EpochPass._batches", "fleet.scheduler:Scheduler.take",
                 "transport.frames:Assembler.receive", "delivery.buffers:HostBuffers.acquire",
                 "_on_demand:OnDemand.convert", "_on_demand:OnDemand.handed",
                 "fleet.scheduler:Scheduler._on_batch"):
        assert f"stoker.client.{step}" in path


def test_the_batch_path_check_catches_a_private_name_of_another_class() -> None:
    # exclude() is not on the path, and reaches into its loader's scheduler: as a root, said.
    _, touches = where.batch_path((*where.BATCH_ROOTS, "stoker.client._on_demand:OnDemand.exclude"))
    assert "stoker.client._on_demand:OnDemand.exclude: self._loader._kept" in touches
    _, touches = where.batch_path(("stoker.client._loader:RemoteLoader.gone",))
    assert touches == ["stoker.client._loader:RemoteLoader.gone: no such function"]
