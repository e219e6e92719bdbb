"""Which data a loader reads: the dataset fingerprint it agreed on, and the servers that agree.

A loader keeps the fingerprint of the first server that describes the dataset, and from then on
sends its digest in every stream's and Describe's coordinates: a server with other data refuses
those (FAILED_PRECONDITION). The other servers' descriptions are compared as they come (the
first contact's calls to them, client/contact/first.py, or new ones): a server gets no credits
until its own has come, those that answer within CHECK_WAIT of the first are compared before
any batch is used, and a later one that disagrees is refused when it answers, so that two
servers that listed the data at different times are named together, while an address that
black-holes holds up nothing (docs/client.md, "Servers that hold different data").

Threading: used from the loop's thread only (the loader's)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import grpc

from stoker.v1 import stoker_pb2 as pb
from stoker.v1 import stoker_pb2_grpc as pb_grpc

from .._errors import DataMismatch, RemoteError
from .._log import say
from ..position.fingerprint import Fingerprint, short

if TYPE_CHECKING:
    from ..fleet.servers import ServerSet
    from .first import Contact

# Seconds after the first answer that the other servers' answers are waited for before a
# loader's first batch is used; later ones are compared as they come.
CHECK_WAIT = 0.5


def mismatch(dataset: str, agreed: Fingerprint, address: str, digest: str,
             found: pb.Fingerprint | None = None) -> DataMismatch:
    """The error naming both servers and both fingerprints."""
    theirs = short(digest, found.objects, found.bytes) if found is not None else short(digest)
    ours = short(agreed.digest, agreed.objects, agreed.bytes)
    if address == agreed.address:  # restarted over other data
        return DataMismatch(
            f"dataset {dataset!r}: {address} had {ours} when this loader began and now has "
            f"{theirs}: its data changed, and one loader must not mix the two (samples would "
            "repeat or go missing): start a new loader (or resume with "
            "load_state_dict(state, allow_changed_data=True))", address, digest)
    return DataMismatch(
        f"dataset {dataset!r}: servers hold different data: {agreed.address} has {ours}, "
        f"{address} has {theirs}; one loader must not mix them (samples would repeat or go "
        "missing): restart the stale server so that both list the same data (and keep mtimes "
        "when copying: rsync -a, cp -p), or give the loader only servers that agree",
        address, digest)


def order_refusal(dataset: str, order: int, address: str,
                  described: pb.DescribeDatasetResponse) -> DataMismatch | None:
    """The DataMismatch for a server that cannot compute this loader's order version (one
    older than it: its fingerprint lists no orders), or None."""
    if not described.HasField("fingerprint"):
        return None
    orders = list(described.fingerprint.orders) or [1]  # before index orders: legacy only
    if order in orders:
        return None
    return DataMismatch(
        f"dataset {dataset!r}: {address} computes order versions {orders}, not this loader's "
        f"{order}: it is older than this client, and would serve other batches for the same "
        "coordinates; upgrade it, or give the loader only servers that can (a run resumed from "
        "a state saved before order versions uses 1, 'legacy', which every server computes)",
        address, described.fingerprint.digest)


def describe_each(channels: Iterable[tuple[str, grpc.Channel]], coordinates: pb.Coordinates,
                  timeout: float) -> dict[str, pb.DescribeDatasetResponse | RemoteError]:
    """Each server's description of the dataset (its fingerprint, its max_credits), asked all
    at once within `timeout` and without a fingerprint of ours (so each says what it has); a
    server that does not answer gets its error instead (a server refuses streams expecting
    other data anyway)."""
    asked = {address: pb_grpc.DataServiceStub(channel).DescribeDataset.future(
        pb.DescribeDatasetRequest(coordinates=coordinates), timeout=timeout)
        for address, channel in channels}
    found: dict[str, pb.DescribeDatasetResponse | RemoteError] = {}
    for address, future in asked.items():
        try:
            found[address] = future.result()
        except grpc.RpcError as e:
            found[address] = RemoteError.from_rpc(e, address)
    return found


class FingerprintCheck:
    """A loader's fingerprint (`fingerprint`, None until a server described the dataset) and
    its checks of the servers against it; `dataset` names the data in errors, and `timeout`
    bounds each server's answer (at most 10 s)."""

    def __init__(self, dataset: str, servers: ServerSet, timeout: float, order: int = 1
                 ) -> None:
        self._dataset, self._servers = dataset, servers
        self.order = order  # the loader's order version: a server must compute it
        self._timeout = min(10.0, timeout)
        self.fingerprint: Fingerprint | None = None
        self.checked = False  # every server asked once for its fingerprint
        self._asked: dict[str, grpc.Future] = {}  # address -> its Describe, not compared yet
        self._agreed_at = 0.0
        self._cap_credits: Callable[[int, str], None] = lambda credits, address: None

    def first(self, contact: Contact) -> None:
        """A server described the dataset: the first to do so sets the fingerprint, and the calls of
        its first contact to the others are kept to compare their answers."""
        if self.fingerprint is None:
            refused = order_refusal(self._dataset, self.order, contact.server.address,
                                    contact.described)
            if refused is not None:
                raise refused
            self.fingerprint = Fingerprint.of(contact.described.fingerprint, contact.server.address)
            self._asked = dict(contact.pending)
            self._agreed_at = time.monotonic()

    def check_servers(self, coordinates: pb.Coordinates,
                      cap_credits: Callable[[int, str], None]) -> None:
        """Ask every other server for its fingerprint, once (those the first contact has not
        asked already), without waiting: each gets no credits until it has answered (its
        `contact`), and `look` compares the answers; each that agrees has its max_credits
        given to `cap_credits`. (Servers that come up later refuse our streams themselves: the
        coordinates carry the digest.)"""
        agreed = self.fingerprint
        self.checked = True
        if agreed is None:
            return
        self._cap_credits = cap_credits
        others = [s for s in self._servers.servers.values() if s.address != agreed.address]
        for server in others:
            if server.address not in self._asked:
                self._asked[server.address] = pb_grpc.DataServiceStub(
                    server.channel).DescribeDataset.future(
                    pb.DescribeDatasetRequest(coordinates=coordinates), timeout=self._timeout)
            server.contact = self._asked[server.address]
        self.look()

    def look(self, first_batch: bool = False) -> None:
        """Compare the servers that have answered since the last look: a server with other
        data than the agreed one is a DataMismatch. Before the first batch is used
        (`first_batch`), wait for the others until CHECK_WAIT s after the fingerprint was set."""
        if not self._asked:
            return
        if first_batch:
            until = self._agreed_at + CHECK_WAIT
            for future in self._asked.values():
                with contextlib.suppress(grpc.FutureTimeoutError):
                    future.exception(timeout=max(until - time.monotonic(), 0.0))
        for address, future in list(self._asked.items()):
            if not future.done():
                continue
            del self._asked[address]
            try:
                d = future.result()
            except grpc.RpcError as e:
                say(logging.WARNING, "%s did not answer (%s); going on with the servers that "
                    "did, and trying it again in the background", address,
                    RemoteError.from_rpc(e, address))
                continue
            fp, agreed = d.fingerprint, self.fingerprint
            assert agreed is not None
            if agreed.digest and fp.digest and fp.digest != agreed.digest:
                raise mismatch(self._dataset, agreed, address, fp.digest, fp)
            refused = order_refusal(self._dataset, self.order, address, d)
            if refused is not None:
                raise refused
            self._cap_credits(d.max_credits, address)

    def refused(self, address: str, digest: str, coordinates: pb.Coordinates) -> DataMismatch:
        """The DataMismatch for a server that refused our fingerprint, with its own."""
        assert self.fingerprint is not None
        server = self._servers.servers.get(address)
        found = describe_each([(address, server.channel)] if server else [], coordinates,
                              self._timeout).get(address)
        fp = None if found is None or isinstance(found, RemoteError) else found.fingerprint
        return mismatch(self._dataset, self.fingerprint, address, digest, fp)
