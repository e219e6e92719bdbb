"""A `format: python` dataset whose failures name a server path, for server.redact_paths."""

from __future__ import annotations

import numpy as np

SECRET_FOLDER = "/srv/team-secret/raw-data"


class Leaky:
    def __init__(self, n: int = 8, fail_at: int = 4) -> None:
        self.n, self.fail_at = n, fail_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if i == self.fail_at:
            raise OSError(f"cannot read {SECRET_FOLDER}/shard-{i:05d}.bin: truncated")
        return {"x": np.full(4, i, dtype=np.float32)}
