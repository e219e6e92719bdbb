"""A dataset's fingerprint: what one server's copy of a dataset is, as one digest.

    digest = sha256(version, the config's content fields, the listing) [+ decode version]

- the config: the dataset's block without what only says where or how to reach the data
  (`source`'s folder or bucket, `s3:`, `follow_symlinks_outside_root`); a tokenizer file counts
  by its bytes, not its path;
- the listing: every object the dataset's storage listed (or read) while it opened, as
  `key, size, version`: local files' version is their mtime (ns) and size, S3 objects' their
  ETag. Copies on two hosts agree only if they keep mtimes (rsync -a, cp -p);
- `format: python`: the config, len(dataset) and the dataset's own `fingerprint()`, if it has
  one (see formats/_contract.py);
- a lake table (`iceberg`, `delta`, `lance`): its config without the snapshot pin and the
  table's location, and its own `fingerprint()`: the table's id and the snapshot it opened
  at (with the data files' listing for iceberg and delta). Its `snapshot` is carried beside.

The digest's tail, after `+`, names the image decode the server runs where it gives other
bytes than the whole-file decode (`+jpeg-crop-1`: JPEGs decoded for their crop box,
server/images.py): servers that decode differently give different pixels for the same
coordinates, so their digests differ and one loader does not mix them. The part before it is
the data's: a saved position (state_dict) compares only that part, since the order of an
epoch depends on the data, not on how its pixels are decoded (client/position/resume.py).

Computed once by every worker when it opens its datasets; the pool compares each worker's with
the one the server opened with (server/pool/lifecycle.py), and clients compare servers'
(docs/design.md, "Fingerprint").
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..formats import DatasetParts
    from ..sources import ObjectInfo

FINGERPRINT_VERSION = 1
# Config fields that say where or how to reach the data, not what it is.
NOT_CONTENT = {"source", "s3", "follow_symlinks_outside_root"}
# Beyond this many top-level folders and files the fingerprint keeps no per-part digests
# (they travel over the worker pipe), and a refusal gives counts only.
MAX_PARTS = 1024
SHORT = len("sha256:") + 12  # a digest as messages show it


@dataclass(frozen=True)
class Fingerprint:
    digest: str  # "sha256:<hex>"
    objects: int  # files or objects listed (format python: samples)
    bytes: int  # their total size
    # top-level folder ("cats/") or file -> (objects, digest of its lines): only to say what
    # differs between two fingerprints; not part of equality.
    parts: dict[str, tuple[int, str]] = field(default_factory=dict, compare=False, repr=False)
    # A lake table's snapshot (its exact id) that the digest covers; "" for other datasets.
    snapshot: str = ""

    def short(self) -> str:
        """`sha256:9c1d2e3f4a5b... (40 objects, 1.2 MB)` for messages."""
        return f"{short_digest(self.digest)} ({self.counts()})"

    def counts(self) -> str:
        return f"{self.objects} objects, {_size(self.bytes)}"

    def changes(self, new: Fingerprint, limit: int = 5) -> str:
        """What differs from this to `new`, by top-level part: `added 'aaa/' (8 objects);
        changed 'b.jsonl'`; "" when parts do not say (too many, or a python dataset)."""
        if not self.parts or not new.parts:
            return ""
        said = []
        for name in sorted(self.parts.keys() | new.parts.keys()):
            old, now = self.parts.get(name), new.parts.get(name)
            if old == now:
                continue
            if old is None:
                assert now is not None  # the name is in one of the two
                said.append(f"added {name!r} ({_objects(now[0])})")
            elif now is None:
                said.append(f"removed {name!r} ({_objects(old[0])})")
            elif old[0] != now[0]:
                said.append(f"changed {name!r} ({old[0]} -> {now[0]} objects)")
            else:
                said.append(f"changed {name!r}")
        more = f"; and {len(said) - limit} more" if len(said) > limit else ""
        return "; ".join(said[:limit]) + more


def short_digest(digest: str) -> str:
    """`sha256:9c1d2e3f4a5b...`, and the decode's tail where there is one."""
    data, plus, decode = digest.partition("+")
    return (data[:SHORT] + "..." if len(data) > SHORT else data) + plus + decode


def _objects(n: int) -> str:
    return f"{n} object{'s' if n != 1 else ''}"


def _size(n: int) -> str:
    for unit in ("bytes", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    raise AssertionError("unreachable")


def config_content(cfg: Any) -> str:
    """The dataset config's fields that change its batches, as canonical JSON."""
    # A lake table's pin and location are left out: its snapshot counts (the dataset's own).
    data = cfg.model_dump(mode="json", exclude=NOT_CONTENT | set(getattr(cfg, "not_content", ()))
                          | set(getattr(cfg, "pins", ())))
    tokenizer = data.get("tokenizer")
    if tokenizer and tokenizer != "byte":  # the file's bytes, wherever it lies
        data["tokenizer"] = "sha256:" + hashlib.sha256(Path(tokenizer).read_bytes()).hexdigest()
    return json.dumps(data, sort_keys=True, separators=(",", ":"))


def of_listing(cfg: Any, listing: Iterable[ObjectInfo], own: str = "",
               decode: str = "") -> Fingerprint:
    """The fingerprint of a dataset read from storage, given what its storage listed, in key
    order (as `Listing.values()` yields it: not sorted again, a listing may be millions);
    `own`: what the dataset says of itself beside (a lake table's snapshot), "" for none;
    `decode`: the version of the image decode it runs ("": the whole-file decode)."""
    h = hashlib.sha256(f"stoker-fingerprint {FINGERPRINT_VERSION}\n".encode())
    h.update(config_content(cfg).encode() + b"\n")
    if own:  # else the digest stays what it was before datasets had their own
        h.update(f"own\0{own}\n".encode())
    objects = total = 0
    parts: dict[str, tuple[int, Any]] | None = {}
    for o in listing:
        line = f"{o.key}\0{o.size}\0{o.version}\n".encode()
        h.update(line)
        objects, total = objects + 1, total + o.size
        if parts is None:
            continue
        head, sep, _ = o.key.partition("/")
        count, part = parts.get(head + sep) or (0, hashlib.sha256())
        part.update(line)
        parts[head + sep] = (count + 1, part)
        if len(parts) > MAX_PARTS:
            parts = None  # counts only, then
    kept = {name: (n, part.hexdigest()[:16]) for name, (n, part) in (parts or {}).items()}
    return Fingerprint("sha256:" + h.hexdigest() + (f"+{decode}" if decode else ""), objects,
                       total, kept)


def of_python(cfg: Any, length: int, own: str) -> Fingerprint:
    """The fingerprint of a `format: python` dataset: its config, length and own fingerprint."""
    h = hashlib.sha256(f"stoker-fingerprint {FINGERPRINT_VERSION} python\n".encode())
    h.update(config_content(cfg).encode() + b"\n")
    h.update(f"{length}\0{own}\n".encode())
    return Fingerprint("sha256:" + h.hexdigest(), length, 0)


def decode_version(parts: DatasetParts) -> str:
    """The version of the image decode the dataset runs ("": the whole-file decode, or no
    images): its `decode_version()`, which the formats that decode images have (through
    server/images.py's decode_version). Not one of the dataset's optional parts: the bytes'
    version, not a way to reach them."""
    own = getattr(parts.dataset, "decode_version", None)
    return str(own()) if callable(own) else ""


def fingerprint(cfg: Any, parts: DatasetParts) -> Fingerprint:
    """The fingerprint of an opened dataset (call it once it has opened: its listing is what
    its storage has seen by then)."""
    decode = decode_version(parts)
    own = str(parts.fingerprint()) if parts.fingerprint is not None else ""
    if parts.storage is not None and cfg.described_by_listing:
        fp = of_listing(cfg, parts.storage.listed.values(), own, decode)
    else:
        fp = of_python(cfg, len(parts.dataset), f"{own}+{decode}" if decode else own)
    return replace(fp, snapshot=parts.snapshot or "") if parts.snapshot else fp
