"""Regenerate the Python code for protos/stoker/v1/*.proto, in place.

Run: python protos/generate.py            (writes the generated files)
     python protos/generate.py --check    (exits 1 when the committed files are stale)

The .proto's folder path (stoker/v1) equals its Python import path (stoker.v1), so the
generated `_pb2_grpc.py` finds its sibling with `from stoker.v1 import stoker_pb2`.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTOS = sorted((HERE / "stoker" / "v1").glob("*.proto"))


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc

    args = [
        "protoc",
        f"-I{HERE}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *[str(p.relative_to(HERE)) for p in PROTOS],
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed: {' '.join(args)}")
    return sorted(p.relative_to(out) for p in out.rglob("*_pb2*.py*"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    check = parser.parse_args().check
    if not check:
        for rel in generate(HERE):
            print(f"wrote protos/{rel}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        stale = [
            rel for rel in generate(Path(tmp))
            if not (HERE / rel).exists() or not filecmp.cmp(Path(tmp) / rel, HERE / rel, False)
        ]
    for rel in stale:
        print(f"stale: protos/{rel} (run: python protos/generate.py)", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
