"""What a server counts, for /metrics (Prometheus text format) and /v1/stats.

One registry per server (not prometheus-client's global one), labelled by dataset. The
front end's event loop updates the counters; the HTTP thread reads them (prometheus-client's
metrics are thread-safe; the counters updated per batch are `Tally`s, sums the loop alone
writes and a scrape copies). Clients report their data stall (the share of their loop's time
spent waiting for batches) in their streams: the mean and the worst over the streams that
reported in the last minute are the autoscaling signal (docs/deployment.md); while no client
reports, those two series are absent (unknown), not 0.
"""

from __future__ import annotations

import bisect
import collections
import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

REPORT_TTL = 60.0  # seconds a client's stall report counts after it was sent
WINDOW = 10.0  # seconds over which /v1/stats computes live rates
# What was sent is summed per dataset in slots of SLOT seconds: the window holds WINDOW / SLOT
# slots a dataset whatever the rate (an entry a batch held 10 s of batches: megabytes at
# thousands a second, a size that followed the rate).
SLOT = 0.1


class Metrics:
    def __init__(self, status: Callable[[], dict[str, int]],
                 capacity: Callable[[], tuple[int, float]] = lambda: (0, 0.0)) -> None:
        # (workers, samples/s they build): what streams and /v1/stats say the server can do
        self.capacity = capacity
        self.registry = r = CollectorRegistry(auto_describe=True)
        # transport: frames (gRPC frames), data_socket, shm (lent in shared memory).
        self.batches = Tally("stoker_batches", "Batches sent, by transport: frames, "
                             "data_socket or shm", ["dataset", "transport"])
        self.samples = Tally("stoker_samples", "Samples sent", ["dataset"])
        self.bytes = Tally("stoker_payload_bytes", "Batch payload bytes sent (frames, "
                           "data_socket) or lent (shm)", ["dataset", "transport"])
        self.errors = Counter("stoker_batch_errors", "Batches answered with an error",
                              ["dataset", "kind"], registry=r)
        self.drawn = Counter("stoker_mixture_samples", "Samples of a mixture built, by "
                             "component", ["dataset", "component"], registry=r)
        self.skipped = Counter("stoker_skipped_samples", "Bad samples replaced under "
                               "on_error: skip", ["dataset"], registry=r)
        self.build = TallyHistogram("stoker_batch_build_seconds", "Worker time to build a "
                                    "batch", ["dataset"], BUILD_BUCKETS)
        self.busy = Tally("stoker_worker_busy_seconds", "Worker time spent building batches")
        self.streams = Gauge("stoker_active_streams", "Open batch streams", ["dataset"],
                             registry=r)
        # -- issue 41: who reads (a grant's name, never its token), and strangers on the
        # data port (by why their connection was closed: per_address and total are the
        # claim caps, late the claim's time, wrong a claim that matched no stream).
        self.grant_streams = Counter("stoker_grant_streams", "Batch streams opened, by the "
                                     "grant that opened them", ["grant"], registry=r)
        self.claims_dropped = Counter("stoker_data_claims_dropped", "Data-port connections "
                                      "closed unclaimed, by reason: per_address, total, "
                                      "late, wrong", ["reason"], registry=r)
        self.stall = Gauge("stoker_client_data_stall", "Mean data stall the clients report "
                           "(share of their loop time spent waiting for batches)",
                           ["dataset"], registry=r)
        self.stall_max = Gauge("stoker_client_data_stall_max", "Worst data stall a client "
                               "reports", ["dataset"], registry=r)
        self.reporting = Gauge("stoker_client_streams_reporting", "Streams whose client "
                               "reported a stall in the last minute", ["dataset"], registry=r)
        # -- issue 17, batches shared across jobs (server/front/shared_batches.py)
        self.shared = Tally("stoker_shared_batches", "Batches asked for, by how they were "
                            "had: built, joined (a build in flight for another stream) or "
                            "cached (kept from an earlier build)", ["dataset", "outcome"])
        self.shared_kept = Gauge("stoker_shared_kept_bytes", "Shared memory of the built "
                                 "batches kept for other jobs (cache.shared_batches)",
                                 registry=r)  # its value: set_function, by SharedBatches
        self.shared_lone = Gauge("stoker_shared_kept_lone_bytes", "Of the kept batches' shared "
                                 "memory, that of coordinates only one stream has asked for "
                                 "(at most 1/16 of cache.shared_batches)", registry=r)
        r.register(_Tallies([self.batches, self.samples, self.bytes, self.busy, self.shared,
                             self.build]))
        # -- end of "batches shared across jobs"
        workers = Gauge("stoker_workers", "Worker processes ready", registry=r)
        workers.set_function(lambda: status()["workers"])
        queued = Gauge("stoker_queued_batches", "Batches waiting for a worker", registry=r)
        queued.set_function(lambda: status()["queued"])
        building = Gauge("stoker_building_batches", "Batches handed to workers", registry=r)
        building.set_function(lambda: status()["building"])
        r.register(_PoolCounters(status))
        r.register(_PrefixCacheMetrics(os.getpid()))
        self._lock = threading.Lock()
        self._reports: dict[int, tuple[str, float, float]] = {}  # stream -> dataset, stall, t
        # stream -> its client's window: {"window", "why", "budget_batches"} (ClientReport)
        self._windows: dict[int, dict[str, Any]] = {}
        self._stall_datasets: set[str] = set()  # datasets that ever had a stall reported
        # [slot (monotonic time // SLOT), dataset, batches, samples, bytes], oldest first
        self._recent: collections.deque[list[Any]] = collections.deque()
        self._started = time.monotonic()

    # -- updates (the event loop) ------------------------------------------------------------
    def data_port(self, sockets: Any) -> None:
        """The data port's claims (front/data_listener.py): those waiting now, its caps, and
        each connection it closes unclaimed. `waiting` is read from the HTTP thread: the
        length of a dict the loop writes, a single read."""
        sockets.on_dropped = lambda why: self.claims_dropped.labels(why).inc()
        Gauge("stoker_data_claims_waiting", "Data-port connections that have not sent their "
              "claim yet", registry=self.registry).set_function(lambda: sockets.waiting)
        caps = Gauge("stoker_data_claims_limit", "Data-port connections that may wait to "
                     "claim, per address and in all (past either the oldest is closed)",
                     ["scope"], registry=self.registry)
        caps.labels("per_address").set(sockets.max_claims_per_host)
        caps.labels("total").set(sockets.max_claims)

    def sent(self, dataset: str, samples: int, nbytes: int, transport: str) -> None:
        """A batch went out; `transport`: its Transport's label."""
        self.batches.add((dataset, transport), 1)
        self.samples.add((dataset,), samples)
        self.bytes.add((dataset, transport), nbytes)
        now = time.monotonic()
        # No lock: only the loop changes _recent, and stats() copies it in one C call (a slot
        # it copies may still count a batch or two more: a rate, not a total).
        recent = self._recent
        slot = int(now / SLOT)
        for last in reversed(recent):  # this slot's entries (one a dataset) are the last ones
            if last[0] != slot:
                recent.append([slot, dataset, 1, samples, nbytes])
                break
            if last[1] == dataset:
                last[2] += 1
                last[3] += samples
                last[4] += nbytes
                break
        else:
            recent.append([slot, dataset, 1, samples, nbytes])
        while recent[0][0] * SLOT < now - WINDOW:
            recent.popleft()

    def built(self, dataset: str, seconds: float, skipped: int) -> None:
        self.build.observe((dataset,), seconds)
        self.busy.add((), seconds)
        if skipped:
            self.skipped.labels(dataset).inc(skipped)

    def shared_batch(self, dataset: str, outcome: str) -> None:
        """A stream got a batch: `outcome` built, joined or cached (front/shared_batches.py)."""
        self.shared.add((dataset, outcome), 1)

    def mixed(self, dataset: str, ordering: Any, indices: Any) -> None:
        """A batch of `indices` was built for `dataset`: for a mixture (an ordering with
        `names` and `counts`, server/order/mixture.py), count its samples by component."""
        counts = getattr(ordering, "counts", None)
        if counts is None:
            return
        for name, n in zip(ordering.names, counts(indices).tolist(), strict=True):
            if n:
                self.drawn.labels(dataset, name).inc(n)

    def client_report(self, stream: int, dataset: str, wait_s: float, loop_s: float) -> None:
        if not (math.isfinite(wait_s) and math.isfinite(loop_s)):
            return  # NaN: a NaN gauge, and null in /v1/stats where its schema says number
        stall = min(max(wait_s / loop_s, 0.0), 1.0) if loop_s > 0 else 0.0
        with self._lock:
            self._reports[stream] = (dataset, stall, time.monotonic())
        self._publish()

    def client_window(self, stream: int, window: int, why: str, budget_batches: int) -> None:
        """A client's window of batches in flight, as its stream last reported it."""
        if window > 0:
            with self._lock:
                self._windows[stream] = {"window": window, "why": why,
                                         "budget_batches": budget_batches}

    def stream_ended(self, stream: int) -> None:
        with self._lock:
            self._reports.pop(stream, None)
            self._windows.pop(stream, None)
        self._publish()

    def _publish(self) -> None:
        now = time.monotonic()
        by_dataset: dict[str, list[float]] = collections.defaultdict(list)
        with self._lock:
            for key, (dataset, stall, t) in list(self._reports.items()):
                if now - t > REPORT_TTL:
                    del self._reports[key]
                else:
                    by_dataset[dataset].append(stall)
            self._stall_datasets |= set(by_dataset)
            known = set(self._stall_datasets)
        for dataset in known:
            stalls = by_dataset.get(dataset, [])
            self.reporting.labels(dataset).set(len(stalls))
            if stalls:
                self.stall.labels(dataset).set(sum(stalls) / len(stalls))
                self.stall_max.labels(dataset).set(max(stalls))
            else:
                # No client reports: the stall is unknown, not 0 ("no stall" would let an
                # autoscaler scale down). An absent series is what Prometheus rules and
                # adapters treat as "no data" (NaN would poison avg() and comparisons).
                for gauge in (self.stall, self.stall_max):
                    try:
                        gauge.remove(dataset)
                    except KeyError:
                        pass

    # -- reads (the HTTP thread) -------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Live figures: rates over the last WINDOW seconds, by dataset."""
        self._publish()
        now = time.monotonic()
        recent = [x for x in list(self._recent) if x[0] * SLOT >= now - WINDOW]
        with self._lock:
            reports = dict(self._reports)
            windows = dict(self._windows)
        span = min(WINDOW, now - self._started) or 1.0
        out: dict[str, Any] = collections.defaultdict(
            lambda: {"batches_per_s": 0.0, "samples_per_s": 0.0, "bytes_per_s": 0.0})
        for _, dataset, batches, samples, nbytes in recent:
            d = out[dataset]
            d["batches_per_s"] += batches / span
            d["samples_per_s"] += samples / span
            d["bytes_per_s"] += nbytes / span
        for stream, (dataset, stall, _) in reports.items():
            out[dataset].setdefault("client_stalls", []).append(stall)
            if stream in windows:
                out[dataset].setdefault("client_windows", []).append(windows[stream])
        for metric in self.drawn.collect():  # since the start, not over the window
            for s in metric.samples:
                if s.name.endswith("_total"):
                    out[s.labels["dataset"]].setdefault("components", {})[
                        s.labels["component"]] = int(s.value)
        for metric in self.streams.collect():
            for s in metric.samples:
                if s.value or s.labels["dataset"] in out:
                    out[s.labels["dataset"]]["streams"] = int(s.value)
        workers, rate = self.capacity()
        return {"window_seconds": WINDOW, "datasets": dict(out),
                "capacity": {"workers": workers, "samples_per_second": rate}}


BUILD_BUCKETS = (.001, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 10)


class Tally:
    """A counter updated per batch: sums by label values, exposed like a prometheus Counter
    (`<name>_total`). A Counter's inc (its checks, a lock, a labelled child looked up) cost
    a few per cent of the front end's time at small batches; a dict update does not.
    One writer (the event loop); a scrape reads a copy (made in one C call, under the GIL)."""

    def __init__(self, name: str, doc: str, labels: list[str] | None = None) -> None:
        self.name, self.doc, self.labels = name, doc, labels or []
        self.sums: dict[tuple[str, ...], float] = {} if self.labels else {(): 0.0}

    def add(self, key: tuple[str, ...], amount: float) -> None:
        sums = self.sums
        sums[key] = sums.get(key, 0) + amount

    def family(self) -> CounterMetricFamily:
        family = CounterMetricFamily(self.name, self.doc, labels=self.labels)
        for key, value in list(self.sums.items()):
            family.add_metric(list(key), value)
        return family


class TallyHistogram:
    """A histogram updated per batch, as Tally is: counts by bucket, exposed like a
    prometheus Histogram."""

    def __init__(self, name: str, doc: str, labels: list[str],
                 buckets: tuple[float, ...]) -> None:
        self.name, self.doc, self.labels = name, doc, labels
        self.bounds = list(buckets)
        # key -> [count per bucket (the last: +Inf), sum]; the sum is its last item.
        self.counts: dict[tuple[str, ...], list[float]] = {}

    def observe(self, key: tuple[str, ...], value: float) -> None:
        counts = self.counts.get(key)
        if counts is None:
            counts = self.counts[key] = [0] * (len(self.bounds) + 1) + [0.0]
        counts[bisect.bisect_left(self.bounds, value)] += 1
        counts[-1] += value

    def family(self) -> HistogramMetricFamily:
        family = HistogramMetricFamily(self.name, self.doc, labels=self.labels)
        for key, counts in list(self.counts.items()):
            counts = list(counts)
            cumulative: list[tuple[str, float]] = []
            total = 0.0
            for bound, n in zip([*map(floatToGoString, self.bounds), "+Inf"], counts[:-1],
                                strict=True):
                total += n
                cumulative.append((bound, total))
            family.add_metric(list(key), cumulative, counts[-1])
        return family


class _Tallies:
    """The Tallies, for the registry."""

    def __init__(self, tallies: list[Tally | TallyHistogram]) -> None:
        self._tallies = tallies

    def describe(self) -> list[Any]:
        return [t.family() for t in self._tallies]

    def collect(self) -> Any:
        for t in self._tallies:
            yield t.family()


class _PoolCounters:
    """Counters the worker pool keeps itself (read from its status() at each scrape)."""

    def __init__(self, status: Callable[[], dict[str, int]]) -> None:
        self._status = status

    def describe(self) -> list[CounterMetricFamily]:
        return list(self.collect())

    def collect(self) -> Any:
        status = self._status()
        yield CounterMetricFamily("stoker_worker_timeouts", "Workers killed and replaced for "
                                  "a batch not built within batch_timeout_seconds",
                                  value=status.get("timeouts", 0))
        # The workers' disk cache (sources/cache.py), read from their shared counters: what
        # they did up to now, prefetches and failed builds included.
        yield CounterMetricFamily("stoker_cache_hits", "Remote objects read from the disk "
                                  "cache", value=status.get("cache_hits", 0))
        yield CounterMetricFamily("stoker_cache_misses", "Remote objects fetched into the "
                                  "disk cache", value=status.get("cache_misses", 0))
        yield CounterMetricFamily("stoker_cache_fetched_bytes", "Bytes fetched from remote "
                                  "storage into the disk cache",
                                  value=status.get("cache_fetched_bytes", 0))


class _PrefixCacheMetrics:
    """The prefix cache's counters (server/sources/prefix_cache.py), by tier: the workers keep them
    in shared files, read at each scrape. Absent while the server keeps no prefix cache."""

    def __init__(self, server_pid: int) -> None:
        self._pid = server_pid

    def describe(self) -> list[Any]:
        return []  # known only at a scrape: the cache may or may not be configured

    def collect(self) -> Any:
        from ..sources.prefix_cache import read_stats

        stats = read_stats(self._pid)
        if not stats:
            return
        tiers = ("memory", "disk")
        for what, doc in (("hits", "Prefixes read from the prefix cache"),
                          ("misses", "Prefixes looked for in the prefix cache and not found")):
            family = CounterMetricFamily(f"stoker_prefix_cache_{what}", f"{doc}, by tier",
                                         labels=["tier"])
            for tier in tiers:
                family.add_metric([tier], stats[f"{tier}_{what}"])
            yield family
        held = GaugeMetricFamily("stoker_prefix_cache_bytes", "Bytes the prefix cache holds, "
                                 "by tier", labels=["tier"])
        for tier in tiers:
            held.add_metric([tier], stats[f"{tier}_bytes"])
        yield held
