"""How one stream's batches reach its client: one `Transport` per stream, chosen once.

The handshake is the stream's first message(s), up to the first with coordinates: what they ask
for (shm_probe, data_socket, compression) is gathered in a `Handshake`, and `choose` turns it
into the stream's transport, which then carries every batch of the stream. The variants, side
by side:

- frames (frames.py): the payload in gRPC frames of `frame_bytes`, zstd-compressed if asked;
- shm (shm.py): one header frame; the client, on the same host, maps the worker's segment;
- data connection (datasocket.py): every answer as a record (header, payload) on a TCP (or
  TLS) connection beside the stream, or by another transport if the client cannot connect.

A new transport is a module here implementing `Transport`, and one more branch in `choose`.

Threading contract: a transport belongs to one stream and runs on the server's event loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .base import BatchOwner, Transport, write

if TYPE_CHECKING:
    from ...pool.shm import ReadMappings
    from .datasocket import SocketOffer

__all__ = ["Handshake", "Transport", "choose", "write"]


@dataclass
class Handshake:
    """What a client asked for before its coordinates (read by the stream's reader)."""

    zstd: bool = False  # compression="zstd"
    same_host: bool = False  # its shm probe passed, and this server lends shared memory
    offer: SocketOffer | None = None  # a data socket offered (its first frame is sent)


def choose(asked: Handshake, pool: BatchOwner, mappings: ReadMappings,
           frame_bytes: int) -> Transport:
    """The transport of a stream whose handshake asked for `asked`. A data socket offered
    wins (its client may already be connecting); it falls back to the one chosen without it."""
    direct: Transport
    if asked.same_host:
        from .shm import ShmTransport

        direct = ShmTransport(pool)
    else:
        from .frames import FramesTransport, zstd_compressor

        direct = FramesTransport(pool, mappings, frame_bytes,
                                 zstd_compressor() if asked.zstd else None)
    if asked.offer is not None:
        from .datasocket import SocketTransport

        return SocketTransport(asked.offer, pool, mappings, fallback=direct)
    return direct
