"""A stoker fleet on a real local Ray cluster: servers as actors, killed, scaled, autoscaled,
and Ray Train workers reading from it.

One Ray cluster for the module (starting one takes seconds). Each test starts its own fleet
of real `stoker serve` processes inside Ray actors, reads with a real RemoteLoader through
`resolve` (the fleet's address book, no DNS) and compares the sample_index sequence element
for element with the sampling rule's. Faults land at a batch index of the loop, not after a
sleep.
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray

from stoker.client import RemoteLoader
from stoker.integrations.ray import Fleet, Policy, resolve

pytestmark = [pytest.mark.timeout(120),
              # Ray Train imports Ray Data, whose DataContext warns about its own defaults.
              pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.data.context")]

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
CPUS = 8  # logical: Ray's bookkeeping, not this machine's cores
ENV = {"PYTHONPATH": str(TESTS)}  # the servers load tests/toy_datasets.py
N = 200  # 100 batches of 2; 5 ms a sample, so that faults land mid-epoch
CONFIG = {"server": {"grace_seconds": 2}, "datasets": {
    "toy": {"format": "python", "factory": "toy_datasets:toy",
            "options": {"n": N, "delay": 0.005}},
    "endless": {"format": "python", "factory": "toy_datasets:toy",
                "options": {"n": 100_000, "delay": 0.01}}}}
KW = dict(batch_size=2, seed=7, shuffle=True, order="legacy",
          output="numpy", prefetch=6, timeout=60,
          resolver=resolve, dns_refresh=0.1)


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    # "cpu_node": a custom resource marking the nodes data servers belong on.
    ray.init(num_cpus=CPUS, resources={"cpu_node": 3}, include_dashboard=False,
             logging_level="WARNING")
    yield
    ray.shutdown()


@pytest.fixture
def fleet(cluster: None) -> Iterator[Callable[..., Fleet]]:
    made: list[Fleet] = []

    def start(servers: int, name: str, **options: Any) -> Fleet:
        made.append(Fleet(CONFIG, servers=servers, workers=1, name=name, env=ENV,
                          **options).start())
        return made[-1]

    yield start
    for f in made:
        f.close()


def reference() -> list[list[int]]:
    order = np.random.default_rng([KW["seed"], 0]).permutation(N)
    return [order[i : i + 2].tolist() for i in range(0, N, 2)]


def read(fleet: Fleet, step: Callable[[int, RemoteLoader], None] | None = None
         ) -> tuple[list[list[int]], dict[str, Any]]:
    """One epoch through the fleet's target; step(k, loader) runs after batch k."""
    got = []
    with RemoteLoader(fleet.target, "toy", **KW) as loader:
        for k, batch in enumerate(loader):
            got.append(batch["sample_index"].tolist())
            if step is not None:
                step(k, loader)
        return got, loader.stats()


def record(ledger, case: str, got: list[list[int]]) -> None:
    flat = [i for b in got for i in b]
    lost, dup = ledger.compare(flat, [i for b in reference() for i in b])
    ledger.record("servers", case, lost=lost, duplicated=dup)
    assert lost == dup == 0


def test_two_server_actors_serve_an_epoch_exactly_on_the_cpus_they_ask_for(fleet) -> None:
    f = fleet(2, "two", actor_options={"resources": {"cpu_node": 1}})
    free = ray.available_resources()
    assert free.get("CPU", 0) == CPUS - 2 * 2  # each: its worker + its front end
    assert free.get("cpu_node", 0) == 3 - 2  # each on a node that has the marker
    ip = ray.util.get_node_ip_address()
    assert len(f.addresses) == 2 and all(a.startswith(f"{ip}:") for a in f.addresses)
    assert resolve(f.target) == f.addresses
    got, stats = read(f)
    assert got == reference()
    assert all(stats["servers"][a]["batches"] > 0 for a in f.addresses), stats


def test_an_actor_killed_mid_epoch_loses_and_repeats_nothing(fleet, ledger) -> None:
    f = fleet(2, "kill")
    victim = f.servers[0]
    got, stats = read(f, lambda k, _: ray.kill(victim.actor) if k == 5 else None)
    record(ledger, "ray.kill one of 2 server actors mid-epoch", got)
    assert got == reference()
    # The server died with its actor (not a process left holding its port): the loader saw
    # it fail, and the fleet drops it.
    assert stats["servers"][victim.address]["state"] != "up", stats
    assert f.prune() == [victim.address]
    assert f.addresses == [f.servers[0].address] and resolve(f.target) == f.addresses


def test_scaled_to_3_and_drained_back_to_1_while_a_loader_reads(fleet, ledger) -> None:
    f = fleet(1, "scale")
    first = f.addresses[0]
    up, drained = threading.Event(), threading.Event()
    codes: list[int] = []
    errors: list[BaseException] = []

    def in_background(work: Callable[[], None], done: threading.Event) -> Callable[[], None]:
        def run() -> None:
            try:
                work()
            except BaseException as e:
                errors.append(e)
            finally:
                done.set()
        return lambda: threading.Thread(target=run, daemon=True).start()

    added: list[str] = []
    drain_at: list[int] = []

    def step(k: int, loader: RemoteLoader) -> None:
        if k == 5:
            in_background(lambda: added.extend(f.scale(3)), up)()  # type: ignore[arg-type]
        elif k == 30:
            assert up.wait(60)
        elif k > 30 and not drain_at:  # drain once the loader reads from all 3
            used = {a for a, s in loader.stats()["servers"].items() if s["batches"]}
            if set(added) <= used:
                drain_at.append(k)
                in_background(lambda: codes.extend(f.scale(1)), drained)()  # type: ignore
        elif drain_at and k == drain_at[0] + 20:
            assert drained.wait(60)  # the drain ended while the epoch still runs

    got, stats = read(f, step)
    assert drain_at and drain_at[0] + 20 < len(got) - 1, (drain_at, stats)
    assert up.is_set() and drained.is_set() and not errors, errors
    record(ledger, "scale 1 -> 3 -> 1 server actors (drain) mid-epoch", got)
    assert got == reference()
    assert len(added) == 2 and codes == [0, 0]  # drained cleanly: SIGTERM, exit 0
    assert f.addresses == [first] and resolve(f.target) == [first]
    assert all(stats["servers"][a]["batches"] > 0 for a in [first, *added]), stats


def test_autoscale_adds_a_server_when_the_trainer_stalls(fleet) -> None:
    """`stoker autoscale`'s loop on the actors: a trainer that waits for every batch makes
    the fleet grow to max_servers, and reads from the server added."""
    f = fleet(1, "auto")
    trace: list[dict[str, Any]] = []
    grew = threading.Event()

    def seen(row: dict[str, Any]) -> None:
        trace.append(row)
        if row["action"] == "add":
            grew.set()

    f.autoscale(Policy(target=0.05, min_servers=1, max_servers=2, cooldown=2, window=1.5),
                interval=0.25, trace=seen)
    with RemoteLoader(f.target, "endless", batch_size=4, shuffle=False, output="numpy",
                      prefetch=4, resolver=resolve, dns_refresh=0.1) as loader:
        expected = 0
        for batch in loader:  # no compute: the loop waits for every batch (stall ~100%)
            assert batch["sample_index"].tolist() == list(range(expected, expected + 4))
            expected += 4
            used = [a for a, s in loader.stats()["servers"].items() if s["batches"]]
            if len(used) == 2:
                break
            assert expected < 20_000, trace
    f.stop_autoscale()
    assert grew.is_set() and len(f.addresses) == 2, trace
    assert set(used) == set(f.addresses)
    assert not any(r["action"] == "remove" for r in trace), trace


def test_bad_fleets_are_refused_with_what_was_wrong(fleet) -> None:
    with pytest.raises(ValueError, match="workers must be an int >= 1"):
        Fleet(CONFIG, workers=0)
    with pytest.raises(ValueError, match="'max_restarts' is the fleet's to set"):
        Fleet(CONFIG, actor_options={"max_restarts": 3})
    with pytest.raises(ValueError, match="no stoker fleet named 'nowhere'"):
        RemoteLoader("dns:///nowhere:0", "toy", batch_size=2, resolver=resolve)
    f = fleet(1, "taken")
    with pytest.raises(ValueError, match="a stoker fleet named 'taken' runs already"):
        Fleet(CONFIG, name="taken").start()
    assert len(f.addresses) == 1
    with pytest.raises(RuntimeError, match="did not start within"):  # Ray cannot place it
        Fleet(CONFIG, workers=CPUS, name="too-big", start_timeout=2).start()
    with pytest.raises(RuntimeError, match="a stoker server actor did not start"):
        Fleet({"datasets": {}}, name="no-data", env=ENV).start()


def test_the_ray_train_example_reads_every_sample_once_from_the_fleet(cluster, capsys) -> None:
    spec = importlib.util.spec_from_file_location("ray_train", ROOT / "examples" / "ray_train.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--samples", "256", "--epochs", "2", "--fleet", "example"]) == 0
    out = capsys.readouterr().out
    assert "2 Ray Train workers, 16 steps each, 512 samples read: 0 lost, 0 duplicated" in out
    assert "server exit codes [0, 0]" in out
