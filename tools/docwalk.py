"""Walk the docs as a new user would: every code block of README.md and docs/*.md, classified,
and with --run executed in order per page, in a scratch copy of the checkout.

    python tools/docwalk.py [--run] [--fast] [--install] [--keep] [PAGES...]
    python tools/docwalk.py --paths [PAGES...]   # only: every code path they name exists

Blocks are fenced (```lang) or indented by four spaces. What a block is:

- bash: commands, one per line (a trailing backslash continues a line). `stoker serve` runs in
  the background until its ready line; every other command runs to its end (60 s at most, 600
  with a `slow` marker). Skipped, with the reason: install steps (`pip install`, `python -m
  venv`, activating a venv) unless --install; command synopses (placeholders in capitals or
  `[--option]`); commands whose program is not installed here (docker, kubectl...); `make`.
- python: run as a script when it parses and every name it reads is defined in it; otherwise
  it is a sketch (skipped, naming the names it lacks). A block whose first line is a comment
  naming a file (`# mydata.py`) is written to that file instead.
- yaml: a stoker config (top-level keys among server/s3/cache/datasets) must be accepted by the
  config loader (paths and environment variables that must exist on a server aside); a
  Kubernetes object must have apiVersion and kind; `# NAME.yaml` on the first line writes it.
- anything else (output samples, protocol definitions, diagrams): not run.

A marker on the line before a block, invisible when rendered, says what the walker cannot
know: `<!-- docwalk: skip REASON -->`, `<!-- docwalk: slow -->` (skipped by --fast),
`<!-- docwalk: fragment -->` (a yaml excerpt, not a whole config), `<!-- docwalk: refused -->`
(a config the page shows the loader refusing: it must), `<!-- docwalk: background
-->` (every command of the block keeps running; the walker waits 3 s for it to die early).

Each page runs in a network namespace of its own when `unshare -rn` works (default ports never
clash with anything else on the machine), with `python`, `python3` and `stoker` on PATH meaning
this checkout's interpreter and CLI (`--install` runs the install steps in a fresh venv
instead). Background processes are stopped (SIGTERM, then SIGKILL) when the page ends.
Exit status: 1 if any block failed.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import enum
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG_KEYS = {"server", "s3", "cache", "datasets"}
TIMEOUT = 60.0
SLOW_TIMEOUT = 600.0
READY_TIMEOUT = 90.0
MARKER = re.compile(r"^\s*<!--\s*docwalk:\s*(\w+)\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
FILE_NAME = re.compile(r"^#\s*([\w./-]+\.(?:py|ya?ml))\s*$")
# A command synopsis, not a command: `[--port N]`, `HOST:PORT`, `DATASET`, `...`.
PLACEHOLDER = re.compile(r"\[-|\s\.\.\.(?:\s|$)|"
                         r"(?:^|(?<=[\s\[]))[A-Z][A-Z_]*(?::[A-Z]+)?(?=[\s\]]|$)")
INSTALL = re.compile(r"^(pip3? install|python3? -m (pip install|venv)|\. \S*activate|"
                     r"source \S*activate)\b")
SERVE = re.compile(r"\bstoker serve\b|-m stoker\.server\.cli serve\b")
READY = '"event": "ready"'
NEEDS = {"docker": "a Docker engine", "kubectl": "a Kubernetes cluster",
         "grpcurl": "grpcurl", "helm": "a Kubernetes cluster"}


class Kind(enum.Enum):
    BASH = "bash"
    PYTHON = "python"
    YAML = "yaml"
    OTHER = "other"  # output samples, protocol definitions, diagrams: read, never run


class Outcome(enum.Enum):
    OK = "ok"
    FAILED = "failed"
    SKIPPED = "skipped"


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the block's first line of code
    lang: str  # the fence's language, or "" (indented or bare fence)
    text: str
    marker: tuple[str, str] | None  # (directive, argument) from <!-- docwalk: ... -->

    @property
    def kind(self) -> Kind:
        lang = self.lang.lower()
        if lang in ("bash", "sh", "shell", "console"):
            return Kind.BASH
        if lang in ("python", "py"):
            return Kind.PYTHON
        if lang in ("yaml", "yml"):
            return Kind.YAML
        if lang:
            return Kind.OTHER
        return _guess(self.text)

    @property
    def where(self) -> str:
        return f"{_rel(self.page)}:{self.line}"


@dataclass(frozen=True)
class Result:
    block: Block
    outcome: Outcome
    detail: str = ""


@dataclass
class Page:
    """A page's scratch state: its folder, its environment, what it left running."""

    scratch: Path
    env: dict[str, str]
    cwd: Path
    background: list[tuple[str, subprocess.Popen, Path]] = field(default_factory=list)
    holder: subprocess.Popen | None = None  # holds the page's network namespace


def _rel(p: Path) -> str:
    try:
        return str(p.resolve().relative_to(ROOT))
    except ValueError:
        return str(p)


COMMANDS = ("pip", "python", "python3", "stoker", "make", "docker", "kubectl", "curl",
            "openssl", "git", "cd", "export", "mkdir", "cat", "grpcurl", ".", "source", "ls",
            "helm", "echo", "PYTHONPATH=")


def _guess(text: str) -> Kind:
    if re.search("[\u2500-\u257f]", text):  # box drawing: a tree or a diagram
        return Kind.OTHER
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    if first.split(" ")[0].startswith(COMMANDS) and not first.startswith("python:"):
        return Kind.BASH
    if re.match(r"^(from|import) \w", first) or "RemoteLoader(" in first:
        return Kind.PYTHON
    return Kind.OTHER


def blocks(page: Path) -> list[Block]:
    """Every code block of a Markdown page, fenced or indented, in page order."""
    lines = page.read_text().splitlines()
    out: list[Block] = []
    i = 0
    marker: tuple[str, str] | None = None
    prev_blank = True
    in_list = False
    while i < len(lines):
        line = lines[i]
        m = MARKER.match(line)
        if m:
            marker = (m.group(1), m.group(2))
            i += 1
            continue
        f = FENCE.match(line)
        if f:
            indent, fence, lang = len(f.group(1)), f.group(2), f.group(3)
            body: list[str] = []
            j = i + 1
            while j < len(lines) and not lines[j].strip().startswith(fence):
                body.append(lines[j][indent:] if lines[j][:indent].isspace() else lines[j])
                j += 1
            out.append(Block(page, i + 2, lang, "\n".join(body) + "\n", marker))
            marker, prev_blank, i = None, False, j + 1
            continue
        if line.startswith("    ") and prev_blank and not in_list:
            body = []
            j = i
            while j < len(lines) and (lines[j].startswith("    ") or not lines[j].strip()):
                body.append(lines[j][4:])
                j += 1
            while body and not body[-1].strip():
                body.pop()
            out.append(Block(page, i + 1, "", "\n".join(body) + "\n", marker))
            marker, prev_blank, i = None, True, j
            continue
        if line.strip():
            marker = None if not line.lstrip().startswith("<!--") else marker
            # A list item's continuation lines are indented: not a code block.
            in_list = bool(re.match(r"^\s*([-*+]|\d+\.) ", line)) or (in_list and not prev_blank)
            if not line.startswith(" "):
                in_list = bool(re.match(r"^([-*+]|\d+\.) ", line))
        prev_blank = not line.strip()
        i += 1
    return out


def commands(text: str) -> list[str]:
    """The block's command lines, continuations joined; comments and blank lines dropped."""
    out: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.rstrip()
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        out.append((pending + line).strip())
        pending = ""
    if pending:
        out.append(pending.strip())
    return out


def _strip_comment(cmd: str) -> str:
    try:
        return shlex.join(shlex.split(cmd, comments=True))
    except ValueError:
        return cmd


def skip_reason(cmd: str, install: bool, fast: bool) -> str | None:
    """Why this command is not run here, or None."""
    bare = _strip_comment(cmd)
    words = shlex.split(bare, comments=True) if bare else []
    while words and re.match(r"^\w+=", words[0]):
        words = words[1:]
    if not words:
        return "empty"
    if INSTALL.match(bare):
        return None if install else "install step (the walker uses this checkout; --install)"
    program = words[0]
    if program in NEEDS:
        return f"needs {NEEDS[program]}"
    unquoted = re.sub(r"'[^']*'|\"[^\"]*\"", "", cmd)
    if PLACEHOLDER.search(re.sub(r"(^|\s)#.*", "", unquoted)):
        return "synopsis (placeholders)"
    if program == "make":
        return "make: installs a venv and runs for minutes (the walker runs its parts)"
    if program == "git" and words[1:2] == ["clone"]:
        return "git clone: the walker runs in a copy of this checkout"
    if program not in ("python", "python3", "stoker", "cd", "export", ".", "source") \
            and shutil.which(program) is None:
        return f"needs {program} (not installed here)"
    return None


def free_names(source: str) -> set[str]:
    """Names the code reads that it never binds (nor are builtins): a sketch's holes."""
    tree = ast.parse(source)
    bound: set[str] = set(dir(builtins)) | {"__file__", "__name__"}
    read: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (bound if isinstance(node.ctx, ast.Store | ast.Del) else read).add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.ClassDef | ast.AsyncFunctionDef):
            bound.add(node.name)
            if not isinstance(node, ast.ClassDef):
                a = node.args
                bound |= {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)}
                bound |= {x.arg for x in (a.vararg, a.kwarg) if x}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return read - bound


def check_yaml(block: Block, where: Path | None = None) -> Result:
    """A yaml block parses; a stoker config is accepted by the config loader."""
    import yaml

    if block.marker and block.marker[0] == "refused":
        problems = config_problems(block.text, where)
        if problems:
            return Result(block, Outcome.OK, f"refused, as the page says ({len(problems)} errors)")
        return Result(block, Outcome.FAILED, "the page shows it refused, the loader accepts it")
    if block.marker and block.marker[0] == "fragment":
        try:
            yaml.safe_load(block.text)
        except yaml.YAMLError as e:
            return Result(block, Outcome.FAILED, f"fragment does not parse: {e}")
        return Result(block, Outcome.OK, "fragment parses")
    try:
        docs = [d for d in yaml.safe_load_all(block.text) if d is not None]
    except yaml.YAMLError as e:
        return Result(block, Outcome.FAILED, f"not valid YAML: {e}")
    if not docs:
        return Result(block, Outcome.FAILED, "empty")
    if all(isinstance(d, dict) and "apiVersion" in d and "kind" in d for d in docs):
        try:
            import kubernetes_validate  # the dev extra; without it only the shape is checked
        except ImportError:
            kubernetes_validate = None
        for d in docs if kubernetes_validate else ():
            try:
                kubernetes_validate.validate(d, "1.30.0", strict=True)
            except kubernetes_validate.ValidationError as e:
                return Result(block, Outcome.FAILED, f"{d['kind']}: {e}")
        checked = "valid Kubernetes 1.30" if kubernetes_validate else "Kubernetes"
        return Result(block, Outcome.OK, f"{checked}: " + ", ".join(d["kind"] for d in docs))
    (doc,) = docs
    if not isinstance(doc, dict) or not set(doc) <= CONFIG_KEYS:
        keys = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
        return Result(block, Outcome.FAILED, f"not a stoker config (top level {keys}) and not "
                      "marked <!-- docwalk: fragment -->")
    problems = config_problems(block.text, where)
    if problems:
        return Result(block, Outcome.FAILED, "config loader refuses it:\n" + "\n".join(problems))
    return Result(block, Outcome.OK, "config accepted by the loader")


# What only a real server's machine can satisfy: files and folders the config names, the
# environment variable a token comes from.
_MACHINE = re.compile(r"not a directory: |not a file: |no such file or directory: |"
                      r"tokenizer file not found: |environment variable \w+ is not set")


def config_problems(text: str, where: Path | None = None) -> list[str]:
    """The config loader's complaints about `text`, bar those about the machine it runs on."""
    from stoker.server._config import ConfigError, load_config

    with tempfile.TemporaryDirectory() as tmp:
        path = (where or Path(tmp)) / "docwalk-config.yaml"
        path.write_text(text)
        try:
            load_config(path)
        except ConfigError as e:
            return [ln for ln in str(e).splitlines()[1:] if not _MACHINE.search(ln)]
        finally:
            path.unlink(missing_ok=True)
    return []


# -- running a page --------------------------------------------------------------------------

def _isolate(page: Page) -> list[str]:
    """A prefix that runs a command in the page's own network namespace (loopback only), or
    [] where namespaces cannot be made: a process holds the namespace until the page ends."""
    if not all(shutil.which(p) for p in ("unshare", "nsenter", "ip")):
        return []
    holder = subprocess.Popen(["unshare", "-rn", "sh", "-c",
                               "ip link set lo up && echo up && exec sleep 86400"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              start_new_session=True)
    up = holder.stdout.readline().strip() == "up" if holder.stdout else False
    if holder.stdout:
        holder.stdout.close()
    if not up:
        _stop(holder)
        return []
    page.holder = holder
    return ["nsenter", "-t", str(holder.pid), "-U", "-n", "--preserve-credentials"]


def new_page(install: bool) -> Page:
    scratch = Path(tempfile.mkdtemp(prefix="docwalk-"))
    checkout = scratch / "checkout"
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        src = ROOT / name
        if src.is_file():
            dst = checkout / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTEST"))}
    env.pop("PYTHONPATH", None)
    if not install:
        shims = scratch / "bin"
        shims.mkdir()
        for name, target in (("python", ""), ("python3", ""), ("stoker", "-m stoker.server.cli")):
            shim = shims / name
            shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" {target} "$@"\n')
            shim.chmod(0o755)
        env["PATH"] = f"{shims}{os.pathsep}{env.get('PATH', '')}"
    env["HOME"] = str(scratch / "home")
    (scratch / "home").mkdir()
    return Page(scratch, env, checkout)


def _shell(page: Page, cmd: str) -> str:
    """A bash script: the page's state in, the command, the page's state out."""
    state = page.scratch / "state.sh"
    return textwrap.dedent(f"""\
        [ -f {state} ] && . {state}
        {cmd}
        rc=$?
        export -p | grep -v -E '^declare -x (PWD|OLDPWD|SHLVL|_)=' > {state}.new
        echo "cd $(printf %q "$PWD")" >> {state}.new
        mv {state}.new {state}
        exit $rc
        """)


def run_command(page: Page, cmd: str, timeout: float, prefix: list[str]) -> tuple[int, str]:
    proc = subprocess.Popen([*prefix, "bash", "-c", _shell(page, cmd)], cwd=page.cwd,
                            env=page.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(proc)
        out, _ = proc.communicate()
        return 124, (out or "") + f"\n[docwalk: killed after {timeout:.0f} s]"
    return proc.returncode, out


def start_background(page: Page, cmd: str, prefix: list[str], wait_ready: bool) -> str | None:
    """Start `cmd`, wait for its ready line (or 3 s alive); None, or why it failed."""
    config = re.search(r"--config\s+(\S+)", cmd)
    for i, (old, proc, _) in enumerate(list(page.background)):
        # The same config again is the page restarting its server: stop the old one first.
        if config and re.search(rf"--config\s+{re.escape(config.group(1))}\b", old):
            _stop(proc)
            page.background.remove(page.background[i])
    log = page.scratch / f"background-{len(page.background)}.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([*prefix, "bash", "-c", _shell(page, cmd)],
                                cwd=page.cwd, env=page.env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    page.background.append((cmd, proc, log))
    deadline = time.monotonic() + (READY_TIMEOUT if wait_ready else 3.0)
    err = f"no ready line within {READY_TIMEOUT:.0f} s" if wait_ready else None
    while time.monotonic() < deadline:
        if wait_ready and READY in log.read_text(errors="replace"):
            return None
        if proc.poll() is not None:
            err = f"exited with {proc.returncode}"
            break
        time.sleep(0.1)
    if err:  # reported here, not again when the page ends
        _stop(proc)
        page.background.pop()
        return f"{err}:\n{log.read_text(errors='replace')}"
    return None


def _stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 5.0)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue


def end_page(page: Page, keep: bool) -> list[str]:
    """Stop what the page left running; the logs of those that did not exit 0 on SIGTERM."""
    problems = []
    for cmd, proc, log in page.background:
        _stop(proc)
        if proc.returncode not in (0, -signal.SIGTERM):
            problems.append(f"{cmd}: exit {proc.returncode} on SIGTERM:\n"
                            f"{log.read_text(errors='replace')[-3000:]}")
    if page.holder is not None:
        _stop(page.holder)
    if not keep:
        shutil.rmtree(page.scratch, ignore_errors=True)
    return problems


def run_block(page: Page, block: Block, prefix: list[str], install: bool, fast: bool) -> Result:
    marker = block.marker or ("", "")
    if marker[0] == "skip":
        return Result(block, Outcome.SKIPPED, marker[1] or "marked skip")
    if marker[0] == "slow" and fast:
        return Result(block, Outcome.SKIPPED, "slow (run without --fast)")
    timeout = SLOW_TIMEOUT if marker[0] == "slow" else TIMEOUT
    kind = block.kind
    first = block.text.splitlines()[0] if block.text.strip() else ""
    named = FILE_NAME.match(first)
    if kind is Kind.YAML:
        result = check_yaml(block, page.cwd if named else None)
        if named and result.outcome is Outcome.OK:
            (page.cwd / named.group(1)).write_text(block.text)
            return Result(block, Outcome.OK, f"wrote {named.group(1)}; {result.detail}")
        return result
    if kind is Kind.PYTHON:
        try:
            holes = free_names(block.text)
        except SyntaxError as e:
            return Result(block, Outcome.FAILED, f"not valid Python: {e}")
        if named:
            (page.cwd / named.group(1)).write_text(block.text)
            return Result(block, Outcome.OK, f"wrote {named.group(1)}")
        if holes:
            return Result(block, Outcome.SKIPPED, "sketch: uses " + ", ".join(sorted(holes)))
        script = page.scratch / f"block-{block.line}.py"
        script.write_text(block.text)
        rc, out = run_command(page, f"python {shlex.quote(str(script))}", timeout, prefix)
        missing = re.search(r"ModuleNotFoundError: No module named '([\w.]+)'", out)
        if rc and missing and not missing.group(1).startswith("stoker"):
            return Result(block, Outcome.SKIPPED, f"needs {missing.group(1)} (not installed here)")
        if rc:
            return Result(block, Outcome.FAILED, f"exit {rc}:\n{out}")
        return Result(block, Outcome.OK, out.strip().splitlines()[-1] if out.strip() else "")
    if kind is Kind.BASH:
        ran, skipped = [], []
        for cmd in commands(block.text):
            why = skip_reason(cmd, install, fast)
            if why:
                skipped.append(f"{cmd.split(' #')[0].strip()} ({why})")
                continue
            config = re.search(r"--config\s+(\S+)", cmd)
            if SERVE.search(cmd) and config and not (page.cwd / config.group(1)).exists():
                skipped.append(f"{cmd} (its config {config.group(1)} is not on this page)")
                continue
            if marker[0] == "background" or SERVE.search(_strip_comment(cmd)):
                err = start_background(page, _strip_comment(cmd), prefix,
                                       wait_ready=marker[0] != "background")
                if err:
                    return Result(block, Outcome.FAILED, f"{cmd}\n{err}")
                ran.append(f"{cmd} (in the background)")
                continue
            rc, out = run_command(page, cmd, timeout, prefix)
            if rc:
                return Result(block, Outcome.FAILED, f"{cmd}\nexit {rc}:\n{out[-4000:]}")
            ran.append(cmd)
        if not ran:
            return Result(block, Outcome.SKIPPED, "; ".join(skipped))
        detail = f"ran {len(ran)}" + (f"; skipped {'; '.join(skipped)}" if skipped else "")
        return Result(block, Outcome.OK, detail)
    return Result(block, Outcome.SKIPPED, "not code (output, definition or diagram)")


def walk(page_path: Path, run: bool, fast: bool = False, install: bool = False,
         keep: bool = False, lines: set[int] | None = None) -> list[Result]:
    """Every block of one page, checked, and with `run` executed in page order.

    `lines`: run only the blocks that start on these lines (the rest are skipped)."""
    found = blocks(page_path)
    if not run:
        return [check_yaml(b) if b.kind is Kind.YAML else
                Result(b, Outcome.SKIPPED, f"{b.kind.value} (not run without --run)")
                for b in found]
    page = new_page(install)
    prefix = [] if install else _isolate(page)
    results: list[Result] = []
    try:
        for b in found:
            if lines is not None and b.line not in lines:
                results.append(Result(b, Outcome.SKIPPED, "not selected"))
                continue
            results.append(run_block(page, b, prefix, install, fast))
    finally:
        problems = end_page(page, keep)
    if problems:
        results.append(Result(Block(page_path, 0, "", "", None), Outcome.FAILED,
                              "\n".join(problems)))
    return results


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


# A path of this repository a page names: it starts with one of its top folders and names a
# file by its extension (`server/front/handshake.py`, `docs/tuning.md`).
TOP = ("server", "client", "protos", "integrations", "benchmarks", "tests", "tools", "examples",
       "deploy", "docker", "docs", ".ci")
CODE_PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(re.escape(t) for t in TOP) + r")/"
                       r"[\w./-]*\.(?:py|md|ya?ml|json|proto|sh|toml|txt|png))(?![\w/])")
# A path within the server's or the client's package (`front/limits.py`, `fleet/hold.py`).
SUBFOLDERS = ("front", "pool", "order", "formats", "sources", "fleet", "transport", "position",
              "contact", "delivery")
PACKAGE_PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(SUBFOLDERS) + r")/[\w/]*\w\.py)\b")
# Pages that name code: the walked pages, and the READMEs beside code.
PATH_PAGES = (ROOT / "benchmarks" / "README.md", ROOT / "docker" / "README.md")
# A dotted name of ours: stoker.server.front.handshake, stoker.client.RemoteLoader.
DOTTED = re.compile(r"\bstoker\.(?:server|client|v1|integrations)(?:\.\w+)+")
PACKAGE_DIRS = {"stoker.server": "server", "stoker.client": "client",
                "stoker.v1": "protos/stoker/v1", "stoker.integrations": "integrations"}


def _module_file(dotted: str) -> Path | None:
    """The file or package a dotted module name of ours is, or None."""
    package = next((p for p in PACKAGE_DIRS if dotted == p or dotted.startswith(p + ".")),
                   None)
    if package is None:
        return None
    rest = dotted[len(package):].lstrip(".").split(".") if dotted != package else []
    base = ROOT / PACKAGE_DIRS[package] / Path(*rest) if rest else ROOT / PACKAGE_DIRS[package]
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if base.with_suffix(".c").is_file():  # a C extension the install builds (server/_jpeg.c)
        return base.with_suffix(".c")
    return base / "__init__.py" if (base / "__init__.py").is_file() else None


def _names_in(module: Path) -> set[str]:
    """What `module` defines or imports at its top level (what a dotted name may reach)."""
    tree = ast.parse(module.read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
            if "__all__" in names and node.value is not None:  # names a package loads lazily
                names |= {e.value for e in ast.walk(node.value)
                          if isinstance(e, ast.Constant) and isinstance(e.value, str)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def dotted_exists(dotted: str) -> bool:
    """Whether `stoker.x.y.z` is a module of ours, or a module and a name defined in it (one
    level: a class, a function, a constant; its attributes are not followed), or (stoker.v1)
    a service or message of the protocol's .proto files."""
    if _module_file(dotted) is not None:
        return True
    if dotted.startswith("stoker.v1.") and dotted.count(".") >= 2:
        name = dotted.split(".")[2]
        protos = (ROOT / PACKAGE_DIRS["stoker.v1"]).glob("*.proto")
        if any(re.search(rf"^\s*(?:service|message|enum)\s+{name}\b", f.read_text(), re.M)
               for f in protos):
            return True
    module, _, name = dotted.rpartition(".")
    found = _module_file(module)
    if found is None:
        head, _, _ = module.rpartition(".")  # module.Class.attribute: the class must be there
        found, name = _module_file(head), module.rpartition(".")[2]
    return found is not None and name in _names_in(found)


def missing_paths(page: Path) -> list[str]:
    """Every code path and dotted name `page` names that does not exist in this checkout:
    `page:line: what`. Names with placeholders (`<`, `*`, `NAME`) are not paths."""
    out, generated = [], False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        # The module map (tools/where.py's block) names paths within each package, and is
        # made from the code: tests/test_where.py keeps it current.
        generated = (generated or line.startswith("<!-- where.py: begin")) and \
            not line.startswith("<!-- where.py: end")
        if generated:
            continue
        for path in CODE_PATH.findall(line):
            if not any(c in path for c in "*<>{}") and not re.search(r"\b[A-Z]{2,}\b", path) \
                    and not (ROOT / path).exists() \
                    and not (page.parent / path).exists():
                out.append(f"{_rel(page)}:{number}: {path}")
        for path in PACKAGE_PATH.findall(line):
            if not any((ROOT / top / path).exists() for top in ("server", "client")):
                out.append(f"{_rel(page)}:{number}: {path}")
        for dotted in DOTTED.findall(line):
            if not dotted_exists(dotted.rstrip(".")):
                out.append(f"{_rel(page)}:{number}: {dotted}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="docwalk", description=__doc__.split("\n\n")[0])
    parser.add_argument("pages", nargs="*", type=Path, help="default: README.md, docs/*.md")
    parser.add_argument("--run", action="store_true", help="execute the runnable blocks")
    parser.add_argument("--fast", action="store_true", help="skip blocks marked slow")
    parser.add_argument("--install", action="store_true",
                        help="run install steps too (a fresh venv; needs the package index)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folders")
    parser.add_argument("-v", "--verbose", action="store_true", help="details of ok blocks too")
    parser.add_argument("--paths", action="store_true",
                        help="only check that every code path and stoker.* name the pages "
                        "name exists (exit 1 naming those that do not)")
    args = parser.parse_args(argv)
    if args.paths:
        missing = [m for path in args.pages or [*pages(), *PATH_PAGES]
                   for m in missing_paths(path.resolve())]
        print("\n".join(missing) or "every code path the pages name exists")
        return 1 if missing else 0
    failed = 0
    for path in args.pages or pages():
        results = walk(path.resolve(), args.run, args.fast, args.install, args.keep)
        counts = {o: sum(r.outcome is o for r in results) for o in Outcome}
        print(f"== {_rel(path.resolve())}: " +
              ", ".join(f"{counts[o]} {o.value}" for o in Outcome), flush=True)
        for r in results:
            show = r.outcome is Outcome.FAILED or args.verbose
            detail = r.detail if show else r.detail.split("\n")[0][:150]
            print(f"  {r.block.where:<28} {r.block.kind.value:<7} {r.outcome.value:<8} {detail}")
        failed += counts[Outcome.FAILED]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
