"""Which server computes which batch, and what happens when one fails: one epoch's pass.

The window [next, next + window) of batch indices is credited across the servers; each index
goes to the usable server with the fewest outstanding credits (ties: the lowest latency), so a
faster server, freeing its credits sooner, gets more. Batches are handed out in index order.

Exactly once rests on batches being pure functions of their coordinates: any index may be
asked of any server, any number of times, and the first answer wins. So:
- a stream that fails (server killed, draining, unreachable) puts its indices back, and they
  go to other servers; the failed server is retried with backoff;
- a server that holds credits and delivers nothing for a while is "stalled": its indices are
  asked of others too, and it gets no new ones until it delivers again;
- the index the loop waits on, outstanding too long at its server, is also asked of another
  server (a hedge); the duplicate that may follow is dropped;
- an in-band UNAVAILABLE (a draining server refusing new credits) sends that index elsewhere;
- an in-band INTERNAL (a worker died, or hung past the server's batch_timeout_seconds) is
  asked again of another usable server when there is one, else of the same one.
Errors that any server would repeat are raised: stream errors with a FATAL code, and in-band
batch errors other than UNAVAILABLE and (up to BATCH_RETRIES times) INTERNAL, e.g. DATA_LOSS.

Threading: take(), poll() and close() run on the loop's thread; receive threads call
_on_batch and _on_end. All state, the servers' included, is guarded by one condition variable.
Every decision reads the injected clock (time.monotonic by default), so a test can drive the
timing with a fake clock and fake streams (tests/test_scheduler.py).
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import grpc

from ._errors import RemoteError
from ._servers import Server, ServerSet, ServerState
from ._stream import BatchStream, StreamFactory, StreamSpec

# Codes every server would answer the same way: retrying elsewhere cannot help.
FATAL = {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT,
         grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAUTHENTICATED,
         grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNIMPLEMENTED,
         grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE}
BATCH_RETRIES = 2  # an INTERNAL batch error (a worker died) is tried this many more times
# A window widened for small batches (widen) credits new indices in groups of window // GROUPS.
GROUPS = 8
TICK = 0.1  # while the loop waits: how often to look for stalls, hedges, retries
HEDGE_MIN, STALL_MIN = 0.5, 2.0  # seconds


# Schedulers whose streams may be open. An iterator that is never closed is finalized during
# interpreter shutdown, after daemon threads stop where they stand: one may hold a gRPC call's
# lock, and cancelling that call then blocks for ever (seen as a trainer that never exits).
# So the streams are closed at exit, while the receive threads still run, and their servers'
# channels too: gRPC's own threads then end before shutdown, with no call's lock held (a
# client left with its channels open was once seen stuck in a call's __del__ at exit).
_OPEN: weakref.WeakSet[Scheduler] = weakref.WeakSet()


@atexit.register
def _close_open_schedulers() -> None:
    for scheduler in list(_OPEN):
        scheduler.close()
        scheduler.close_channels()


def group_for(window: int) -> int:
    """The credits a widened window asks for at once."""
    return max(1, window // GROUPS)


class Scheduler:
    """Batches [start, total) of one epoch, each asked of the servers with `spec`, at most
    `window` indices ahead of the loop, new ones `group` at a time while servers hold credits
    (see _assign); `timeout` s without progress is an error.

    `stream_factory` opens a stream to a server (BatchStream, or a test's fake); `clock` is
    the time every decision reads (seconds, monotonic)."""

    def __init__(self, servers: ServerSet, spec: StreamSpec, *, total: int, start: int,
                 window: int, timeout: float, group: int = 1,
                 stream_factory: StreamFactory = BatchStream,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._servers = servers
        self._spec = spec
        self._total = total
        self._next = start
        self._window = window
        self._group = group  # new credits are sent once this many are due (see _assign)
        self._timeout = timeout
        self._open_stream = stream_factory
        self._clock = clock
        self._cond = threading.Condition()
        self._ready: dict[int, Any] = {}
        self._holders: dict[int, set[Server]] = {}  # index -> servers asked for it
        self._hedged: set[int] = set()
        self._retries: dict[int, int] = {}
        self._fatal: RemoteError | None = None
        self._closed = False
        _OPEN.add(self)
        self._progress = clock()
        self.failovers = 0
        self.hedges = 0
        self.bytes_received = 0
        with self._cond:
            self._assign(clock())

    # -- the loop's side -------------------------------------------------------------------
    def report(self, wait_seconds: float, loop_seconds: float) -> None:
        """Send the loop's data stall to every server with an open stream."""
        with self._cond:
            streams = [s.stream for s in self._servers.servers.values() if s.stream is not None]
        for stream in streams:
            stream.report(wait_seconds, loop_seconds)

    def received(self) -> int:
        """Bytes received so far, by streams that ended and by those still open."""
        with self._cond:
            live = sum(s.stream.bytes_received for s in self._servers.servers.values()
                       if s.stream is not None)
            return self.bytes_received + live

    def take(self, index: int, on_wait: Callable[[], None] | None = None) -> Any:
        """Batch `index` (the next one), waiting while servers fail and come back for up to
        `timeout` seconds without progress; `on_wait()` is called every TICK while it waits
        (on this thread, under the lock: it may call report())."""
        with self._cond:
            started = self._clock()
            while not self.poll(index, started):
                self._cond.wait(TICK)
                if on_wait is not None:
                    on_wait()
            item = self._ready.pop(index)
            self._next = index + 1
            now = self._clock()
            # A loop that never waits must still see servers join and leave a dns name.
            self._servers.refresh(now)
            self._assign(now)
        if isinstance(item, RemoteError):
            raise item
        return item

    def poll(self, index: int, waiting_since: float) -> bool:
        """One look while the loop waits for batch `index` (take() calls it every TICK; a
        test calls it after moving its clock): True once the batch is ready; else raise a
        fatal error, or UNAVAILABLE after `timeout` s without progress, or look for stalls,
        hedges and retries."""
        with self._cond:
            if index in self._ready:
                return True
            if self._fatal is not None:
                raise self._fatal
            now = self._clock()
            # Time the loop spent elsewhere (evaluation, a checkpoint) does not count.
            if now - max(self._progress, waiting_since) > self._timeout:
                raise self._no_server(index)
            self._maintain(now, index)
            return False

    def close(self) -> None:
        _OPEN.discard(self)
        with self._cond:
            self._closed = True
            streams = [s.stream for s in self._servers.servers.values() if s.stream]
            for server in self._servers.servers.values():
                server.stream = None
                server.outstanding.clear()
        for stream in streams:
            stream.close()  # its receive thread reports on_end, which counts its bytes

    def close_channels(self) -> None:
        """Close every server's channel (at exit: nothing is asked of them after)."""
        self._servers.close()

    def servers_now(self) -> str:
        """Every server, its state and last error (for errors and log lines)."""
        with self._cond:
            return "; ".join(
                f"{s.address}: {s.state.value}, last error: {s.last_error or 'none'}"
                + (f", last refusal: {s.refused}" if s.refused else "")
                for s in self._servers.servers.values())

    def _no_server(self, index: int) -> RemoteError:
        return RemoteError(grpc.StatusCode.UNAVAILABLE,
                           f"no server delivered batch {index} within {self._timeout:g}s of the "
                           f"last progress ({self.servers_now()})", self._servers.describe())

    # -- scheduling (under the lock) -------------------------------------------------------
    def _maintain(self, now: float, waiting_for: int) -> None:
        self._servers.refresh(now)
        for s in self._servers.servers.values():
            if s.outstanding and s.up:
                patience = max(STALL_MIN, 10 * (s.latency or 0.0))
                if now - s.last_progress > patience:
                    s.mark_stalled()  # ask others for what it holds
                    self.failovers += 1
        self._assign(now)
        # Hedge the batch the loop is waiting for.
        holders = self._holders.get(waiting_for, set())
        if waiting_for not in self._hedged and holders:
            asked = min(s.outstanding.get(waiting_for, now) for s in holders)
            fastest = min((s.latency for s in self._servers.servers.values()
                           if s.latency is not None), default=0.0)
            if now - asked > max(HEDGE_MIN, 4 * fastest):
                if self._credit(waiting_for, now, exclude=holders):
                    self._hedged.add(waiting_for)
                    self.hedges += 1

    def widen(self, window: int) -> None:
        """Keep up to `window` batches in flight from now on (more than before), and ask
        for new ones in groups (see _assign)."""
        with self._cond:
            if window > self._window:
                self._window = window
                self._group = group_for(window)
                self._assign(self._clock())

    def _assign(self, now: float) -> None:
        """Credit every index in the window that no live server holds. In a widened window,
        new indices go in groups while servers still hold credits: a server handles a
        record of several credits in one go (its workers take them in one message, and
        their batches come back in one write), which is most of a small batch's cost."""
        if self._closed:
            return
        end = min(self._next + self._window, self._total)
        new: list[int] = []
        ready, held, up = self._ready, self._holders, ServerState.UP
        for index in range(self._next, end):  # per batch taken: no call but the lookups
            if index in ready:
                continue
            holders = held.get(index)
            if holders is None:
                new.append(index)
                continue
            for s in holders:
                if s.state is up:
                    break
            else:  # no holder is up: failed over, at once
                self._credit(index, now, exclude=holders)
        if (new and len(new) < self._group and end < self._total and new[0] != self._next
                and any(s.outstanding for s in self._servers.servers.values() if s.up)):
            return  # batches come back soon, and this is called again
        records: dict[BatchStream, list[int]] = {}
        for index in new:
            self._credit(index, now, exclude=set(), records=records)
        for stream, indices in records.items():
            stream.credit(indices)

    def _credit(self, index: int, now: float, exclude: set[Server],
                records: dict[BatchStream, list[int]] | None = None) -> bool:
        """Ask the best usable server for batch `index`: at once, or, given `records`, by
        adding it to that server's stream's record (the caller sends them)."""
        candidates = [s for s in self._servers.servers.values()
                      if s not in exclude and s.usable(now)]
        if not candidates:
            return False
        server = min(candidates, key=lambda s: (len(s.outstanding), s.latency or 0.0))
        if server.stream is None:
            server.mark_up(self._open_stream(server.channel, server.address, self._spec,
                                             self._on_batch, self._on_end))
        if not server.outstanding:
            server.last_progress = now  # patience runs from when it has work
        server.outstanding[index] = now
        self._holders.setdefault(index, set()).add(server)
        if records is None:
            server.stream.credit([index])
        else:
            records.setdefault(server.stream, []).append(index)
        return True

    def _server_of(self, stream: BatchStream) -> Server | None:
        server = self._servers.servers.get(stream.address)
        return server if server is not None and server.stream is stream else None

    # -- receive threads -------------------------------------------------------------------
    def _on_batch(self, stream: BatchStream, index: int, item: Any) -> None:
        with self._cond:
            server = self._server_of(stream)
            if server is None or self._closed:
                return  # a stream we already gave up on
            now = self._clock()
            server.mark_delivered(index, now)
            if isinstance(item, RemoteError) and item.code == grpc.StatusCode.UNAVAILABLE:
                server.mark_draining(item.details)  # it refuses new credits: send none
            if server.state is ServerState.DRAINING and not server.outstanding:
                # Done with what it took: let go, so its shutdown need not wait for us.
                server.mark_drained(now)
                stream.close(wait=False)
            if index < self._next or index in self._ready:
                return  # a duplicate: another server answered first
            retry = isinstance(item, RemoteError) and (
                item.code == grpc.StatusCode.UNAVAILABLE or (
                    item.code == grpc.StatusCode.INTERNAL
                    and self._retries.get(index, 0) < BATCH_RETRIES))
            if retry:
                holders = self._holders.get(index, set())
                holders.discard(server)
                if item.code == grpc.StatusCode.INTERNAL:
                    self._retries[index] = self._retries.get(index, 0) + 1
                    # Whatever broke there (a worker that died or hung) may break again:
                    # another server first; _assign falls back on this one if none is usable.
                    if not any(s.up for s in holders):
                        self._credit(index, now, exclude={server})
                self._assign(now)
                return
            server.batches += 1
            self._ready[index] = item
            self._holders.pop(index, None)
            self._progress = now
            if index == self._next:  # the one take() waits for; one further on lets it sleep
                self._cond.notify_all()

    def _on_end(self, stream: BatchStream, error: RemoteError | None) -> None:
        with self._cond:
            self.bytes_received += stream.bytes_received
            server = self._server_of(stream)
            if server is None or self._closed or error is None:
                return
            if error.code in FATAL:
                self._fatal = error
                self._cond.notify_all()
                return
            now = self._clock()
            for index in server.outstanding:
                self._holders.get(index, set()).discard(server)
            if server.outstanding:
                self.failovers += 1
            server.outstanding.clear()
            server.mark_down(error, now)
            self._assign(now)
            self._cond.notify_all()

