"""A worker keeps the memory a sample freed for the next one (server/pool/malloc.py): making a
sample's arrays, hundreds of KiB each, does not fault their pages in again sample after
sample."""

from __future__ import annotations

import statistics

import numpy as np

from stoker.client import RemoteLoader

SAMPLE_KIB, BATCH, BATCHES = 588, 16, 24  # an image pipeline's float32 224x224x3 samples
PAGES_PER_SAMPLE = SAMPLE_KIB // 4


def test_a_worker_makes_each_sample_without_faulting_its_pages_in_again(
        start_server) -> None:
    server = start_server({"f": {"format": "python", "factory": "toy_datasets:Faults",
                                 "options": {"n": BATCH * BATCHES, "kib": SAMPLE_KIB}}},
                          workers=1)
    faults = []
    with RemoteLoader(server.address, "f", batch_size=BATCH, shuffle=False, output="numpy",
                      shared_memory=False, timeout=30) as loader:
        for k, batch in enumerate(loader):
            assert len(set(batch["pid"].tolist())) == 1  # one worker built it
            assert np.array_equal(batch["block"][:, 0], np.arange(k * BATCH, (k + 1) * BATCH))
            faults.append(int(batch["minflt"].sum()))
    assert len(faults) == BATCHES
    # Each sample's 4 arrays: glibc's default gives the heap's freed top back to the kernel
    # after each sample (more than twice the largest array), and the next sample faults
    # every page in again (4 x PAGES_PER_SAMPLE a sample); kept, they fault none once warm.
    steady = statistics.median(faults[2:])
    assert steady < BATCH * 4 * PAGES_PER_SAMPLE / 20, faults
