"""The training loop's data stall: the seconds it waited for batches, of the seconds it
iterated; reported to the servers (their stoker_client_data_stall, which an autoscaler
reads), and a long wait for one batch said once, at INFO, with what it waits for.

Threading: the loop's thread only (the loader's), between batches and from the wait for one.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import TYPE_CHECKING

from ._log import say

if TYPE_CHECKING:
    from .fleet.scheduler import Scheduler

# The loop's data stall goes to the servers (for their metrics) every REPORT_EVERY seconds of
# iterating, the first time after REPORT_FIRST, by the clock: from the wait for a batch too
# (a loop stuck waiting is the stall an autoscaler must see), and at the start of each pass
# (a new stream) once there is something to say, so that short epochs report too.
REPORT_FIRST, REPORT_EVERY = 1.0, 5.0
# A report covers the loop's last REPORT_WINDOW to REPORT_WINDOW + REPORT_EVERY seconds (all
# of it while it is younger), not the time since the loader began: a stall that added servers
# ended must leave the servers' gauge within a window, or an autoscaler keeps adding more.
REPORT_WINDOW = 10.0
SAY_WAITING = 3.0  # seconds the loop waits for one batch before an INFO line says why


class Stall:
    """A loader's loop time and wait time, over every pass (`begin` to `end`), and their
    reports to the servers of each pass's `Scheduler`."""

    def __init__(self, dataset: str, timeout: float) -> None:
        self._dataset, self._timeout = dataset, timeout
        self.wait_seconds = 0.0  # in the loader, waiting for a batch
        self._loop_seconds = 0.0  # of passes that ended
        self._loop_started: float | None = None  # while a pass runs
        self._next_report: float | None = None  # when the stall goes to the servers next
        self._reported: collections.deque[tuple[float, float]] = collections.deque()
        self._said_waiting = (-1, -1)  # (epoch, batch) whose long wait was logged

    def loop_seconds(self, now: float | None = None) -> float:
        """Seconds spent iterating, the pass running now included."""
        running = self._loop_started
        if running is None:
            return self._loop_seconds
        return self._loop_seconds + (time.perf_counter() if now is None else now) - running

    @property
    def running(self) -> bool:
        """A pass is under way (between begin and end)."""
        return self._loop_started is not None

    def begin(self, scheduler: Scheduler) -> None:
        """A pass begins, reading from `scheduler`: its servers hear what the loop is like
        once there is something to say."""
        self._loop_started = time.perf_counter()
        if self._next_report is None:
            self._next_report = self._loop_started + REPORT_FIRST
        elif self._loop_seconds > 0:
            self._report(scheduler, 0.0)  # a new stream: tell it what the loop is like

    def end(self) -> None:
        """The pass that began ended (finished, or the loop left it)."""
        if self._loop_started is not None:
            self._loop_seconds += time.perf_counter() - self._loop_started
            self._loop_started = None

    def waiting(self, scheduler: Scheduler, since: float, epoch: int, batch: int) -> None:
        """Called while the loop waits, since `since`, for `batch` of `epoch`: report the
        stall when due, and say once, after SAY_WAITING s, what it waits for."""
        self.due(scheduler, since)
        if self._said_waiting != (epoch, batch) and time.perf_counter() - since >= SAY_WAITING:
            self._said_waiting = (epoch, batch)
            say(logging.INFO, "%s epoch %d: waiting %.0fs for batch %d (giving up after "
                "timeout=%gs without a batch from any server): %s", self._dataset, epoch,
                time.perf_counter() - since, batch, self._timeout, scheduler.servers_now())

    def due(self, scheduler: Scheduler, waiting_since: float | None) -> None:
        """Send the stall to the servers if it is time (`waiting_since`: when the wait for
        the current batch began, None between batches)."""
        now = time.perf_counter()
        if self._next_report is not None and now >= self._next_report:
            self._report(scheduler, now - waiting_since if waiting_since is not None else 0.0)

    def _report(self, scheduler: Scheduler, waiting: float) -> None:
        """The servers' stoker_client_data_stall: the wait and loop seconds of about the
        last REPORT_WINDOW s of the loop, with the wait still running."""
        now = time.perf_counter()
        self._next_report = now + REPORT_EVERY
        loop = self.loop_seconds(now)
        wait = self.wait_seconds + waiting
        sent = self._reported  # (wait, loop) totals of earlier reports, oldest first
        while len(sent) > 1 and loop - sent[1][1] >= REPORT_WINDOW:
            sent.popleft()
        base = sent[0] if sent and loop - sent[0][1] >= REPORT_WINDOW else (0.0, 0.0)
        sent.append((wait, loop))
        scheduler.report(wait - base[0], loop - base[1])
