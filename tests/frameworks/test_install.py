"""The frameworks' venv is one in which Lightning cannot trip over a broken torchvision."""

from __future__ import annotations

import importlib.util


def test_frameworks_import_and_torchvision_is_absent() -> None:
    # Lightning (through torchmetrics) imports torchvision whenever it is installed; the one
    # the dev extra brings is a CUDA build that fails beside the CPU torch.
    assert importlib.util.find_spec("torchvision") is None
    import accelerate
    import lightning
    import ray
    import transformers

    assert all(m.__version__ for m in (lightning, transformers, accelerate, ray))
