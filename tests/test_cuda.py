"""The GPU feed: pinned buffers, side-stream copies. CUDA-only parts skip without CUDA."""

from __future__ import annotations

import pytest
import torch

from stoker.client import RemoteLoader

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_asking_for_cuda_without_it_is_a_clear_error(toy_server) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        RemoteLoader(toy_server.address, "toy", batch_size=4, device="cuda")


def test_a_device_that_is_not_cuda_is_refused(toy_server) -> None:
    with pytest.raises(ValueError, match="must be a CUDA device"):
        RemoteLoader(toy_server.address, "toy", batch_size=4, device="meta")


def test_device_cpu_means_host_tensors(toy_server) -> None:
    with RemoteLoader(toy_server.address, "toy", batch_size=4, device="cpu", timeout=60) as ld:
        batch = next(iter(ld))
    assert batch["x"].device.type == "cpu"


@pytest.mark.cuda
@needs_cuda
def test_cuda_batches_equal_host_batches_and_reuse_pinned_buffers(toy_server) -> None:
    kw = dict(batch_size=8, seed=1, timeout=60, prefetch=3)
    with RemoteLoader(toy_server.address, "toy", **kw) as host:
        expected = list(host)
    with RemoteLoader(toy_server.address, "toy", device="cuda", **kw) as gpu:
        got = []
        for batch in gpu:
            assert all(t.is_cuda for t in batch.values())
            # Work on the consumer's stream: it must see the copied data.
            got.append({k: v.clone().cpu() for k, v in batch.items()})
        allocations = gpu.stats()["pinned_allocations"]
    torch.cuda.synchronize()
    assert len(got) == len(expected)
    for a, b in zip(expected, got, strict=True):
        for key in a:
            assert torch.equal(a[key], b[key]), key
    assert allocations <= kw["prefetch"] + 2  # reused, not one per batch


@pytest.mark.cuda
@needs_cuda
def test_uint8_normalized_on_the_gpu_equals_normalized_on_the_host(toy_server) -> None:
    # toy's `tokens` field is uint8 [2, 3]: 2 "channels" first, normalised per channel.
    kw = dict(batch_size=8, seed=1, timeout=60, normalize={"tokens": ((0.5, 0.25), (0.2, 0.4))})
    with RemoteLoader(toy_server.address, "toy", **kw) as host:
        expected = [b["tokens"] for b in host]
    with RemoteLoader(toy_server.address, "toy", device="cuda", **kw) as gpu:
        got = [b["tokens"].clone().cpu() for b in gpu]
    torch.cuda.synchronize()
    assert got[0].dtype == torch.float32
    for a, b in zip(expected, got, strict=True):
        assert torch.allclose(a, b, atol=1e-5)
