"""tools/uv_args.py: the Makefile's uv installs get pip's configuration (uv reads none)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from uv_args import uv_args  # tools/uv_args.py


def test_pip_settings_that_choose_packages_become_uv_flags() -> None:
    listing = "\n".join([
        ":env:.find-links='/opt/wheels'",
        ":env:.index-url='https://mirror.example/simple'",
        ":env:.default-timeout='180'",
        "global.cert='/etc/ssl/certs/ca-certificates.crt'",
        "global.constraint='/etc/xdg/pip/constraints.txt'",
        "global.extra-index-url='file:///opt/a/simple file:///opt/b/simple'",
        "global.find-links='/opt/wheels'",
        "global.index-url='https://pypi.org/simple'",
        "download.find-links='/elsewhere'",  # not `pip install`'s section
    ])
    assert uv_args(listing) == [
        "--find-links", "/opt/wheels", "--constraint", "/etc/xdg/pip/constraints.txt",
        "--extra-index-url", "file:///opt/a/simple", "--extra-index-url", "file:///opt/b/simple",
        "--index-url", "https://mirror.example/simple", "--native-tls"]
    assert uv_args("") == []
