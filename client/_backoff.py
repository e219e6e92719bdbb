"""The pause before a server that failed is asked again: `Backoff`, doubling from FIRST to
MOST seconds, and reset by a success. The one backoff of the client (first contact's
DescribeDataset retries and the scheduler's retries of a failed server both use it).

Threading: none of its own; each Backoff belongs to the state that holds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FIRST, MOST = 0.05, 2.0  # seconds


@dataclass
class Backoff:
    """`next()`: the pause to take now (then twice that next time, at most `most`)."""

    first: float = FIRST
    most: float = MOST
    pause: float = field(init=False)

    def __post_init__(self) -> None:
        self.pause = self.first

    def next(self) -> float:
        pause, self.pause = self.pause, min(self.pause * 2, self.most)
        return pause

    def reset(self) -> None:
        self.pause = self.first
