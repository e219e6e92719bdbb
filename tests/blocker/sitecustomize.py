"""Makes the packages named in STOKER_TEST_BLOCK (comma-separated) impossible to import.

Put this folder first on PYTHONPATH: Python imports `sitecustomize` at start-up, in every
process, worker processes included. It proves a side of stoker runs without those packages.
"""

import os
import sys

_BLOCKED = {n for n in os.environ.get("STOKER_TEST_BLOCK", "").split(",") if n}


class _Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _BLOCKED:
            raise ModuleNotFoundError(f"{name} is blocked by the test (STOKER_TEST_BLOCK)")
        return None


if _BLOCKED:
    sys.meta_path.insert(0, _Blocker())
