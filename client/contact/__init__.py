"""A loader's first words with the servers: the first description (first.py), which servers
hold the data the loader agreed on (agreement.py), and why an address cannot be reached, in
words a user can act on (diagnosis.py; the `stoker` CLI's contact reads it too).

Threads: the loop's thread (first contact and the fingerprint check run before and beside the
loop's batches); gRPC's threads only complete the futures this code waits on.
Imports: position/, fleet/ (the servers it asks) and the client's leaves; never delivery/ or
the loader.
"""
