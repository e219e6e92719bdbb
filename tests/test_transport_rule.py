"""The transport rule as docs/design.md states it (its marked table: which path a stream's
batches take, by host, `data_socket` and the server's TLS) holds against what a real server's
handshake (server/front/handshake.py) decides: each row is a real loader against a real server,
its `stats()["transport"]` read after an epoch. A change of the rule in the handshake alone
fails here until the table follows.

"Another host" is a client whose shared-memory probe the server cannot read: a loader with
`shared_memory=False` sends none, which is what the server sees of a client elsewhere (a network
namespace here would still share /dev/shm, and so the host)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from certs import Authority

from stoker.client import RemoteLoader

pytestmark = pytest.mark.timeout(120)

DESIGN = Path(__file__).resolve().parents[1] / "docs" / "design.md"
BEGIN, END = "<!-- transport rule: begin", "<!-- transport rule: end -->"
NOISE = {"noise": {"format": "python", "factory": "toy_datasets:Noise",
                   "options": {"n": 12, "shape": [64, 64]}}}
# The table's words for a path -> RemoteLoader.stats()["transport"]
PATHS = {"data connection": "data_socket", "shared memory": "shm", "gRPC frames": "frames"}


def documented_rule() -> list[tuple[bool, bool, bool, str]]:
    """(same host, data_socket, server TLS, transport) for each row of the marked table."""
    text = DESIGN.read_text()
    table = text[text.index(BEGIN): text.index(END)]
    rows = []
    for line in table.splitlines()[1:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or cells[0] in ("client", "---"):
            continue
        host, socket, tls, path = cells
        assert host in ("same host", "another host"), line
        assert socket in ("`on`", "on", "off", "`off`") and tls in ("yes", "no"), line
        rows.append((host == "same host", socket.strip("`") == "on", tls == "yes",
                     PATHS[path]))
    return rows


def test_the_table_names_every_situation_once() -> None:
    rows = documented_rule()
    situations = [r[:3] for r in rows]
    assert len(rows) == 6 and len(set(situations)) == 6, rows


@pytest.fixture(scope="module")
def servers(start_server_module, tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Any]:
    """TLS or not -> (a server, the client's tls argument for it)."""
    authority = Authority(tmp_path_factory.mktemp("pki"))
    pair = authority.issue("server", server=True)
    tls = start_server_module(NOISE, server={"tls": {"cert_file": str(pair.cert),
                                                     "key_file": str(pair.key)}})
    return {False: (start_server_module(NOISE), {}),
            True: (tls, {"tls": {"ca": str(authority.ca)}})}


@pytest.mark.parametrize("row", documented_rule(),
                         ids=lambda r: re.sub(r"\W+", "-", f"{'same' if r[0] else 'other'}-host"
                                              f"-socket-{r[1]}-tls-{r[2]}-{r[3]}"))
def test_the_handshake_decides_what_the_docs_say(servers, row) -> None:
    same_host, data_socket, tls, expected = row
    server, client_tls = servers[tls]
    with RemoteLoader(server.address, "noise", batch_size=3, output="numpy", shuffle=False,
                      shared_memory=same_host, data_socket=data_socket, timeout=30,
                      **client_tls) as loader:
        assert sum(len(b["sample_index"]) for b in loader) == 12
        stats = loader.stats()
    assert stats["transport"] == expected, (row, stats["transports"])
