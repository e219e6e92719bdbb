"""The user's own traceback, from their dataset, transform or factory code: written to the
server's log in full and carried to the client in the batch's error, the way DataLoader
re-raises a worker's exception with its "Original Traceback".

Only the user's part is kept: the frames before the first one outside this package (the
worker's loop, collation) say nothing the message does not. What a client gets is bounded
(MAX_CHARS) and names files by their import path (`mypkg/data.py`), not where the server
keeps them.
"""

from __future__ import annotations

import os
import re
import sys
import traceback
from pathlib import Path
from types import TracebackType

# Put between an error's message and the traceback a client gets (client/_errors.py reads
# the traceback from Python's own "Traceback (most recent call last):" line on).
HEADER = "Original traceback on the server:"
# The most characters of traceback a client gets: an in-band error stays one small frame,
# and a status's details must stay far under gRPC's 16 KiB (its trailers' limit).
MAX_CHARS = 6000

_PACKAGE = tuple({str(Path(__file__).parent.parent.absolute()) + os.sep,
                  str(Path(__file__).resolve().parent.parent) + os.sep, "<frozen importlib"})
_FILE_LINE = re.compile(r'^(\s*File ")([^"]+)(", line)', re.MULTILINE)


def user_traceback(error: BaseException) -> str:
    """`error`'s traceback from its first frame outside this package (and importlib's) on,
    or else its cause's (an error of ours raised from the user's); "" when neither has
    one: the error is the server's own and its message says it all."""
    tb: TracebackType | None = error.__traceback__
    while tb is not None and _ours(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    if tb is None:
        cause = error.__cause__
        return user_traceback(cause) if cause is not None and cause is not error else ""
    return "".join(traceback.format_exception(type(error), error, tb)).rstrip("\n")


def _ours(filename: str) -> bool:
    return filename.startswith(_PACKAGE)


def for_client(text: str) -> str:
    """A traceback as a client sees it: files by import path, at most MAX_CHARS, of which
    the end (the innermost frames and the exception) is kept."""
    text = _FILE_LINE.sub(lambda m: m.group(1) + _short(m.group(2)) + m.group(3), text)
    if len(text) <= MAX_CHARS:
        return text
    first, _, rest = text.partition("\n")
    keep = rest[len(rest) - MAX_CHARS + len(first) + 64:]
    frame = keep.find("\n  File ")  # from a whole frame on, where there is one
    keep = keep[frame + 1:] if frame >= 0 else keep[keep.find("\n") + 1:]
    return f"{first}\n  ... ({len(rest) - len(keep)} characters cut) ...\n{keep}"


def _short(filename: str) -> str:
    """`/srv/code/mypkg/data.py` -> `mypkg/data.py`, by the longest sys.path entry holding
    it; a file under none of them by its name alone."""
    if not os.path.isabs(filename):
        return filename
    best = ""
    for entry in sys.path:
        root = os.path.abspath(entry or ".") + os.sep
        if filename.startswith(root) and len(root) > len(best):
            best = root
    return filename[len(best):] if best else f".../{os.path.basename(filename)}"
