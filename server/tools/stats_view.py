"""`stoker stats HTTP_ADDRESS [--watch SECONDS]`: the live page (`/`) in a terminal, read from
the server's `/v1/stats` (the standard library's HTTP client: the client extra has no other).

The table has the live page's columns: per dataset, samples/s, batches/s, MB/s over the
server's rate window, open streams, and the data stall its clients report.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from .connect import CONTACT_SECONDS, TLS_FLAGS, Security, add_security, https_context, security

CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear screen: a terminal redraws in place


class StatsError(Exception):
    """The stats could not be read; the message names the address and what to change."""


def stats_url(address: str, sec: Security) -> str:
    """The /v1/stats URL for `host:port` or a URL (https when a --tls option is given)."""
    if "://" in address:
        return address.rstrip("/") + "/v1/stats"
    return f"{'https' if sec.uses_tls else 'http'}://{address}/v1/stats"


def fetch(address: str, sec: Security, timeout: float = CONTACT_SECONDS) -> dict[str, Any]:
    """The server's /v1/stats; StatsError with a one-line explanation."""
    url = stats_url(address, sec)
    request = urllib.request.Request(url, headers={"accept": "application/json"})
    if sec.token is not None:
        request.add_header("authorization", f"Bearer {sec.token}")
    context = https_context(sec, "stats")
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        if e.code == 401:
            what = ("the server needs a token: pass --token-file FILE or set $STOKER_TOKEN"
                    if sec.token_source is None else
                    f"the server refused the token from {sec.token_source}")
            raise StatsError(f"{url}: 401 Unauthorized: {what}") from None
        if e.code == 404:
            raise StatsError(f"{url}: 404: not a stoker HTTP port?") from None
        raise StatsError(f"{url}: HTTP {e.code}: {e.reason}") from None
    except urllib.error.URLError as e:
        raise StatsError(explain_url(url, e.reason, sec)) from None
    except http.client.RemoteDisconnected as e:
        raise StatsError(explain_url(url, e, sec)) from None
    except http.client.HTTPException as e:  # an answer that is not HTTP/1.1
        raise StatsError(_not_http(url, str(e.args[0] if e.args else ""), sec)) from None
    except (ConnectionError, TimeoutError, OSError, ValueError) as e:
        raise StatsError(explain_url(url, e, sec)) from None


def _not_http(url: str, line: str, sec: Security) -> str:
    if line.startswith("\x15\x03") and not sec.uses_tls:  # a TLS alert record
        return f"{url}: the server speaks TLS: pass {TLS_FLAGS}"
    if line.startswith("\x00\x00"):  # an HTTP/2 frame: the gRPC port
        return (f"{url}: this is the gRPC port: `stoker stats` reads the HTTP port "
                "(`http_port:`, 8080 by default)")
    return f"{url}: the answer is not HTTP/1.1: {line[:40]!r}"


def explain_url(url: str, reason: Any, sec: Security) -> str:
    """One line for a failed HTTP(S) read of `url`: what to change."""
    text = str(reason)
    low = text.lower()
    if isinstance(reason, ConnectionRefusedError) or "refused" in low:
        return (f"{url}: connection refused: no server listens there (is this its HTTP port, "
                "`http_port:` in its config, 8080 by default?)")
    if isinstance(reason, TimeoutError) or "timed out" in low:
        return f"{url}: no answer within {CONTACT_SECONDS:g} s: a wrong host or port?"
    if "wrong version number" in low or "record layer failure" in low:
        return f"{url}: TLS handshake failed: the server does not use TLS; drop the --tls options"
    if "certificate verify failed" in low:
        return f"{url}: the server's certificate is not signed by a CA we trust: pass --tls-ca"
    closed = "remote end closed" in low or "reset" in low or "eof" in low
    if closed and not sec.uses_tls:
        return f"{url}: the server closed the connection: it may need TLS; pass {TLS_FLAGS}"
    if closed:
        return (f"{url}: the server closed the TLS connection: if it requires client "
                "certificates (client_ca_file), pass --tls-cert and --tls-key")
    if "ssl" in low or "tls" in low or "handshake" in low:
        return (f"{url}: TLS failed: {text} (check --tls-ca and, for mutual TLS, --tls-cert "
                "and --tls-key)")
    return f"{url}: {text}"


def table(stats: dict[str, Any], address: str) -> str:
    """The live page's figures as text."""
    head = (f"{address}: {stats['workers']} workers, {stats['queued_batches']} batches "
            f"queued, {stats['building_batches']} building, {stats.get('worker_timeouts', 0)}"
            f" worker timeouts{' - DRAINING' if stats['draining'] else ''} "
            f"(rates over the last {stats['window_seconds']:g} s)")
    lines = [head, "",
             f"{'dataset':<24}{'samples/s':>11}{'batches/s':>11}{'MB/s':>9}{'streams':>9}"
             f"  clients' data stall"]
    for name, d in sorted(stats["datasets"].items()):
        stalls = d.get("client_stalls") or []
        stall = ("none reported" if not stalls else
                 f"{100 * sum(stalls) / len(stalls):.1f}% ({len(stalls)} client"
                 f"{'s' if len(stalls) > 1 else ''})")
        lines.append(f"{name:<24}{d['samples_per_s']:>11.1f}{d['batches_per_s']:>11.1f}"
                     f"{d['bytes_per_s'] / 1e6:>9.2f}{d.get('streams', 0):>9}  {stall}")
        components = d.get("components") or {}
        total = sum(components.values())
        if total:  # a mixture: samples of each component since the server started
            lines.append("  " + ", ".join(f"{c} {n} ({n / total:.1%})"
                                          for c, n in components.items()))
    if not stats["datasets"]:
        lines.append("(no traffic yet)")
    return "\n".join(lines)


def show(args: argparse.Namespace) -> int:
    if args.watch is not None and args.watch <= 0:
        print("--watch: expected seconds > 0", file=sys.stderr)
        return 2
    try:
        sec = security(args)
        https_context(sec, "stats")
    except ValueError as e:
        print(e, file=sys.stderr)
        return 1
    redraw = args.watch is not None and sys.stdout.isatty()
    shown = 0
    try:
        while True:
            try:
                text = table(fetch(args.address, sec), args.address)
            except StatsError as e:
                print(e, file=sys.stderr)
                return 1
            shown += 1
            if redraw:
                print(CLEAR + text, flush=True)
            else:
                print(text + ("\n" if args.watch is not None else ""), flush=True)
            if args.watch is None or (args.count is not None and shown >= args.count):
                return 0
            time.sleep(args.watch)  # the refresh interval the user asked for
    except KeyboardInterrupt:
        return 0


def add_command(sub: Any) -> None:
    st = sub.add_parser("stats", help="a running server's live figures (/v1/stats) as a table")
    st.add_argument("address", help="host:port of the server's HTTP port (http_port), or a URL")
    st.add_argument("--watch", type=float, metavar="SECONDS",
                    help="refresh every SECONDS until Ctrl-C")
    st.add_argument("--count", type=int, metavar="N", help="with --watch: stop after N tables")
    add_security(st)
    st.set_defaults(func=show)
