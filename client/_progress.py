"""What the training loop sees of its data: an optional tqdm bar and a periodic log line.

The stall is the share of the loop's wall time spent waiting in `next(loader)`: 0% means
data was always ready; 30% means the model idled for data a third of the time (add servers
or workers, or raise `prefetch`). Both run on the consumer's thread, once per batch, and cost
a clock read unless it is time to draw or log. The log line shows without any logging
configuration (on stderr: _log.py).
"""

from __future__ import annotations

import logging
import time

from ._log import say


class Progress:
    def __init__(self, *, bar: bool, log_every: float | None, total: int, start: int,
                 label: str) -> None:
        self._bar = None
        if bar:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                raise ImportError("progress=True needs tqdm: pip install tqdm "
                                  "(or stoker[client])") from None
            self._bar = tqdm(total=total, initial=start, desc=label, unit="batch",
                             dynamic_ncols=True)
        self._log_every = log_every
        self._label, self._total = label, total
        self._t0 = self._last = time.perf_counter()
        self._waited = self._waited_last = 0.0
        self._bytes0: int | None = None
        self._bytes_last: int | None = None
        self._batches_last = 0

    def step(self, index: int, waited: float, received_bytes: int) -> None:
        """Batch `index` was handed out after waiting `waited` seconds."""
        self._waited += waited
        if self._bytes0 is None:
            self._bytes0 = self._bytes_last = received_bytes
        now = time.perf_counter()
        if self._bar is not None:
            self._bar.update(1)
            if self._bar.n % 8 == 0:  # the postfix is text: not every batch
                self._bar.set_postfix_str(f"stall {self.stall(now):.0%}", refresh=False)
        if self._log_every is not None and now - self._last >= self._log_every:
            span = now - self._last
            batches = index + 1 - self._batches_last
            stall = (self._waited - self._waited_last) / span
            mb = (received_bytes - (self._bytes_last or 0)) / span / 1e6
            say(logging.INFO, "%s: batch %d/%d, %.1f batches/s, %.1f MB/s, data stall %.1f%% "
                "(%.1f%% since the start)", self._label, index + 1, self._total,
                batches / span, mb, 100 * stall, 100 * self.stall(now))
            self._last, self._waited_last = now, self._waited
            self._bytes_last, self._batches_last = received_bytes, index + 1

    def stall(self, now: float | None = None) -> float:
        elapsed = (now or time.perf_counter()) - self._t0
        return self._waited / elapsed if elapsed > 0 else 0.0

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
