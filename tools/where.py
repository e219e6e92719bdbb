"""The map of the code: docs/modules.md (design.md's "Where things live" in full), made from the
code itself.

    python tools/where.py            # print the section
    python tools/where.py --write    # rewrite it in docs/modules.md
    python tools/where.py --check    # exit 1, saying what differs, when the page is stale
    python tools/where.py --circles  # the import circles, run time and type-only; exit 1 if any
    python tools/where.py --batch-path  # a batch's path and the private names of other
                                        # classes it touches; exit 1 if any

Each module's row is its docstring's first sentence and the modules of ours it imports at run
time (imports under `if TYPE_CHECKING:` are listed apart, as types). The rules are LAYERS below:
which folder may import which, at run time. tests/test_where.py holds the code to them (a
module that imports what its layer may not, an import circle at run time or one only type
checkers see, a private module of the other package), and to the page being current.

Only the standard library: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "modules.md"
BEGIN = "<!-- where.py: begin (made by `python tools/where.py --write`; edit LAYERS there) -->"
END = "<!-- where.py: end -->"
# Import name -> folder, as pyproject's package-dir maps them.
PACKAGES = {"stoker.server": "server", "stoker.client": "client", "stoker.v1": "protos/stoker/v1",
            "stoker.integrations": "integrations"}
SCANNED = ("stoker.server", "stoker.client", "stoker.integrations")
GENERATED = ("_pb2",)  # protoc's output: not ours to map


@dataclass(frozen=True)
class Layer:
    """A group of modules (a folder, or named top-level modules) and what it may import."""

    name: str  # a module prefix: "stoker.server.pool" holds the folder and what is under it
    owns: str
    may_import: tuple[str, ...]  # module prefixes; a layer may always import itself
    modules: tuple[str, ...] = ()  # when set: these modules exactly, not a prefix


S = "stoker.server"
C = "stoker.client"
LEAVES = (f"{C}._errors", f"{C}._log", f"{C}._backoff")  # the client's: any room may import
LAYERS = (
    Layer("stoker.server.lru", "the one least-recently-used map of the server's caches", (),
          modules=(f"{S}._lru",)),
    Layer("stoker.server.sources", "storage: local files, S3, the disk cache, the prefix cache",
          (f"{S}._lru",)),
    Layer("stoker.server.order", "pure ordering math: coordinates -> sample indices",
          ("stoker.server.sources", f"{S}._lru")),
    Layer("stoker.server.leaves", "the start error", (),
          modules=(f"{S}._errors",)),
    Layer("stoker.server.formats", "readers: a `format:` block -> a dataset; samples",
          ("stoker.server.sources", "stoker.server.order", "stoker.server.images",
           "stoker.server._config", f"{S}._lru")),
    Layer("stoker.server.config", "the YAML schema; decoding and transforms",
          ("stoker.server.sources", "stoker.server.formats"),
          modules=(f"{S}._config", f"{S}.images")),
    Layer("stoker.server.pool", "the worker processes and the pool that drives them",
          ("stoker.server.sources", "stoker.server.order", "stoker.server.formats",
           "stoker.server._errors", "stoker.server._config", "stoker.server.images")),
    Layer("stoker.server.front", "the front-end process: gRPC, HTTP, limits, sending",
          ("stoker.server.order", "stoker.server._errors", "stoker.server._config",
           "stoker.server.pool.workers", "stoker.server.pool.messages",
           "stoker.server.pool.layout", "stoker.server.pool.shm", "stoker.server.pool.depth",
           "stoker.server.sources.prefix_cache", "stoker.server.front.tables", "stoker.v1")),
    # A lake table's snapshot is opened when a job first names it, not at start: the front end
    # resolves the snapshot and opens it as a worker would (describe), in a thread.
    Layer("stoker.server.front.tables", "lake tables' snapshots as the front end opens them",
          ("stoker.server.front", "stoker.server.formats", "stoker.server.pool.worker_main",
           "stoker.server.pool.messages", "stoker.server.sources.cache", "stoker.server.order",
           "stoker.server._config", "stoker.server._errors"),
          modules=(f"{S}.front.tables",)),
    Layer("stoker.server.app", "the server's lifecycle: front end and pool on one exit stack",
          ("stoker.server.front", "stoker.server.pool", "stoker.server.order",
           "stoker.server._config", "stoker.server._errors", "stoker.v1"),
          modules=(f"{S}._app",)),
    Layer("stoker.server.tools", "operator commands: clients of a server, or of its config",
          ("stoker.server.sources", "stoker.server.formats", "stoker.server.order",
           "stoker.server.pool.batch", "stoker.server.front.auth", "stoker.server.front.tls",
           "stoker.server._config", "stoker.server._errors", "stoker.server._process",
           "stoker.client", "stoker.client.channel", "stoker.v1")),
    Layer("stoker.server.entry", "the package's face, the `stoker` command, a child server",
          ("stoker.server",),
          modules=(S, f"{S}.__main__", f"{S}.cli", f"{S}._process")),
    Layer("stoker.client.leaves", "the client's errors, its logger, its backoff", ("stoker.v1",),
          modules=LEAVES),
    Layer("stoker.client.position", "plain values: coordinates, resume, exclusions, fingerprint",
          ("stoker.v1",)),
    Layer("stoker.client.transport", "receive threads: a stream, its frames, the data "
          "connection, same-host memory", ("stoker.v1", *LEAVES)),
    Layer("stoker.client.delivery", "a batch's buffers, device copy, normalisation, counts",
          (*LEAVES, f"{C}.transport.frames")),
    Layer("stoker.client.fleet", "under the scheduler's lock: servers, rates, credits, hedges, "
          "the pass, the window", ("stoker.v1", *LEAVES, f"{C}.position",
                                   f"{C}.transport")),
    Layer("stoker.client.channel", "how a channel to a server is made (public)",
          (f"{C}.transport.datalink",), modules=(f"{C}.channel",)),
    Layer("stoker.client.contact", "first contact, fingerprint agreement, diagnosis",
          ("stoker.v1", *LEAVES, f"{C}.position", f"{C}.fleet")),
    Layer("stoker.client.loader", "RemoteLoader, its on-demand calls, its options and checks",
          ("stoker.v1", C),
          modules=(C, f"{C}._loader", f"{C}._on_demand", f"{C}._oneshot", f"{C}._options",
                   f"{C}._checks", f"{C}._epoch_pass", f"{C}._progress", f"{C}._stall",
                   f"{C}.packing")),
    Layer("stoker.integrations", "stoker inside training frameworks: public API only",
          ("stoker.client", "stoker.server")),
)


@dataclass
class Module:
    name: str
    path: Path
    owns: str
    runtime: set[str] = field(default_factory=set)  # modules of ours, imported when run
    types: set[str] = field(default_factory=set)  # under `if TYPE_CHECKING:` only


def module_name(path: Path) -> str:
    for pkg, folder in PACKAGES.items():
        base = ROOT / folder
        if path.is_relative_to(base):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            return ".".join([pkg, *parts])
    raise ValueError(path)


def all_modules() -> dict[str, Path]:
    found = {}
    for pkg in SCANNED:
        for path in sorted((ROOT / PACKAGES[pkg]).rglob("*.py")):
            found[module_name(path)] = path
    for path in sorted((ROOT / PACKAGES["stoker.v1"]).glob("*.py")):
        if not any(g in path.name for g in GENERATED):
            found[module_name(path)] = path
    return found


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, in_types: bool = False) -> Iterator[tuple[ast.stmt, bool]]:
    """Every import statement under `tree`, and whether it runs only for type checkers."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, in_types
        elif isinstance(node, ast.If) and _type_checking(node):
            for child in node.body:
                yield from _imports(ast.Module(body=[child], type_ignores=[]), True)
            for child in node.orelse:
                yield from _imports(ast.Module(body=[child], type_ignores=[]), in_types)
        else:
            yield from _imports(node, in_types)


def _targets(node: ast.stmt, here: str, is_package: bool, known: dict[str, Path]) -> set[str]:
    """The modules an import statement loads, as import names."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names}
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        parts = here.split(".") if is_package else here.split(".")[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    out = set()
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        if sub not in known and base in known and _compiled(known[base], alias.name):
            continue  # a C extension (server/_jpeg.c): a leaf that imports none of ours
        out.add(sub if sub in known else base)
    return out


def _compiled(package: Path, name: str) -> bool:
    """Whether `name` is a C extension of the package whose __init__.py is `package`."""
    return package.name == "__init__.py" and (package.parent / f"{name}.c").is_file()


def _ours(name: str, known: dict[str, Path]) -> str | None:
    """`name` as one of our modules (an import of a name inside it counts as the module)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def _first_sentence(text: str) -> str:
    match = re.match(r"(.+?\.)(\s|$)", text)
    return match.group(1) if match else text


def read(known: dict[str, Path] | None = None) -> dict[str, Module]:
    known = known or all_modules()
    modules = {}
    for name, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        doc = (ast.get_docstring(tree) or "").strip()
        owns = _first_sentence(" ".join(doc.split("\n\n")[0].split()))
        m = Module(name, path, owns)
        for node, types in _imports(tree):
            for target in _targets(node, name, path.name == "__init__.py", known):
                ours = _ours(target, known)
                if ours and ours != name:
                    (m.types if types else m.runtime).add(ours)
        m.types -= m.runtime
        modules[name] = m
    return modules


def layer_of(name: str) -> Layer | None:
    """The layer a module belongs to: a named module first, else the longest prefix."""
    for layer in LAYERS:
        if name in layer.modules:
            return layer
    best = None
    for layer in LAYERS:
        if not layer.modules and (name == layer.name or name.startswith(layer.name + ".")):
            if best is None or len(layer.name) > len(best.name):
                best = layer
    return best


def _allowed(target: str, layer: Layer) -> bool:
    if layer_of(target) is layer:
        return True
    return any(target == p or target.startswith(p + ".") for p in layer.may_import)


def violations(modules: dict[str, Module]) -> list[str]:
    """Every run-time import that its module's layer may not make, and every module of ours
    that no layer holds."""
    out = []
    for m in modules.values():
        if m.name.startswith("stoker.v1"):
            continue
        layer = layer_of(m.name)
        if layer is None:
            out.append(f"{m.name}: in no layer of tools/where.py's LAYERS")
            continue
        for target in sorted(m.runtime):
            if not _allowed(target, layer):
                out.append(f"{m.name} imports {target}: layer {layer.name} may import "
                           f"{', '.join(layer.may_import) or 'nothing of ours'}")
            elif _private_across(m.name, target):
                out.append(f"{m.name} imports {target}: a private module of another package")
    return out


def _private_across(here: str, target: str) -> bool:
    """`target` is an underscore module of the other top-level package (server vs client)."""
    top = ".".join(here.split(".")[:2])
    return not target.startswith(top + ".") and any(
        part.startswith("_") and not part.startswith("__") for part in target.split(".")[2:])


def circles(modules: dict[str, Module], types: bool = False) -> list[list[str]]:
    """Strongly connected groups of more than one module in the run-time import graph, or
    with `types`, in the graph of every import, those for type checkers too (a circle only
    there still means two modules that cannot be understood apart; Tarjan's algorithm,
    iterative)."""
    def edges(name: str) -> Iterator[str]:
        m = modules[name]
        return iter(sorted(m.runtime | m.types if types else m.runtime))

    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found = []
    counter = 0
    for root in modules:
        if root in index:
            continue
        work = [(root, edges(root))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in modules:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, edges(child)))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        found.append(sorted(group))
    return found


def circle_report(modules: dict[str, Module]) -> tuple[list[str], int]:
    """What --circles prints: a line of counts for the code it maps, then each circle (its
    modules, and whether it exists at run time or only for type checkers); and how many."""
    at_run_time = circles(modules)
    type_only = [c for c in circles(modules, types=True) if c not in at_run_time]
    lines = [f"import circles in server/, client/, integrations/ and protos/: "
             f"{len(at_run_time)} at run time, "
             f"{len(type_only)} type-only (through imports under `if TYPE_CHECKING:`)"]
    for kind, found in (("run time", at_run_time), ("type-only", type_only)):
        lines += [f"  {kind}: " + " <-> ".join(c) for c in found]
    return lines, len(at_run_time) + len(type_only)


# -- a batch's path: `__iter__` to the batch handed over ------------------------------------
# Where a batch's path starts: the loop's thread (iteration), the receive threads (a stream's
# readers), and the callbacks a stream is given (StreamSpec: allocate, finish, empty; the
# scheduler's on_batch). From these, BATCH_PATH follows calls it can resolve without running
# the code: a method of the same class (`self.m()`, or `self.m` handed over as a callback),
# a method of an attribute whose class its __init__ names (`self.x = Cls(...)`, `self.x: Cls`,
# a parameter annotated `Cls`), a function or class of ours called by its name.
BATCH_ROOTS = (
    f"{C}._loader:RemoteLoader.__iter__",
    f"{C}._loader:RemoteLoader._allocate",
    f"{C}._loader:RemoteLoader._finish",
    f"{C}._loader:RemoteLoader._spec",
    f"{C}._epoch_pass:EpochPass.__iter__",
    f"{C}.fleet.scheduler:Scheduler.take",
    f"{C}.fleet.scheduler:Scheduler._on_batch",
    f"{C}.transport.stream:BatchStream._read_data",
    f"{C}.transport.stream:BatchStream._receive",
)


@dataclass
class _Func:
    module: str
    cls: str | None
    node: ast.FunctionDef | ast.AsyncFunctionDef


def _functions(known: dict[str, Path]) -> tuple[dict[str, _Func], dict[str, dict[str, str]]]:
    """Every function and method of the client ("module:Class.name" or "module:name"), and
    each class's attributes whose class is known ("module:Class" -> attribute -> class key)."""
    funcs: dict[str, _Func] = {}
    attrs: dict[str, dict[str, str]] = {}
    for name, path in known.items():
        if not name.startswith(C):
            continue
        tree = ast.parse(path.read_text(), str(path))
        names = _imported_names(tree, name, path.name == "__init__.py", known)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                funcs[f"{name}:{node.name}"] = _Func(name, None, node)
            elif isinstance(node, ast.ClassDef):
                owned: dict[str, str] = {}
                for item in node.body:  # a dataclass's fields: `name: Cls`
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) \
                            and (found := _class_named(item.annotation, names)):
                        owned[item.target.id] = found
                for item in node.body:
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                        funcs[f"{name}:{node.name}.{item.name}"] = _Func(name, node.name, item)
                        if item.name == "__init__":
                            owned.update(_attribute_classes(item, names))
                attrs[f"{name}:{node.name}"] = owned
    return funcs, attrs


def _imported_names(tree: ast.Module, here: str, is_package: bool,
                    known: dict[str, Path]) -> dict[str, str]:
    """Local name -> "module:name" for what a module defines and imports from ours."""
    out = {n.name: f"{here}:{n.name}" for n in tree.body
           if isinstance(n, ast.ClassDef | ast.FunctionDef)}
    for node, _ in _imports(tree):
        if isinstance(node, ast.ImportFrom):
            for target in _targets(node, here, is_package, known):
                for alias in node.names:
                    if not target.endswith(f".{alias.name}"):
                        out[alias.asname or alias.name] = f"{target}:{alias.name}"
                    else:  # a module: "package:module", as _module_of reads it
                        out[alias.asname or alias.name] = f"{target[:-len(alias.name) - 1]}:" \
                                                          f"{alias.name}"
    return out


def _class_named(expr: ast.expr | None, names: dict[str, str]) -> str | None:
    """The class of ours an annotation names (`Cls`, `Cls | None`, "Cls")."""
    if isinstance(expr, ast.Name):
        return names.get(expr.id)
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return names.get(expr.value.split("[")[0].split("|")[0].strip())
    if isinstance(expr, ast.BinOp):
        return _class_named(expr.left, names) or _class_named(expr.right, names)
    return None


def _attribute_classes(init: ast.FunctionDef | ast.AsyncFunctionDef,
                       names: dict[str, str]) -> dict[str, str]:
    """self.attr -> class key, from __init__'s assignments and its parameters' annotations."""
    params = {a.arg: a.annotation for a in init.args.args if a.annotation is not None}

    def cls_of(expr: ast.expr | None) -> str | None:
        if isinstance(expr, ast.Call):
            expr = expr.func
        if isinstance(expr, ast.Name):
            if expr.id in params:
                return cls_of(params[expr.id])
            return names.get(expr.id)
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
            return names.get(expr.value.split("[")[0].split("|")[0].strip())
        if isinstance(expr, ast.BinOp):  # `Cls | None`
            return cls_of(expr.left) or cls_of(expr.right)
        return None

    out: dict[str, str] = {}
    for node in ast.walk(init):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            targets, value, ann = [node.targets[0]], node.value, None
        elif isinstance(node, ast.AnnAssign):
            targets, value, ann = [node.target], node.value, node.annotation
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and \
                    t.value.id == "self" and (found := cls_of(ann) or cls_of(value)):
                out[t.attr] = found
    return out


def _pairs(node: ast.Assign) -> list[tuple[ast.expr, ast.expr]]:
    """(target, value) of `a = x` and of `a, b = x, y`."""
    t, v = node.targets[0], node.value
    if isinstance(t, ast.Tuple) and isinstance(v, ast.Tuple) and len(t.elts) == len(v.elts):
        return list(zip(t.elts, v.elts, strict=True))
    return [(t, v)]


def _class_of(expr: ast.expr, owner: str | None, alias: dict[str, ast.expr],
              attrs: dict[str, dict[str, str]], depth: int = 0) -> str | None:
    """The class of ours `expr` is an instance of, where the code says: `self` is `owner`,
    a local name its assigned value's, an attribute its class's __init__ or fields say."""
    if depth > 8:
        return None
    if isinstance(expr, ast.Name):
        if expr.id in ("self", "cls"):
            return owner
        return _class_of(alias[expr.id], owner, alias, attrs, depth + 1) \
            if expr.id in alias else None
    if isinstance(expr, ast.Attribute) and \
            (of := _class_of(expr.value, owner, alias, attrs, depth + 1)):
        return attrs.get(of, {}).get(expr.attr)
    return None


def _private(attr: str) -> bool:
    return attr.startswith("_") and not attr.startswith("__")


def batch_path(roots: tuple[str, ...] = BATCH_ROOTS) -> tuple[list[str], list[str]]:
    """(the functions on a batch's path, sorted; every private name of another class or
    module they touch: "function: expression", sorted). A root that names no function is
    reported as a touch too (the path's map must follow the code)."""
    known = all_modules()
    funcs, attrs = _functions(known)
    seen: set[str] = set()
    touches: list[str] = [f"{r}: no such function" for r in roots if r not in funcs]
    todo = [r for r in roots if r in funcs]
    while todo:
        key = todo.pop()
        if key in seen:
            continue
        seen.add(key)
        f = funcs[key]
        owner = f"{f.module}:{f.cls}" if f.cls else None
        names = _imported_names(ast.parse(known[f.module].read_text()), f.module,
                                known[f.module].name == "__init__.py", known)
        # Local names for an attribute of self (`x = self.attr`): their calls are its.
        alias = {t.id: v for n in ast.walk(f.node) if isinstance(n, ast.Assign)
                 for t, v in _pairs(n) if isinstance(t, ast.Name)
                 and isinstance(v, ast.Attribute)}

        for node in ast.walk(f.node):
            if isinstance(node, ast.Attribute):
                base = node.value
                on_self = isinstance(base, ast.Name) and base.id in ("self", "cls")
                if _private(node.attr) and not on_self:
                    touches.append(f"{key}: {ast.unparse(node)}")
                callee = None
                if (cls := _class_of(base, owner, alias, attrs)) is not None:
                    callee = f"{cls}.{node.attr}"
                elif isinstance(base, ast.Name) and (module := names.get(base.id)) and \
                        module.replace(":", ".") in known:
                    callee = f"{module.replace(':', '.')}:{node.attr}"
                if callee in funcs:
                    todo.append(callee)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                target = names.get(node.func.id)
                if target in funcs:
                    todo.append(target)
                elif target and f"{target}.__init__" in funcs:
                    todo.append(f"{target}.__init__")
    return sorted(seen), sorted(set(touches))


def _short(name: str, within: str) -> str:
    return name[len(within) + 1:] if name.startswith(within + ".") else name


def _cell(names: set[str], within: str) -> str:
    return ", ".join(f"`{_short(n, within)}`" for n in sorted(names)) or "-"


def section(modules: dict[str, Module]) -> str:
    """The page's section, between BEGIN and END."""
    lines = [BEGIN, "", "**Layers.** What each part may import at run time (besides itself, "
             "the standard library and third-party packages); imports for type checking "
             "are free.", "", "| layer | owns | may import |", "| --- | --- | --- |"]
    for layer in LAYERS:
        what = ", ".join(f"`{m}`" for m in layer.modules) or f"`{layer.name}`"
        may = ", ".join(f"`{p}`" for p in layer.may_import) or "nothing of ours"
        lines.append(f"| {what} | {layer.owns} | {may} |")
    for pkg, title in (("stoker.server", "Server"), ("stoker.client", "Client"),
                       ("stoker.v1", "Protocol")):
        lines += ["", f"**{title} (`{pkg}`, folder `{PACKAGES[pkg]}/`)**", "",
                  "| module | owns | imports | for types only |", "| --- | --- | --- | --- |"]
        for m in sorted(modules.values(), key=lambda m: str(m.path)):
            if m.name == pkg or m.name.startswith(pkg + "."):
                path = m.path.relative_to(ROOT / PACKAGES[pkg]).as_posix()
                lines.append(f"| `{path}` | {m.owns.replace('|', '/')} | "
                             f"{_cell(m.runtime, pkg)} | {_cell(m.types, pkg)} |")
    lines += ["", END]
    return "\n".join(lines)


def current_page() -> tuple[str, str, str]:
    """docs/modules.md cut into what comes before the section, the section, and after."""
    text = PAGE.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start], text[start:end], text[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite docs/modules.md's section")
    parser.add_argument("--check", action="store_true", help="fail when the page is stale")
    parser.add_argument("--circles", action="store_true",
                        help="list the import circles (run time and type-only) of the code "
                             "it maps; exit 1 if there is any")
    parser.add_argument("--batch-path", action="store_true",
                        help="list the functions on a batch's path and the private names of "
                             "other classes they touch; exit 1 if any")
    args = parser.parse_args(argv)
    if args.batch_path:
        path, touches = batch_path()
        print(f"a batch's path, __iter__ to the batch handed over: {len(path)} functions, "
              f"{len(touches)} private names of another class touched")
        print("\n".join([*(f"  on the path: {p}" for p in path),
                         *(f"  touches: {t}" for t in touches)]))
        return 1 if touches else 0
    modules = read()
    if args.circles:
        lines, count = circle_report(modules)
        print("\n".join(lines))
        return 1 if count else 0
    made = section(modules)
    if args.write:
        before, _, after = current_page()
        PAGE.write_text(before + made + after)
    elif args.check:
        if current_page()[1] != made:
            print("docs/modules.md is stale: run python tools/where.py --write",
                  file=sys.stderr)
            return 1
    else:
        print(made)
    return 0


if __name__ == "__main__":
    sys.exit(main())
