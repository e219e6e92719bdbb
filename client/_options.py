"""What a RemoteLoader was asked for, checked once: `LoaderOptions`, the one declaration of
its arguments.

RemoteLoader's signature is LoaderOptions' (after `address`): its fields are the public
arguments, in order, with their defaults (docs/client.md says what each means). The loader
builds one from its arguments and reads it from then on; each pass over an epoch turns it
into the `StreamSpec` every stream opens with.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from .channel import ChannelMaker
from .delivery.normalize import Normalizer
from .fleet.discovery import RESOLVE_EVERY, Resolver
from .position.resume import ORDER_VERSIONS, Coordinates

__all__ = ["TOKEN_COSTS", "LoaderOptions", "default_rank_world", "loader_options", "prefetching",
           "signature"]

# Batches requested ahead of the loop when the loader is not told; and, then, the bytes'
# worth of small batches requested ahead instead (see Window.fit in fleet/window.py).
PREFETCH = 8
PREFETCH_BYTES = 32 << 20
# The most host (or pinned) memory the batches in flight may take when the window adapts.
MEMORY_BUDGET = 1 << 30

# What ranks' batches are balanced by under batch_tokens (server/order/token_batches.py).
TOKEN_COSTS = ("tokens", "squares")


def default_rank_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """`rank` and `world_size` where given; else from torch.distributed when initialised,
    else RANK/WORLD_SIZE, else (0, 1).

    torch is consulted only if the process already imported it: numpy users stay torch-free.
    """
    if rank is not None and world_size is not None:
        return rank, world_size
    torch = sys.modules.get("torch")
    if torch is not None and torch.distributed.is_available() \
            and torch.distributed.is_initialized():
        found = torch.distributed.get_rank(), torch.distributed.get_world_size()
    else:
        found = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    return (found[0] if rank is None else rank,
            found[1] if world_size is None else world_size)


def prefetching(prefetch: int | None, prefetch_bytes: int | None) -> dict[str, int]:
    """LoaderOptions' prefetch and prefetch_bytes for RemoteLoader's arguments: a `prefetch`
    given is the window, exactly, unless prefetch_bytes is given too; neither given: 8
    batches, more for small ones (PREFETCH_BYTES)."""
    if prefetch_bytes is None:
        prefetch_bytes = PREFETCH_BYTES if prefetch is None else 0
    return {"prefetch": PREFETCH if prefetch is None else prefetch,
            "prefetch_bytes": prefetch_bytes}


@dataclass(frozen=True)
class LoaderOptions:
    """A loader's arguments under their public names, in RemoteLoader's order, with its
    defaults (docs/client.md says what each means); construction resolves what was not given
    (rank, world_size, prefetch, prefetch_bytes), makes tls and token into `channels`, and
    raises ValueError (ImportError for a missing zstandard) naming what is wrong."""

    dataset: str
    batch_size: int | None = None
    _: KW_ONLY
    batch_tokens: int | None = None
    token_cost: str = "tokens"
    pack: bool = False
    seed: int = 0
    shuffle: bool = True
    drop_last: bool = True
    order: str = "index"  # a shuffled epoch's order version: ORDER_VERSIONS (docs/client.md)
    # A lake table's snapshot to read (docs/configuration.md, "Tables in lakes"); None: the
    # server's config pin, else the table's current snapshot at first contact.
    snapshot: str | int | None = None
    # rank, world_size, prefetch and prefetch_bytes: None is "not given", resolved on
    # construction (default_rank_world, prefetching): ints from then on.
    rank: int = None  # type: ignore[assignment]
    world_size: int = None  # type: ignore[assignment]
    device: Any = None
    output: str = "torch"
    prefetch: int = None  # type: ignore[assignment]
    prefetch_bytes: int = None  # type: ignore[assignment]  # resolved 0: the window is `prefetch`, whatever the size
    memory_budget: int = MEMORY_BUDGET  # bytes of buffers the window may fill (adapting)
    prefetch_next_epoch: bool = True  # ask for epoch e + 1's first batches as e ends
    timeout: float = 300.0
    connect_timeout: float = 10.0
    normalize: Mapping[str, tuple[Sequence[float], Sequence[float]]] | None = None
    normalize_dtype: str = "float32"
    shared_memory: bool = True
    progress: bool = False
    log_every: float | None = None
    compression: str | None = None
    data_socket: bool = True
    tls: bool | Mapping[str, Any] = False
    token: str | None = field(default=None, repr=False)  # a secret: not in logs
    dns_refresh: float = RESOLVE_EVERY  # dns_refresh and resolver: checked by ServerSet
    resolver: Resolver | None = None
    channels: ChannelMaker = field(init=False)  # made of tls and token
    # prefetch not given: the window follows the servers and the loop's stall (fleet/window.py)
    adapts: bool = field(init=False)

    def __post_init__(self) -> None:
        rank, world_size = default_rank_world(self.rank, self.world_size)
        resolved = {"rank": rank, "world_size": world_size,
                    **prefetching(self.prefetch, self.prefetch_bytes),
                    "channels": ChannelMaker(self.tls, self.token),
                    "adapts": self.prefetch is None}
        for name, value in resolved.items():
            object.__setattr__(self, name, value)  # frozen: only here, once
        if self.order not in ORDER_VERSIONS:
            raise ValueError(f"order must be one of {', '.join(map(repr, ORDER_VERSIONS))}, "
                             f"got {self.order!r}")
        if self.batch_size is not None and self.batch_tokens is not None:
            raise ValueError(f"batch_size={self.batch_size} and batch_tokens="
                             f"{self.batch_tokens}: give one, not both")
        if self.batch_size is None and self.batch_tokens is None:
            raise ValueError("batch_size or batch_tokens is required")
        if self.batch_tokens is not None and self.batch_tokens < 1:
            raise ValueError(f"batch_tokens must be >= 1, got {self.batch_tokens}")
        if self.token_cost not in TOKEN_COSTS:
            raise ValueError(f"token_cost must be one of {', '.join(map(repr, TOKEN_COSTS))}, "
                             f"got {self.token_cost!r}")
        if self.token_cost != "tokens" and self.batch_tokens is None:
            raise ValueError(f"token_cost={self.token_cost!r} applies with batch_tokens only")
        if self.pack and self.output != "torch":
            raise ValueError("pack=True needs output='torch'")
        if self.output not in ("torch", "numpy"):
            raise ValueError(f"output must be 'torch' or 'numpy', got {self.output!r}")
        if self.output == "numpy" and self.device is not None:
            raise ValueError("output='numpy' yields host arrays; device must be None")
        if self.prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {self.prefetch}")
        if self.prefetch_bytes < 0:
            raise ValueError(f"prefetch_bytes must be >= 0, got {self.prefetch_bytes}")
        if self.memory_budget < 1:
            raise ValueError(f"memory_budget must be >= 1 byte, got {self.memory_budget}")
        for name in ("timeout", "connect_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.normalize:
            self.normalizer()  # its checks, here rather than at the first batch
            if self.output == "numpy" and self.normalize_dtype == "bfloat16":
                raise ValueError("normalize_dtype='bfloat16' needs output='torch' "
                                 "(numpy has none)")
        if self.log_every is not None and self.log_every <= 0:
            raise ValueError(f"log_every must be > 0 seconds or None, got {self.log_every}")
        if self.compression not in (None, "zstd"):
            raise ValueError(f"compression must be None or 'zstd', got {self.compression!r}")
        if self.compression == "zstd":
            try:
                import zstandard  # noqa: F401 -- fail here, not on a receive thread
            except ImportError:
                raise ImportError("compression='zstd' needs zstandard: pip install zstandard"
                                  ) from None

    def normalizer(self) -> Normalizer | None:
        """A new Normalizer for `normalize` (it learns the channel axes from the dataset's
        fields, so each loader keeps its own), or None without one."""
        return Normalizer(self.normalize, self.normalize_dtype) if self.normalize else None

    @property
    def coordinates(self) -> Coordinates:
        """The coordinates but the epoch."""
        assert self.rank is not None and self.world_size is not None  # resolved
        return Coordinates(self.dataset, self.seed, self.shuffle, self.rank, self.world_size,
                           self.batch_size or 0, self.drop_last, self.batch_tokens,
                           self.token_cost, order=ORDER_VERSIONS[self.order],
                           snapshot="" if self.snapshot is None else str(self.snapshot))

    @property
    def on_device(self) -> bool:
        """Batches go to a device (through pinned buffers) rather than stay on the host."""
        return self.device is not None and str(self.device).partition(":")[0] != "cpu"


# RemoteLoader's own arguments before LoaderOptions' (which begin with dataset, batch_size).
_FIRST = (inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
          inspect.Parameter("address", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                            annotation="str | Sequence[str]"))
# The arguments RemoteLoader takes as **options: every one after batch_size.
_KEYWORDS = frozenset(f.name for f in dataclasses.fields(LoaderOptions)
                      if f.init and f.kw_only)


def signature() -> inspect.Signature:
    """RemoteLoader.__init__'s signature, as help() and inspect.signature() show it:
    (self, address, then LoaderOptions' arguments)."""
    declared = inspect.signature(LoaderOptions).parameters.values()
    return inspect.Signature([*_FIRST, *declared], return_annotation="None")


def loader_options(dataset: str, batch_size: int | None, given: Mapping[str, Any]) -> LoaderOptions:
    """LoaderOptions of RemoteLoader's arguments; an argument it does not take is a
    TypeError naming it, as Python's own."""
    for name in given:
        if name not in _KEYWORDS:
            raise TypeError(f"RemoteLoader.__init__() got an unexpected keyword argument "
                            f"{name!r}")
    return LoaderOptions(dataset, batch_size, **given)
