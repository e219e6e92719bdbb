"""Every public name of `stoker.client` and every config model documents itself in Google
style: a class has an Args or Attributes section (a config model, Attributes naming each of
its own fields), a public method or function with arguments has Args naming each, one that
returns something has Returns (or Yields). A new public name without them fails here."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from collections.abc import Iterator
from typing import Any

import pydantic

import stoker.client
import stoker.server.formats

SECTION = re.compile(r"^(\w+(?: \w+)?):\s*$")
ENTRY = re.compile(r"^    (\*{0,2}\w+)(?: \([^)]*\))?:")


def sections(doc: str | None) -> dict[str, list[str]]:
    """A docstring's Google-style sections (`Args:`, `Returns:` ...) and the names their
    entries start with (the lines indented one level under the heading)."""
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in inspect.cleandoc(doc or "").splitlines():
        if (m := SECTION.match(line)) is not None:
            current = found.setdefault(m.group(1), [])
        elif line and not line.startswith(" "):
            current = None
        elif current is not None and (m := ENTRY.match(line)) is not None:
            current.append(m.group(1))
    return found


def _parameters(fn: Any) -> list[str]:
    names = []
    for p in inspect.signature(fn).parameters.values():
        if p.name in ("self", "cls"):
            continue
        names.append({p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name)
    return names


def function_problems(name: str, fn: Any) -> Iterator[str]:
    """What `fn`'s docstring lacks: Args naming each argument, Returns where it returns."""
    doc = inspect.getdoc(fn)
    if not doc:
        yield f"{name}: no docstring"
        return
    found = sections(doc)
    wanted = _parameters(fn)
    if wanted:
        if "Args" not in found:
            yield f"{name}: no Args section"
        elif sorted(found["Args"]) != sorted(wanted):
            yield f"{name}: Args name {found['Args']}, the signature {wanted}"
    returns = inspect.signature(fn).return_annotation
    if returns not in ("None", None, inspect.Signature.empty) and not (
            "Returns" in found or "Yields" in found):
        yield f"{name}: returns {returns} but has no Returns section"


def class_problems(name: str, cls: type) -> Iterator[str]:
    """What a public class's docstrings lack: the class an Args or Attributes section (Args
    naming each argument of its own __init__), each public method as function_problems."""
    found = sections(cls.__doc__)
    if "Args" not in found and "Attributes" not in found:
        yield f"{name}: no Args or Attributes section"
    if "__init__" in vars(cls) and (wanted := _parameters(cls)):
        if sorted(found.get("Args", [])) != sorted(wanted):
            yield f"{name}: Args name {found.get('Args', [])}, the signature {wanted}"
    for attr, value in vars(cls).items():
        if attr.startswith("_"):
            continue
        if isinstance(value, property):
            if not inspect.getdoc(value):
                yield f"{name}.{attr}: no docstring"
        elif isinstance(value, (classmethod, staticmethod)):
            yield from function_problems(f"{name}.{attr}", getattr(cls, attr))
        elif inspect.isfunction(value):
            yield from function_problems(f"{name}.{attr}", value)


def model_problems(name: str, model: type[pydantic.BaseModel]) -> Iterator[str]:
    """A config model's Attributes section names each field it declares, and only fields."""
    found = sections(model.__doc__)
    if "Attributes" not in found:
        yield f"{name}: no Attributes section"
        return
    own = [f for f in vars(model).get("__annotations__", {}) if f in model.model_fields]
    if missing := [f for f in own if f not in found["Attributes"]]:
        yield f"{name}: Attributes does not name {missing}"
    if unknown := [f for f in found["Attributes"] if f not in model.model_fields]:
        yield f"{name}: Attributes names {unknown}, which are not its fields"


def config_models() -> dict[str, type[pydantic.BaseModel]]:
    """Every model of server/_config.py and server/formats/*_config.py (config_base too)."""
    names = ["stoker.server._config"] + [
        f"stoker.server.formats.{m.name}" for m in pkgutil.iter_modules(
            stoker.server.formats.__path__) if m.name.endswith(("_config", "config_base"))]
    models = {}
    for module_name in names:
        module = importlib.import_module(module_name)
        for attr, value in vars(module).items():
            if inspect.isclass(value) and issubclass(value, pydantic.BaseModel) \
                    and value.__module__ == module_name and not attr.startswith("_"):
                models[f"{module_name}.{attr}"] = value
    return models


def public_problems(module: Any) -> list[str]:
    problems = []
    for name in module.__all__:
        value = getattr(module, name)
        if inspect.isclass(value):
            problems += class_problems(name, value)
        else:
            problems += function_problems(name, value)
    return problems


def test_every_public_name_of_the_client_is_documented() -> None:
    assert public_problems(stoker.client) == []


def test_every_config_model_names_its_fields() -> None:
    models = config_models()
    assert len(models) > 40  # every format's, found
    assert [p for name, model in models.items() for p in model_problems(name, model)] == []


def test_a_new_undocumented_name_fails() -> None:
    class Bare:
        """One line."""

        def fetch(self, index: int) -> bytes:
            """Also one line."""
            return b""

    class Field(pydantic.BaseModel):
        """A model.

        Attributes:
            size: documented.
        """

        size: int = 0
        extra: int = 0

    module = type("module", (), {"__all__": ["Bare"], "Bare": Bare})
    assert public_problems(module) == [
        "Bare: no Args or Attributes section", "Bare.fetch: no Args section",
        "Bare.fetch: returns bytes but has no Returns section"]
    assert list(model_problems("Field", Field)) == ["Field: Attributes does not name ['extra']"]


def test_the_sections_read_as_google_style() -> None:
    doc = """Summary.

    Args:
        address: where.
        *args (str): the rest,
            wrapped.

    Returns:
        What.
    """
    assert sections(doc) == {"Args": ["address", "*args"], "Returns": []}
