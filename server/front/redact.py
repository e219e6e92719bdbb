"""Server paths kept out of what clients are told (`server.redact_paths`, issue 41).

A message sent to a client (a batch's DATA_LOSS naming its sample's file, an INTERNAL naming
a worker's module) may name where the server keeps its data: folders, a bucket and its
prefix. With redact_paths each such path is cut to its last part, `.../name`, which is
enough to tell samples apart and says nothing of the layout. The server's log keeps the full
text (FailedBatch.detail, BatchFailed.detail).
"""

from __future__ import annotations

import re

# A URL with a scheme (s3://bucket/key, file:///x, https://host/x), or an absolute path of
# at least two parts (/data/a.jpg; a lone `/x` is as likely a ratio or a unit).
_PATH = re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s'\",;()\[\]]+"
                   r"|(?<![\w.~])(?:~|\.{1,2})?/(?:[^\s/'\",;()\[\]]+/)+[^\s/'\",;()\[\]]*")


def _last(match: re.Match[str]) -> str:
    tail = match.group(0).rstrip("/").rsplit("/", 1)[-1]
    return f".../{tail}"


def redact(text: str) -> str:
    """`text` with every path or URL cut to `.../<its last part>`."""
    return _PATH.sub(_last, text)
