"""A worker keeps the memory a sample freed for the next sample (glibc's malloc settings).

A sample is made of arrays of hundreds of KiB (an image pipeline decodes a 375x500 JPEG into
549 KiB, resizes it, and normalizes it into 588 KiB of float32), all freed once the sample
is written into its batch's segment. glibc serves such sizes from the heap after the first
few, but gives the heap's freed top back to the kernel once it exceeds its trim threshold
(twice the largest block it has mapped, about a MiB here), so the next sample faults every
page in again and the kernel zeroes each one. In the image pipeline's workers that was about
a sixth of their CPU: 53 -> 45 ms a batch of 32 with the settings below
(`python -m benchmarks --only pipeline_socket`, 2 cores); tests/test_malloc.py counts the
faults.

The settings: blocks under MMAP_THRESHOLD come from the heap, and the heap keeps up to
TRIM_THRESHOLD of freed memory at its top. What a worker keeps is bounded by its own peak
(a sample and its temporaries), as it is while it builds anyway. Setting either turns off
glibc's own adjustment of both, so both are set. Elsewhere than glibc, nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("stoker.server")

# mallopt's parameter numbers (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX): larger arrays are
# mapped and unmapped each time, as before.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 64 << 20


def keep_freed_memory() -> bool:
    """Apply the settings in this process; True if glibc took them."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt to speak of)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    took = (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
            and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1)
    if not took:
        log.debug("malloc settings not taken: freed batch memory goes back to the kernel")
    return took
