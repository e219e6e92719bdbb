"""The `stoker.client` logger, and what it shows in a program that set up no logging.

Python shows only WARNING and above until a program configures logging (through
`logging.lastResort`, message only), so `log_every`'s INFO lines, and the line saying what a
loader waits for, would print nothing in a plain training script. So `say()` writes INFO and
above to stderr itself, as `stoker.client: message`, while logging is unconfigured: no
handler on the root logger or on a `stoker` logger, and no level set on a `stoker` logger.
Once the program configures logging (basicConfig, dictConfig, a handler or a level of its
own) its configuration alone decides, as for any library. Decided at each line, so logging
configured after the loader was made is respected too.

Threading: say() may be called from any thread.
"""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("stoker.client")
_OURS = ("stoker.client", "stoker")


def configured() -> bool:
    """The program set up logging (a handler anywhere on our path, or a level on ours)."""
    for name in _OURS:
        logger = logging.getLogger(name)
        if logger.handlers or logger.level != logging.NOTSET:
            return True
    return bool(logging.getLogger().handlers)


def say(level: int, msg: str, *args: object) -> None:
    """Log `msg % args` on `stoker.client` at `level`; unconfigured, INFO and above go to
    stderr (through tqdm.write when tqdm is loaded, so that a progress bar stays whole)."""
    if configured():
        log.log(level, msg, *args)
        return
    if level < logging.INFO:
        return  # as logging would: DEBUG needs a configuration that asks for it
    tag = "" if level < logging.WARNING else f"{logging.getLevelName(level)}: "
    line = f"stoker.client: {tag}{msg % args if args else msg}"
    tqdm = sys.modules.get("tqdm")
    if tqdm is not None and hasattr(tqdm, "tqdm"):
        tqdm.tqdm.write(line, file=sys.stderr)
    else:
        print(line, file=sys.stderr, flush=True)
