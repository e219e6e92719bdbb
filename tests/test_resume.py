"""state_dict / load_state_dict resume exactly, and the epoch rules around them."""

from __future__ import annotations

import numpy as np
import pytest

from stoker.client import RemoteLoader
from stoker.server import ServerProcess


def loader(server: ServerProcess) -> RemoteLoader:
    return RemoteLoader(server.address, "toy", batch_size=8, seed=5, shuffle=True,
                        output="numpy", timeout=60)


def indices(batches: list[dict]) -> list[list[int]]:
    return [b["sample_index"].tolist() for b in batches]


def test_resume_mid_epoch_continues_with_the_next_batch(toy_server: ServerProcess) -> None:
    with loader(toy_server) as full:
        full.set_epoch(2)
        reference = indices(list(full))
    with loader(toy_server) as first:
        first.set_epoch(2)
        seen = []
        for batch in first:
            seen.append(batch)
            if len(seen) == 5:
                state = first.state_dict()
                break
    assert state["epoch"] == 2 and state["next_batch"] == 5
    with loader(toy_server) as resumed:
        resumed.load_state_dict(state)
        resumed.set_epoch(2)  # the usual loop calls it again: the position must survive
        rest = list(resumed)
    assert indices(seen) + indices(rest) == reference


def test_a_finished_epoch_moves_on_to_the_next(toy_server: ServerProcess) -> None:
    with loader(toy_server) as ld:
        first = indices(list(ld))
        assert ld.state_dict()["epoch"] == 1 and ld.state_dict()["next_batch"] == 0
        second = indices(list(ld))
        assert second != first and len(second) == len(first)
        flat = [i for batch in second for i in batch]
        assert len(set(flat)) == len(flat) == 8 * len(first)  # a whole epoch, no repeats
        ld.set_epoch(0)
        assert indices(list(ld)) == first  # an epoch's order is a function of (seed, epoch)


def test_state_saved_on_an_epochs_last_batch_resumes_at_the_next_epoch(toy_server
                                                                       ) -> None:
    with loader(toy_server) as ld:
        ld.set_epoch(3)
        for _ in ld:
            state = ld.state_dict()  # the last one is taken inside the epoch's last step
        following = indices(list(ld))
    assert (state["epoch"], state["next_batch"]) == (4, 0)
    with loader(toy_server) as resumed:
        resumed.load_state_dict(state)
        resumed.set_epoch(state["epoch"])
        assert indices(list(resumed)) == following


def test_state_dict_of_other_coordinates_is_refused(toy_server: ServerProcess) -> None:
    with loader(toy_server) as ld:
        state = ld.state_dict()
    other = RemoteLoader(toy_server.address, "toy", batch_size=4, output="numpy")
    try:
        other.load_state_dict(state)
    except ValueError as e:
        assert "coordinates" in str(e)
    else:
        raise AssertionError("load_state_dict accepted another loader's state")
    finally:
        other.close()


def test_stats_count_batches_bytes_and_waiting(toy_server: ServerProcess) -> None:
    with loader(toy_server) as ld:
        sizes = [sum(v.nbytes for v in b.values()) for b in ld]
        stats = ld.stats()
        assert stats["batches"] == len(sizes) == len(ld)
    assert stats["bytes"] >= sum(sizes)
    assert stats["wait_seconds"] > 0


def test_workers_do_not_change_the_batches(start_server) -> None:
    from conftest import TOY_DATASETS

    datasets = {"toy": TOY_DATASETS["toy"]}
    runs = []
    for workers in (1, 2):
        server = start_server(datasets, workers=workers)
        with RemoteLoader(server.address, "toy", batch_size=7, seed=3, output="numpy",
                          timeout=60) as ld:
            ld.set_epoch(4)
            runs.append([{k: v.copy() for k, v in b.items()} for b in ld])
    assert len(runs[0]) == len(runs[1]) > 0
    for a, b in zip(*runs, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key].dtype == b[key].dtype and np.array_equal(a[key], b[key]), key


def test_an_epoch_without_a_batch_is_an_error(toy_server: ServerProcess) -> None:
    """Issue 20 item 4: an epoch with no batch at all was a silent empty loop; now len() and
    iteration say so (tests/test_first_hour_client.py has the single-rank case)."""
    with RemoteLoader(toy_server.address, "toy", batch_size=8, rank=0, world_size=100,
                      output="numpy", timeout=60) as ld:
        for attempt in (len, list):
            with pytest.raises(ValueError, match="batch_size=8 with drop_last=True gives no "
                               "batch"):
                attempt(ld)


# -- resuming against other data (issue 19: "resume has the same blind spot") -----------------

def versioned(version: int) -> dict:
    return {"v": {"format": "python", "factory": "drift_datasets:Versioned",
                  "options": {"n": 64, "version": version}}}


def test_resume_against_other_data_is_refused_unless_asked(start_server, ledger) -> None:
    old, new = start_server(versioned(1)), start_server(versioned(2))
    with RemoteLoader(old.address, "v", batch_size=8, seed=5, output="numpy",
                      timeout=60) as ld:
        for n, _ in enumerate(ld, 1):
            if n == 3:
                state = ld.state_dict()
                break
    saved = state["fingerprint"]
    assert saved["digest"].startswith("sha256:") and saved["objects"] == 64
    with RemoteLoader(new.address, "v", batch_size=8, seed=5, output="numpy",
                      timeout=60) as ld:
        try:
            ld.load_state_dict(state)
        except ValueError as e:
            said = str(e)
        else:
            raise AssertionError("resumed against other data")
        assert "dataset 'v'" in said and saved["digest"][:19] in said, said
        assert "allow_changed_data=True" in said, said
        assert ld.state_dict()["next_batch"] == 0  # nothing of the refused state was taken
        ld.load_state_dict(state, allow_changed_data=True)
        rest = list(ld)
        assert len(rest) == 5 and {int(v) for b in rest for v in b["version"]} == {2}
        assert ld.state_dict()["fingerprint"]["digest"] != saved["digest"]
    ledger.record("clients", "resume from a state_dict saved against other data",
                  detail="ValueError, unless allow_changed_data=True")


def test_an_old_state_dict_without_a_fingerprint_resumes(start_server) -> None:
    server = start_server(versioned(1))
    with RemoteLoader(server.address, "v", batch_size=8, seed=5, output="numpy",
                      timeout=60) as ld:
        reference = indices(list(ld)[2:])
        state = {"coordinates": ld.state_dict()["coordinates"], "epoch": 0, "next_batch": 2}
    with RemoteLoader(server.address, "v", batch_size=8, seed=5, output="numpy",
                      timeout=60) as ld:
        ld.load_state_dict(state)
        assert indices(list(ld)) == reference
