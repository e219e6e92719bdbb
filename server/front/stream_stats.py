"""One stream's figures: what it counts in the server's metrics (under its dataset), and the
log's lines about it (opened, warned, closed), each naming the stream the same way.

Threading contract: a StreamStats belongs to one stream and runs on the server's one asyncio
loop (its reader and its sender both count here).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from stoker.v1.wire import capacity_metadata

from .refusal import WARNED

if TYPE_CHECKING:
    import grpc

    from stoker.v1 import stoker_pb2 as pb

    from ..order.sampling import Coordinates
    from .metrics import Metrics
    from .ready import FailedBatch, ReadyBatch

log = logging.getLogger("stoker.server")


class StreamStats:
    """Stream `stream_id`'s metrics and log lines. `dataset`: the one it is counted under
    (that of its latest coordinates; None before the first); `ended`: why it ended, once
    the sender knows."""

    def __init__(self, metrics: Metrics, stream_id: int, peer: str) -> None:
        self._metrics = metrics
        self.id = stream_id
        self._peer = peer
        self.dataset: str | None = None
        self._coords: Coordinates | None = None  # the latest coordinates accepted
        self._epochs: tuple[int, int] | None = None  # the first and last epoch asked for
        self._sent = self._failed = 0  # batches sent, batches answered with an error
        self._opened = time.monotonic()
        self.ended = ""

    def accepted(self, coords: Coordinates) -> None:
        """Coordinates passed: the log's lines name them from now on."""
        self._coords = coords
        self._epochs = (coords.epoch if self._epochs is None else self._epochs[0],
                        coords.epoch)

    def opened(self, label: str) -> None:
        """The handshake is over: the stream's first line, with its transport."""
        coords = self._coords
        assert coords is not None
        log.info("%s opened, by %s, %s", self.who(), label,
                 f"batch_tokens {coords.batch_tokens} ({coords.token_cost})"
                 if coords.batch_tokens else f"batch_size {coords.batch_size}")

    def count_under(self, dataset: str) -> None:
        """The stream is counted under `dataset` (open streams, by dataset)."""
        if dataset != self.dataset:
            if self.dataset is not None:
                self._metrics.streams.labels(self.dataset).dec()
            self._metrics.streams.labels(dataset).inc()
            self.dataset = dataset

    def report(self, report: pb.ClientReport) -> None:
        """The client's own figures (time waiting for batches, time in its loop)."""
        if self.dataset is not None:
            self._metrics.client_report(self.id, self.dataset, report.wait_seconds,
                                        report.loop_seconds)
            self._metrics.client_window(self.id, report.window, report.window_why,
                                        report.budget_batches)

    def capacity(self) -> tuple[tuple[str, str], ...]:
        """The stream's initial metadata that says what the server can do (stoker.proto,
        DescribeDatasetResponse.capacity)."""
        workers, rate = self._metrics.capacity()
        return capacity_metadata(workers, rate)

    def sent(self, batches: list[ReadyBatch], label: str) -> None:
        """Batches starting out by the transport `label`."""
        assert self.dataset is not None
        for b in batches:
            self._metrics.sent(self.dataset, b.batch.num_samples, b.batch.payload_bytes, label)
        self._sent += len(batches)

    def failed(self, item: FailedBatch) -> None:
        """A batch answered with an error."""
        self._failed += 1
        self._metrics.errors.labels(self.dataset, item.code.name.lower()).inc()
        if item.code in WARNED:
            log.warning("%s: batch %d of epoch %d answered %s: %s", self.who(),
                        item.batch_index, item.epoch, item.code.name,
                        item.detail or item.message)

    def refused(self, code: grpc.StatusCode, message: str) -> None:
        """The call ends with `code`."""
        self.ended = f"refused, {code.name}: {message}"
        if code in WARNED:
            log.warning("%s: refused, %s: %s", self.who(), code.name, message)

    def closed(self, draining: bool) -> None:
        """The stream is over: uncounted, and its last line."""
        if self.dataset is not None:
            self._metrics.streams.labels(self.dataset).dec()
        self._metrics.stream_ended(self.id)
        why = self.ended or ("cut by the server's shutdown" if draining
                             else "the client cancelled it (closed its loader, or went away)")
        log.info("%s closed after %.1f s: %d batches sent, %d failed; %s", self.who(),
                 time.monotonic() - self._opened, self._sent, self._failed, why)

    def who(self) -> str:
        """`stream 7 from ipv4:10.0.0.5:41234 (dataset 'faces', rank 0/8, epoch 3)`, or
        `..., epoch 3 from position 4096)` for coordinates with a start."""
        c, epochs = self._coords, self._epochs
        if c is None or epochs is None:
            return f"stream {self.id} from {self._peer}"
        epoch = f"epoch {epochs[0]}" if epochs[0] == epochs[1] else \
            f"epochs {epochs[0]}-{epochs[1]}"
        if c.start:  # an epoch resumed at another world_size or batch_size
            epoch += f" from position {c.start}"
        return (f"stream {self.id} from {self._peer} (dataset {c.dataset!r}, "
                f"rank {c.rank}/{c.world_size}, {epoch})")
