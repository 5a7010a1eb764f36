"""Freed host memory goes back to the system while offloading.

glibc serves large allocations with ``mmap`` and returns them on ``free``, but only up to a
threshold it raises to the size of every mmapped block freed (up to 32 MiB). Offloading frees
and allocates chunk-sized buffers all step long, so after the first few the threshold is above
the chunk size, buffers come from the heap and stay mapped after ``free``: the process keeps
roughly everything it ever spilled (measured: 1.43 GiB RSS for 180 MiB of resident model state).
Fixing the threshold (which also stops the adjustment) and trimming the heap's top keeps RSS
near what the tiers account for. Process-wide and harmless for the rest of a training process;
nothing happens where the C library is not glibc.

Where the threshold sits matters as much: every block at or above it is mapped on allocation
and unmapped on ``free``, so its pages fault (and are zeroed) again at each first write. At
64 KiB that is every activation of the forward and backward too: measured on the disk tier's
bench model (GPT-2, 25 M parameters, one rank), 0.25-0.3 s of kernel time per 0.7 s step on the
compute thread, and several times that on a loaded machine. The offload applier therefore
places it just under the payloads that hold most of the model state's bytes
(``payload_threshold``): those, the buffers that come and go, still leave the process when
freed, while smaller temporaries are reused from the heap as without offloading. A process
keeps the lowest threshold any caller asked for (a memory-limited process that fixed 64 KiB
first keeps it), and the trim threshold is twice the mmap one, as glibc pairs them itself.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 64 * 2**10
TRIM_THRESHOLD = 4 * 2**20
MAX_THRESHOLD = 32 * 2**20  # glibc's own ceiling for the mmap threshold (64-bit)
BULK = 0.9  # the share of the payloads' bytes whose buffers must stay mapped blocks

_set: list[int] = []  # the threshold this process fixed, once fixed


@functools.cache
def _mallopt():  # noqa: ANN202 - libc's mallopt, or None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return None


def return_freed_memory(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's malloc thresholds: blocks of ``threshold`` bytes and more are mapped and
    go back to the system when freed. The process keeps the lowest threshold asked for; False
    where that is not possible."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    threshold = max(MMAP_THRESHOLD, min(int(threshold), MAX_THRESHOLD))
    if _set and _set[0] <= threshold:
        return True
    trim = max(TRIM_THRESHOLD, 2 * threshold)
    if not (mallopt(M_MMAP_THRESHOLD, threshold) and mallopt(M_TRIM_THRESHOLD, trim)):
        return False
    _set[:] = [threshold]
    return True


def payload_threshold(sizes: list[int]) -> int:
    """The largest threshold under which the payloads holding ``BULK`` of the bytes (the
    largest first) still fall: the smallest size among them."""
    total, held = sum(sizes), 0
    for size in sorted(sizes, reverse=True):
        held += size
        if held >= BULK * total:
            return size
    return MMAP_THRESHOLD
