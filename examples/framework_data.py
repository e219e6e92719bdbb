"""The data the framework examples train on, and a stoker server for it.

    from framework_data import serve
    with serve(samples=256) as address:   # a data server on a free loopback port
        ...                               # RemoteLoader(address, "line", batch_size=8)

Dataset "line": sample i is a noisy point of one fixed linear map (`x`: 8 float32, `y`: 1
float32), a pure function of i, so a tiny model's loss falls within a few dozen steps. The
server loads it through `format: python` (this folder goes on its PYTHONPATH).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from stoker.server import ServerProcess, write_config

HERE = Path(__file__).resolve().parent
FEATURES = 8
WEIGHTS = np.linspace(-1.0, 1.0, FEATURES, dtype=np.float32)


class Line:
    """Map-style: `x` ~ N(0, 1)^8 and `y` = WEIGHTS . x + 0.1 N(0, 1), seeded by the index."""

    def __init__(self, n: int = 256) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(i)
        x = rng.standard_normal(FEATURES).astype(np.float32)
        y = np.float32(x @ WEIGHTS + 0.1 * rng.standard_normal())
        return {"x": x, "y": np.array([y], dtype=np.float32)}


def line(n: int = 256) -> Line:
    return Line(n)


@contextmanager
def serve(samples: int = 256, workers: int = 1) -> Iterator[str]:
    """A stoker server with dataset "line" of `samples` samples: its address while it runs.
    SystemExit if it does not stop cleanly (exit status 0) at the end."""
    with tempfile.TemporaryDirectory(prefix="stoker-example-") as tmp:
        config = write_config(Path(tmp) / "stoker.yaml", {"datasets": {"line": {
            "format": "python", "factory": "framework_data:line", "options": {"n": samples}}}})
        server = ServerProcess(config, workers=workers, env={"PYTHONPATH": str(HERE)})
        with server:
            yield server.address
            code = server.stop()
        if code != 0:
            raise SystemExit(f"FAILED: the data server exited {code}: {server.stderr}")
        print("server exit 0")
