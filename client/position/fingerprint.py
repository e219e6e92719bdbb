"""The dataset fingerprint a loader reads, as a value: `Fingerprint`; and `short`, how errors
and logs show one.

Which servers agree with it is client/contact/agreement.py's; this is what is kept (and saved in
state_dict)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stoker.v1 import stoker_pb2 as pb

SHORT = len("sha256:") + 12


@dataclass(frozen=True)
class Fingerprint:
    """The dataset fingerprint a loader reads (`digest` "" when the server reports none), and
    the server it came from."""

    digest: str
    objects: int
    bytes: int
    address: str
    snapshot: str = ""  # a lake table's snapshot the digest covers ("": none)

    @classmethod
    def of(cls, fp: pb.Fingerprint, address: str) -> Fingerprint:
        return cls(fp.digest, fp.objects, fp.bytes, address, fp.snapshot)

    def state(self) -> dict[str, Any]:
        """What state_dict() records."""
        state = {"digest": self.digest, "objects": self.objects, "bytes": self.bytes}
        return {**state, "snapshot": self.snapshot} if self.snapshot else state


def data_digest(digest: str) -> str:
    """The data's part of a digest: without the tail that names the server's image decode
    (server/order/fingerprint.py). Servers that decode alike have equal digests; an epoch's
    order depends only on this part."""
    return digest.partition("+")[0]


def short(digest: str, objects: int | None = None, nbytes: int | None = None) -> str:
    """`sha256:9c1d2e3f4a5b... (40 objects, 1.2 MB)`, with the decode's tail where the digest
    has one (`sha256:9c1d2e3f4a5b...+jpeg-crop-1`)."""
    data, plus, decode = digest.partition("+")
    text = (data[:SHORT] + "..." if len(data) > SHORT else data or "(none)") + plus + decode
    if objects is None:
        return text
    return f"{text} ({objects} objects, {_size(nbytes or 0)})"


def _size(n: float) -> str:
    for unit in ("bytes", "kB", "MB", "GB"):
        if n < 1000:
            return f"{int(n)} bytes" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
