"""uv's arguments for pip's configuration: `python tools/uv_args.py` prints them (one shell line).

The Makefile installs with uv (`uv pip install`), which reads no pip.conf and no PIP_*
variable. A machine's pip configuration can be what makes an install right: this kind of
machine keeps torch 2.13.0's CPU build in a find-links folder, and caps versions with a
constraints file. So pip's settings that choose what gets installed are passed on, as `pip
config list` shows them: its index URL, extra index URLs, find-links and constraint files, and
the system's certificates where pip was given a certificate file. Run by the venv's Python
(the one whose pip is asked).
"""

from __future__ import annotations

import ast
import shlex
import subprocess
import sys

# pip's option -> uv's flag. Each list-valued option's values from every source are passed
# (a superset where the environment overrides a file: only ever more places to look).
LISTS = {"extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint"}
# Sections that apply to `pip install` (":env:" is a PIP_* variable).
SECTIONS = {":env:", "global", "install"}


def uv_args(listing: str) -> list[str]:
    """The uv flags for `pip config list`'s output."""
    args: list[str] = []
    index: dict[str, str] = {}
    cert = False
    for line in listing.splitlines():
        key, sep, raw = line.partition("=")
        section, _, name = key.rpartition(".")
        if not sep or section not in SECTIONS:
            continue
        value = ast.literal_eval(raw)
        if name in LISTS:
            for item in value.split():
                if item not in args:
                    args += [LISTS[name], item]
        elif name == "index-url":
            index[section] = value
        elif name == "cert":
            cert = True
    if index:  # the environment's wins, as in pip
        args += ["--index-url", index.get(":env:") or index.get("install") or index["global"]]
    if cert:
        args.append("--native-tls")  # the system's CA store, where pip was given a CA file
    return args


def main() -> int:
    listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                             capture_output=True, text=True, check=True).stdout
    print(shlex.join(uv_args(listing)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
