"""Which server computes which batch: the servers as seen from here (servers.py: addresses,
channels, health, discovery), how fast each delivers (rates.py), the crediting and hedging
policy (policy.py: pure functions returning decisions) and the ledger that applies them
(credits.py), one epoch's pass and its failover (scheduler.py, passes.py), the scheduler kept
from one epoch into the next (kept.py) and the window of batches in flight (window.py).

Threads: what the scheduler runs runs under its one condition variable: the loop's thread
(take, poll, then, close) and the receive threads' callbacks (a batch, a stream's end). The
window is the loop's, but for the batch size receive threads record.
Imports: position/, transport/ (streams it opens) and the client's leaves; never contact/,
delivery/ or the loader.
"""
