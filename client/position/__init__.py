"""Where a loader is, as plain values: its coordinates, its position and a saved one
(resume.py), the samples it leaves out (exclusions.py), the dataset fingerprint it reads
(fingerprint.py).

Threads: any; these are values (frozen, or owned by the thread that made them) and hold no lock.
Imports: nothing of stoker.client (stoker.v1's messages only): every other room may import this
one.
"""
