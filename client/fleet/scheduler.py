"""Which server computes which batch, and what happens when one fails: one epoch's pass.
The window [next, next + window) is credited as fleet/policy.py decides and fleet/credits.py
applies (a take's credits held a moment: fleet/hold.py); batches go out in index order.

Exactly once rests on batches being pure functions of their coordinates: any index may be
asked of any server, any number of times, and the first answer wins. So: a stream that fails
(killed, draining, unreachable) puts its indices back, for other servers, and its server is
retried with backoff; a server that holds credits and delivers nothing for a while is
"stalled": its indices go to others too, and it gets no new ones but a probe (PROBE_EVERY: a
partition may heal); a hedged batch's duplicate is dropped; an in-band UNAVAILABLE (a draining
server) sends that index elsewhere; an in-band INTERNAL (a worker died, or hung past the
server's batch_timeout_seconds) is asked again of another usable server, else of the same one.
Errors any server would repeat are raised: stream errors with a FATAL code, and in-band batch
errors other than UNAVAILABLE and (up to BATCH_RETRIES times) INTERNAL, e.g. DATA_LOSS.

Epochs: a scheduler serves the loop's epoch and, told of it (`then`), the next one, whose first
batches it asks for while the loop ends the current one (fleet/passes.py: each epoch its own
streams). The loop moves on with `follow`; batches of an epoch it does not move on to are
dropped at close() and counted (`dropped`).

Threading: take(), poll(), then(), follow() and close() run on the loop's thread; receive
threads call _on_batch and _on_end; one condition guards all state, the servers' too. The
injected clock is what decisions read: a test drives them with a fake clock and streams.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from .._errors import RemoteError
from ..transport.stream import BatchStream, Stream, StreamFactory, StreamSpec
from . import policy
from .credits import LATE_EVERY, Credits
from .hold import CreditHold
from .passes import Pass, Passes
from .policy import FATAL
from .servers import Server, ServerSet
from .window import Fleet

BATCH_RETRIES = 2  # an INTERNAL batch error (a worker died) is tried this many more times
TICK = 0.1  # while the loop waits: how often to look for stalls, hedges, retries


class Scheduler:
    """Batches [start, total) of one epoch, each asked of the servers with `spec`, at most
    `window` indices ahead of the loop, new ones `group` at a time while servers hold credits
    (see _assign), a take's held a moment under `hold_credits` (hold.py); `timeout` s without
    progress is an error. `stream_factory` opens a stream to a server (BatchStream, or a
    test's fake); `clock` is the time every decision reads (seconds, monotonic)."""

    def __init__(self, servers: ServerSet, spec: StreamSpec, *, total: int, start: int,
                 window: int, timeout: float, group: int = 1, hold_credits: bool = False,
                 stream_factory: StreamFactory = BatchStream,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._servers = servers
        self._passes = Passes(Pass(spec, 0, start, total))
        self._next = start  # a position (client/fleet/passes.py); the first pass's are its indices
        self._window = window
        self._group = group  # new credits are sent once this many are due (see _assign)
        self._timeout, self._clock = timeout, clock
        self._cond = threading.Condition()
        self._ready: dict[int, Any] = {}
        self._credits = Credits(servers, self._passes, stream_factory, self._on_batch,
                                self._on_end)
        # Streams let go of whose receive thread has not ended yet: their bytes still count.
        self._leaving: set[Stream] = set()
        self._fatal: RemoteError | None = None
        self._closed = False
        self._hold = (CreditHold(self._cond, lambda: self._assign(self._clock()))
                      if hold_credits else None)
        self._progress = clock()
        for server in servers.servers.values():  # their share goes out once they answer
            if server.contact is not None and not server.contact.done():
                server.contact.add_done_callback(self._answered)
        self.failovers = self.bytes_received = 0
        self.dropped = 0  # batches received of an epoch the loop did not move on to
        self.window_note = (0, "", 0)  # the loader's window, why, budget: sent with reports
        self.refused_ahead: RemoteError | None = None  # why a next epoch's stream failed
        with self._cond:
            self._assign(clock())

    @property
    def hedges(self) -> int:
        """Batches also asked of another server: late at a slow one, or awaited too long."""
        return self._credits.hedges

    def widen(self, window: int) -> None:
        """Keep up to `window` batches in flight from now on (more than before), and ask
        for new ones in groups (see policy.hold_back)."""
        with self._cond:
            if window > self._window:
                self.resize(window, policy.group_for(window))

    def resize(self, window: int, group: int) -> None:
        """Keep up to `window` batches in flight from now on (fewer: none is asked for
        until fewer are), new ones `group` at a time."""
        with self._cond:
            self._window, self._group = window, group
            self._assign(self._clock())

    def _answered(self, _: object) -> None:
        """A server answered the loader's first Describe (a gRPC thread): a loop waiting in
        take() looks again now (policy.answered_share), not a TICK later."""
        with self._cond:
            self._cond.notify_all()

    def _assign(self, now: float) -> None:
        if not self._closed:
            self._credits.assign(now, self._next, self._window, self._group, self._ready)

    # -- the loop's side -------------------------------------------------------------------
    def report(self, wait_seconds: float, loop_seconds: float) -> None:
        """Send the loop's data stall to every server with an open stream."""
        with self._cond:
            streams = self._servers.streams()
        for stream in streams:
            stream.report(wait_seconds, loop_seconds, self.window_note)

    def fleet(self) -> Fleet:
        """What the servers in use said they can do, and their batches' latency."""
        with self._cond:
            return self._servers.fleet()

    def received(self) -> int:
        """Bytes received so far, by streams that ended and by those still open."""
        with self._cond:
            live = sum(st.bytes_received for st in [*self._servers.streams(), *self._leaving])
            return self.bytes_received + live

    def take(self, index: int, on_wait: Callable[[], None] | None = None) -> Any:
        """Batch `index` (the next one) of the loop's epoch, waiting while servers fail and
        come back for up to `timeout` seconds without progress; `on_wait()` is called every
        TICK while it waits (on this thread, under the lock: it may call report())."""
        with self._cond:
            started = self._clock()
            while not self.poll(index, started):
                self._cond.wait(TICK)
                if on_wait is not None:
                    on_wait()
            position = self._passes.loop.base + index
            item = self._ready.pop(position)
            self._next = position + 1
            now = self._clock()
            for done in self._passes.finished(self._next):
                self._retire(done)
            # A loop that never waits must still see servers join and leave a dns name.
            self._servers.refresh(now)
            if self._hold is None or not self._hold.holds(now, len(self._ready)):
                self._assign(now)
            self._credits.hedge_late(now, self._next, LATE_EVERY)
        if isinstance(item, RemoteError):
            raise item
        return item

    def poll(self, index: int, waiting_since: float) -> bool:
        """One look while the loop waits for batch `index` (take() calls it every TICK; a
        test calls it after moving its clock): True once the batch is ready; else raise a
        fatal error, or UNAVAILABLE after `timeout` s without progress, or look for stalls,
        hedges and retries."""
        with self._cond:
            position = self._passes.loop.base + index
            if position in self._ready:
                return True
            if self._fatal is not None:
                raise self._fatal
            now = self._clock()
            # Time the loop spent elsewhere (evaluation, a checkpoint) does not count.
            if now - max(self._progress, waiting_since) > self._timeout:
                raise self._no_server(index)
            self._maintain(now, position)
            return False

    # -- epochs ----------------------------------------------------------------------------
    def then(self, spec: StreamSpec, total: int) -> None:
        """The epoch after the last one this scheduler serves is `spec`'s, of `total`
        batches: its first ones are asked for once the window reaches past the last."""
        with self._cond:
            if self.refused_ahead is None and total > 0:
                self._passes.add(spec, total)
                self._assign(self._clock())

    def serving(self) -> object:
        """The pass the loop takes batches of now: a loop that started on it may close this
        scheduler only while it still is (a later loop may have followed it on)."""
        with self._cond:
            return self._passes.loop

    def follow(self, epoch: int) -> bool:
        """The loop, done with its epoch, moves on to `epoch` (take() counts from its batch
        0); False if this scheduler does not serve it next (the caller closes it and starts
        afresh)."""
        with self._cond:
            return self.refused_ahead is None and self._next == self._passes.loop.end \
                and self._passes.follow(epoch)

    def _retire(self, done: Pass) -> None:
        for stream in self._passes.retire(done, self._servers.servers.values(),
                                           self._credits.holders):
            self._let_go(stream)

    def _let_go(self, stream: Stream) -> None:
        """Close a stream no server holds any more (its on_end counts its bytes)."""
        self._leaving.add(stream)
        stream.close(wait=False)

    def _abandon_ahead(self, error: RemoteError) -> None:
        """A next epoch's stream was refused with an error that may be about it alone (a
        limit on streams): stop asking ahead; the loop starts that epoch afresh, and hears
        the error then if it holds."""
        self.refused_ahead = error
        for done in self._passes.drop_ahead():
            self._retire(done)
        self.dropped += self._passes.drop_beyond_loop(self._ready)

    def close(self) -> None:
        with self._cond:
            if not self._closed:
                self.dropped += self._passes.drop_beyond_loop(self._ready)
            self._closed = True
            if self._hold is not None:
                self._hold.close()
            streams = []
            for server in self._servers.servers.values():
                streams += server.let_go()
                server.outstanding.clear()
            self._leaving.update(streams)
        for stream in streams:
            stream.close()  # its receive thread reports on_end, which counts its bytes

    def close_channels(self) -> None:
        """Close every server's channel (at exit: nothing is asked of them after)."""
        self._servers.close()

    def servers_now(self) -> str:
        """Every server, its state and last error (for errors and log lines)."""
        with self._cond:
            return self._servers.summary()

    def _no_server(self, index: int) -> RemoteError:
        return RemoteError(grpc.StatusCode.UNAVAILABLE,
                           f"no server delivered batch {index} within {self._timeout:g}s of the "
                           f"last progress ({self.servers_now()})", self._servers.describe())

    # -- scheduling (under the lock) -------------------------------------------------------
    def _maintain(self, now: float, waiting_for: int) -> None:
        self._servers.refresh(now)
        for s in policy.stalling(self._servers.servers.values(), now):
            s.mark_stalled(now)  # ask others for what it holds
            self.failovers += 1
        self._assign(now)
        self._credits.hedge_late(now, self._next)
        self._credits.hedge_awaited(waiting_for, now)

    def _server_of(self, stream: Stream) -> tuple[Server, Pass] | tuple[None, None]:
        """The server of `stream` and the pass it serves; (None, None) for a stream let go."""
        server = self._servers.servers.get(stream.address)
        served = self._passes.served_by(server, stream) if server is not None else None
        return (server, served) if server is not None and served is not None else (None, None)

    # -- receive threads -------------------------------------------------------------------
    def _on_batch(self, stream: Stream, index: int, item: Any) -> None:
        with self._cond:
            server, served = self._server_of(stream)
            if server is None or served is None or self._closed:
                return  # a stream we already gave up on
            index += served.base  # a position from here on
            now = self._clock()
            self._credits.forget()
            for drained in server.took(index, item, stream, now):
                self._let_go(drained)
            if index < self._next or index in self._ready:
                return  # a duplicate: another server answered first
            if self._credits.retry(index, server, item, now, BATCH_RETRIES):
                self._assign(now)  # ... and on the same server, if no other is usable
                return
            server.batches += 1
            self._ready[index] = item
            self._credits.holders.pop(index, None)
            self._progress = now
            if index == self._next:  # the one take() waits for; one further on lets it sleep
                self._cond.notify_all()

    def _on_end(self, stream: Stream, error: RemoteError | None) -> None:
        with self._cond:
            self.bytes_received += stream.bytes_received
            self._leaving.discard(stream)
            server, served = self._server_of(stream)
            if server is None or served is None or self._closed or error is None:
                return
            if error.code in FATAL and any(served is p for p in self._passes.ahead()):
                self._abandon_ahead(error)
                return
            if error.code in FATAL:
                self._fatal = error
                self._cond.notify_all()
                return
            now = self._clock()
            self.failovers += bool(server.outstanding)
            for other in self._credits.lost(server, error, now):
                if other is not stream:
                    self._let_go(other)
            self._assign(now)
            self._cond.notify_all()

