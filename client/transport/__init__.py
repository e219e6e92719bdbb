"""The receive side of one server's stream: its StreamBatches call (stream.py), the frames and
records a batch arrives in and their assembly (frames.py), the data connection beside the call
(datalink.py), and same-host delivery from the server's shared memory (samehost.py).

Threads: each stream's receive threads run this code: `stoker-receive` (the gRPC call's
frames and its end) and `stoker-data` (the data connection's records); credits are written
from the scheduler's caller (any thread, under the stream's own lock).
Imports: stoker.v1 and the client's leaves (_errors, _log); nothing of the fleet, contact or
the loader, which drive it.
"""
