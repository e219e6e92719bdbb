"""format: mixture through real servers: proportions over windows, components read without
replacement through their own epochs, the same sequence from 1 and 3 servers, resume, weight
schedules (and a changed one refused on resume), fields that do not agree."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stoker.client import RemoteLoader
from stoker.server import ConfigError, ServerProcess, load_config, write_config

from conftest import server_env

SIZES = {"a": 100, "b": 37, "c": 501}  # c: not a multiple of anything below
WEIGHTS = {"a": 0.5, "b": 0.3, "c": 0.2}
PERIOD = sum(SIZES.values())
OFFSETS = {"a": 0, "b": 100, "c": 137}
WORLD, BATCH = 2, 8  # a global batch: 16 samples


def component(n: int, name: str = "x") -> dict[str, Any]:
    return {"format": "python", "factory": "mixture_datasets:named",
            "options": {"n": n, "name": name}}


def schedule(from_sample: int) -> dict[str, Any]:
    return {"format": "mixture", "components": {"a": 1, "b": 1},
            "samples_per_epoch": 320, "schedule": [{"from_sample": from_sample,
                                                    "weights": {"b": 1}}]}


DATASETS: dict[str, Any] = {
    **{name: component(n) for name, n in SIZES.items()},
    "mix": {"format": "mixture", "components": WEIGHTS, "samples_per_epoch": 3200},
    "sched": schedule(480),  # in epoch 1, position 160 (global batch 30 at 16 a batch)
}


@pytest.fixture(scope="module")
def servers(start_server_module) -> list[ServerProcess]:
    return [start_server_module(DATASETS) for _ in range(3)]


def loader(address: str | list[str], dataset: str = "mix", rank: int = 0,
           world_size: int = WORLD, **kw: Any) -> RemoteLoader:
    return RemoteLoader(address, dataset, batch_size=BATCH, seed=3, shuffle=True, rank=rank,
                        world_size=world_size, output="numpy", timeout=60, **kw)


def global_order(address: str | list[str], dataset: str = "mix", epochs: int = 1
                 ) -> list[dict[str, np.ndarray]]:
    """The epochs' samples in position order (rank r's j-th sample is at r + j * WORLD), as
    batches of one global step each: {source, sample_index, x0}."""
    steps: list[dict[str, np.ndarray]] = []
    for epoch in range(epochs):
        per_rank = []
        for rank in range(WORLD):
            with loader(address, dataset, rank) as ld:
                ld.set_epoch(epoch)
                per_rank.append(list(ld))
        for batches in zip(*per_rank, strict=True):
            # Position order inside a global step: rank 0's first, rank 1's first, ...
            steps.append({k: np.stack([b[k] if k != "x" else b[k][:, 0] for b in batches],
                                      axis=1).reshape(-1) for k in ("source", "sample_index",
                                                                    "x")})
    return steps


def test_shares_hold_over_every_window_of_100_global_batches(servers) -> None:
    steps = global_order(servers[0].address)
    assert len(steps) == 3200 // (WORLD * BATCH) == 200
    sources = np.stack([s["source"] for s in steps])  # [step, 16]: rank 0's 8, then rank 1's
    names = list(WEIGHTS)
    weights = np.array(list(WEIGHTS.values()))
    per_step = np.stack([(sources == c).sum(axis=1) for c in range(len(names))], axis=1)
    window = 100
    worst = 0.0
    for start in range(len(steps) - window + 1):
        got = per_step[start:start + window].sum(axis=0)
        worst = max(worst, float(np.abs(got - window * WORLD * BATCH * weights).max()))
    # The bound: one sample a batch, 100 over 100 global batches. Positions are dealt
    # in permuted pieces of 256 (server/order/mixture.py), so a window is off by at most what its
    # two partial pieces draw differently from the shares: a few samples.
    assert worst <= 20, worst
    # Every rank's batches carry the shares too (not one phase of the splits' pattern).
    for rank in range(WORLD):
        mine = sources[:, rank * BATCH:(rank + 1) * BATCH].reshape(-1)
        share = np.bincount(mine, minlength=len(names)) / len(mine)
        assert np.abs(share - weights).max() < 0.03, (rank, share)


def test_components_are_read_without_replacement_through_their_own_epochs(servers) -> None:
    steps = global_order(servers[0].address, epochs=2)  # draws go on across mixture epochs
    source = np.concatenate([s["source"] for s in steps])
    index = np.concatenate([s["sample_index"] for s in steps])
    x0 = np.concatenate([s["x"] for s in steps])
    names = list(WEIGHTS)
    for c, name in enumerate(names):
        mine = source == c
        own_epoch, rest = np.divmod(index[mine], PERIOD)
        own = rest - OFFSETS[name]
        assert (x0[mine] == own).all()  # sample_index names the sample the batch holds
        n = SIZES[name]
        full = len(own) // n
        assert full >= 1 or name == "c"
        for e in range(full):  # the e-th n draws: one whole component epoch, its own order
            chunk = own[e * n:(e + 1) * n]
            assert sorted(chunk.tolist()) == list(range(n)), (name, e)
            assert (own_epoch[e * n:(e + 1) * n] == e).all()
            if e:
                assert chunk.tolist() != own[(e - 1) * n:e * n].tolist()
        tail = own[full * n:]
        assert len(set(tail.tolist())) == len(tail)
    # b (37 samples at 30%) wrapped many times in 6400 draws; c (501 at 20%) more than twice.
    assert (source == 1).sum() // SIZES["b"] >= 50


def test_one_server_and_three_give_the_same_sequence(servers) -> None:
    one = global_order(servers[0].address)
    three = global_order([s.address for s in servers])
    for a, b in zip(one, three, strict=True):
        for k in a:
            assert (a[k] == b[k]).all()


def test_stats_count_the_samples_handed_out_by_component(servers) -> None:
    with loader(servers[0].address, prefetch=4) as ld:
        it = iter(ld)
        got = [next(it)["source"].copy() for _ in range(5)]
        # Batches fetched ahead are not counted: only the 5 handed out.
        want = np.bincount(np.concatenate(got), minlength=len(WEIGHTS))
        counted = {c: n for c, n in ld.stats()["sources"].items() if n}
        assert counted == {c: int(n) for c, n in enumerate(want) if n}
        assert sum(ld.stats()["sources"].values()) == 5 * BATCH
    # The server's counts, in `stoker stats`: a line of component counts under the mixture.
    http = f"127.0.0.1:{servers[0].ready['http_port']}"
    out = subprocess.run([sys.executable, "-m", "stoker.server.cli", "stats", http],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    under = lines[next(i for i, ln in enumerate(lines) if ln.startswith("mix ")) + 1]
    assert all(f"{name} " in under for name in WEIGHTS) and "%)" in under, out.stdout


def test_resume_mid_epoch_continues_exactly(servers) -> None:
    with loader(servers[0].address, rank=1) as ld:
        ld.set_epoch(1)
        reference = [b["sample_index"].tolist() for b in ld]
    with loader(servers[1].address, rank=1) as ld:
        ld.set_epoch(1)
        batches = iter(ld)
        seen = [next(batches)["sample_index"].tolist() for _ in range(37)]
        state = ld.state_dict()
    with loader(servers[2].address, rank=1) as ld:
        ld.load_state_dict(state)
        rest = [b["sample_index"].tolist() for b in ld]
    assert seen + rest == reference


def test_a_schedule_changes_the_weights_at_its_sample(servers) -> None:
    steps = global_order(servers[0].address, "sched", epochs=2)
    source = np.concatenate([s["source"] for s in steps])
    index = np.concatenate([s["sample_index"] for s in steps])
    assert len(source) == 640
    before, after = source[:480], source[480:]
    assert abs(int((before == 0).sum()) - 240) <= 1 and (after == 1).all()
    # b's draws go on where they were: no b sample repeats before all 37 were used.
    b = index[source == 1] % 137 - 100  # sched: a then b, a period of 137
    for e in range(len(b) // 37):
        assert sorted(b[e * 37:(e + 1) * 37].tolist()) == list(range(37))


def test_a_changed_schedule_is_refused_on_resume(servers, start_server, ledger) -> None:
    with loader(servers[0].address, "sched") as ld:
        for n, _ in enumerate(ld, 1):
            if n == 3:
                state = ld.state_dict()
                break
    changed = start_server({**DATASETS, "sched": schedule(496)})
    with loader(changed.address, "sched") as ld:
        with pytest.raises(ValueError) as refused:
            ld.load_state_dict(state)
        said = str(refused.value)
        assert "dataset 'sched'" in said and state["fingerprint"]["digest"][:19] in said
        assert "allow_changed_data=True" in said
        ld.load_state_dict(state, allow_changed_data=True)
        assert ld.state_dict()["next_batch"] == 3
    # The same schedule on another server is the same data: the state loads.
    with loader(servers[1].address, "sched") as ld:
        ld.load_state_dict(state)
    ledger.record("clients", "resume a mixture whose weight schedule changed",
                  detail="ValueError naming the dataset, unless allow_changed_data=True")


def test_components_with_other_fields_need_renames(tmp_path: Path, ledger) -> None:
    datasets = {"a": component(10), "b": component(10, name="inputs"),
                "mix": {"format": "mixture", "components": {"a": 1, "b": 1}}}
    config = write_config(tmp_path / "bad.yaml", {"datasets": datasets})
    with pytest.raises(RuntimeError, match="did not become ready") as e:
        ServerProcess(config, workers=1, env=server_env()).start()
    line = next(x for x in str(e.value).splitlines() if "cannot start" in x)
    assert "dataset 'mix'" in line and "'a' has label, x; 'b' has inputs, label" in line, line
    assert "fields:" in line, line
    ledger.record("config", "mixture components whose fields differ",
                  detail="the server does not start; the message names both sets of fields")
    # Renamed to the common name, the same components serve.
    datasets["mix"]["components"] = {"a": 1, "b": {"weight": 1, "fields": {"x": "inputs"}}}
    config = write_config(tmp_path / "good.yaml", {"datasets": datasets})
    with ServerProcess(config, workers=1, env=server_env()) as server:
        with RemoteLoader(server.address, "mix", batch_size=4, output="numpy",
                          timeout=60) as ld:
            batch = next(iter(ld))
    assert set(batch) == {"x", "label", "source", "sample_index"}
    assert batch["x"].dtype == np.float32 and batch["source"].dtype == np.int64


@pytest.mark.parametrize(("mix", "said"), [
    ({"components": {"a": 1, "nope": 1}}, "'nope' is not a dataset of this config"),
    ({"components": {"a": 1, "inner": 1}}, "'inner' is a mixture"),
    ({"components": {"a": 0}}, "at least one weight must be > 0"),
    ({"components": {"a": 1}, "schedule": [{"from_sample": 10, "weights": {"b": 1}}]},
     "'b' not in components"),
    ({"components": {"a": 1}, "schedule": [{"from_sample": 10, "weights": {"a": 1}},
                                           {"from_sample": 10, "weights": {"a": 2}}]},
     "must be larger than the one before"),
    ({"components": {"a": -1}}, "greater than or equal to 0"),
], ids=["unknown", "nested", "zero", "schedule-name", "schedule-order", "negative"])
def test_config_errors_name_what_is_wrong(tmp_path: Path, mix: dict, said: str) -> None:
    datasets = {"a": component(10), "inner": {"format": "mixture", "components": {"a": 1}},
                "mix": {"format": "mixture", **mix}}
    config = write_config(tmp_path / "c.yaml", {"datasets": datasets})
    with pytest.raises(ConfigError, match="config error") as e:
        load_config(config)
    assert said in str(e.value), str(e.value)


@pytest.mark.parametrize(("before", "after", "steps"), [(2, 3, 50), (4, 3, 25), (2, 5, 50)])
def test_a_mixture_saved_at_n_ranks_goes_on_at_m_with_the_rest_of_its_positions(
        servers, ledger, before: int, after: int, steps: int) -> None:
    address = servers[0].address
    with loader(address, world_size=1) as ld:  # position p of epoch 2 is sample reference[p]
        ld.set_epoch(2)
        reference = np.concatenate([b["sample_index"] for b in ld])
    got: dict[int, int] = {}  # position -> sample_index
    for rank in range(before):  # `steps` global steps at `before` ranks, then stopped
        with loader(address, rank=rank, world_size=before) as ld:
            ld.set_epoch(2)
            batches = iter(ld)
            taken = np.concatenate([next(batches)["sample_index"] for _ in range(steps)])
            state = ld.state_dict()
        got.update(zip(range(rank, before * len(taken), before), taken.tolist(), strict=True))
    consumed = steps * BATCH * before
    for rank in range(after):  # every new rank loads the last rank's state: the job's position
        with loader(address, rank=rank, world_size=after) as ld:
            ld.load_state_dict(state)
            rest = np.concatenate([b["sample_index"] for b in ld])
        positions = range(consumed + rank, consumed + rank + after * len(rest), after)
        assert not got.keys() & set(positions)
        got.update(zip(positions, rest.tolist(), strict=True))
    # 3200 positions; what is left after the change divides by `after`: nothing is dropped.
    assert sorted(got) == list(range(len(reference)))
    lost, duplicated = ledger.compare(got.values(), reference.tolist())
    assert [got[p] for p in range(len(reference))] == reference.tolist()
    ledger.record("clients", f"a mixture resumed from {before} ranks at {after} mid-epoch",
                  tried=len(reference), lost=lost, duplicated=duplicated)
