"""A user's program that embeds the data server: `serve()` as one task in its own event loop.

Run as `python embedded_server.py CONFIG.yaml` by tests/test_embedded.py, which drives it over
stdin: the line "cancel" cancels the serve() task (as an embedding program does when it shuts
its own part down); end of input ends the program. What it saw is printed as JSON lines:

    {"event": "ready", ...}                  printed by serve() itself
    {"event": "cancelled"|"failed", "before": STATE, "after": STATE, "error": ...}

STATE is what this process holds that serve() could leave behind: its threads, its child
processes, its listening TCP ports, its SIGTERM/SIGINT handlers and (after) the signals the
event loop still had a handler for. The program keeps running after reporting, so the test
can look at ports and shared memory while the process that embedded the server still lives.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import threading
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any

from stoker.server import load_config, serve

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def children() -> list[int]:
    found: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            found.update(int(p) for p in (task / "children").read_text().split())
    return sorted(found)


def listening() -> list[int]:
    """The TCP ports this process listens on (its socket fds matched in /proc/net/tcp*)."""
    inodes = set()
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            link = os.readlink(fd)
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


def state() -> dict[str, Any]:
    return {"threads": sorted(t.name for t in threading.enumerate()),
            "children": children(), "listening": listening(),
            "signals": {s.name: handler(s) for s in SIGNALS}}


def handler(sig: signal.Signals) -> str:
    """Which object handles `sig` (its identity: a repr can change while it stays the same)."""
    found = signal.getsignal(sig)
    return f"{getattr(found, '__qualname__', type(found).__qualname__)} at {id(found):#x}"


async def main(config_path: str) -> None:
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    # Python starts its resource tracker process with the first spawned worker, and it lives
    # as long as this interpreter: start it now, so that `before` already has it.
    resource_tracker.ensure_running()
    before = state()
    task = asyncio.create_task(serve(load_config(config_path)))
    command = asyncio.create_task(stdin.readline())
    await asyncio.wait([task, command], return_when=asyncio.FIRST_COMPLETED)
    report: dict[str, Any] = {"event": "failed" if task.done() else "cancelled"}
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    except Exception as e:  # reported: the test decides
        report["error"] = f"{type(e).__name__}: {e}"
    after = state()
    # remove_signal_handler says whether the loop still had one (and takes it away).
    after["loop_handlers"] = [s.name for s in SIGNALS if loop.remove_signal_handler(s)]
    print(json.dumps({**report, "before": before, "after": after}), flush=True)
    await command
    await stdin.read()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
