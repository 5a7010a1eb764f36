"""glibc's malloc thresholds while offloading: chunk-sized blocks are mapped (so they leave the
process when freed), smaller ones come from the heap (so activations do not fault their pages
in again every step), and a process keeps the lowest threshold any caller fixed."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from kernels_runtime.memory.host_malloc import MMAP_THRESHOLD, payload_threshold

MiB = 2**20

# In a fresh process (the thresholds are process-wide): whether glibc serves blocks of the
# given sizes with mmap (the IS_MMAPPED bit of the chunk header) after each call.
PROBE = textwrap.dedent("""
    import ctypes, json, sys
    from kernels_runtime.memory.host_malloc import return_freed_memory
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]

    def mapped(nbytes):
        p = libc.malloc(nbytes)
        bit = ctypes.c_size_t.from_address(p - ctypes.sizeof(ctypes.c_size_t)).value & 2
        libc.free(p)
        return bool(bit)

    out = []
    for threshold in json.loads(sys.argv[1]):
        ok = return_freed_memory(threshold) if threshold else return_freed_memory()
        out.append([ok, mapped(256 * 1024), mapped(2 * 2**20), mapped(6 * 2**20)])
    print(json.dumps(out))
""")


def _probe(thresholds: list[int | None]) -> list[list[bool]]:
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's malloc is Linux's")
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(thresholds)],
                          capture_output=True, text=True, timeout=60, check=True)
    out = json.loads(proc.stdout)
    if not out[0][0]:
        pytest.skip("not glibc: the thresholds cannot be set")
    return out


def test_blocks_from_the_threshold_up_are_mapped_and_smaller_ones_are_not():
    # (fixed, 256 KiB mapped, 2 MiB mapped, 6 MiB mapped) after each call
    assert _probe([MiB]) == [[True, False, True, True]]
    assert _probe([4 * MiB]) == [[True, False, False, True]]


def test_a_process_keeps_the_lowest_threshold_fixed():
    # a later, higher request (another model's chunks) does not raise it again
    assert _probe([MiB, 4 * MiB]) == [[True, False, True, True]] * 2
    # the 64 KiB a memory-limited process fixes first stays: every block above it is mapped
    assert _probe([None, 4 * MiB]) == [[True, True, True, True]] * 2


def test_payload_threshold_is_the_smallest_size_of_the_bulk_of_the_bytes():
    blocks, embedding, norm = 12 * MiB, 800 * 1024, 4096
    # eight blocks hold well over 90% of the bytes: the small chunks do not pull it down
    assert payload_threshold([embedding, *[blocks] * 8, norm]) == blocks
    # blocks holding 75% of the bytes: the next size is needed too
    assert payload_threshold([blocks, 4 * MiB] * 4) == 4 * MiB
    assert payload_threshold([]) == MMAP_THRESHOLD
