"""Moving a tensor's bytes to and from a file without the page cache: direct I/O where the
filesystem takes it, else writes flushed and dropped from the cache.

Why direct I/O: spilled bytes must leave RAM (a file just written or read sits in the page
cache, which a cgroup memory limit counts), and the cached way is slow: measured on this
project's VM disk (ext4 on virtio), chunk-sized files moved at 475-640 MB/s written with
``fdatasync`` + ``POSIX_FADV_DONTNEED`` and 350-450 MB/s read through the cache, against
1.5-1.7 GB/s and 1.1-1.5 GB/s with ``O_DIRECT``. Direct I/O needs the buffer, the length and
the file offset aligned to the device's block (``ALIGN``): ``aligned_empty`` allocates tensors
that start on a boundary and own their bytes up to the next one, so the disk reads and writes
them in place; any other tensor goes through a per-thread aligned bounce buffer a window at a
time. A file's true size is set with ``ftruncate`` after its last (rounded up) block.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time
from pathlib import Path

import torch

ALIGN = 4096  # direct I/O's alignment of buffers, lengths and offsets (a page: every device's)
WINDOW = 4 * 2**20  # bytes a bounce buffer moves at a time (one per I/O thread)
CACHE_WINDOW = 64 * 2**20  # the most page cache one cached read or write holds at a time
_sync = getattr(os, "fdatasync", os.fsync)  # macOS has no fdatasync
DIRECT = getattr(os, "O_DIRECT", 0)


def round_up(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def aligned_empty(numel: int, dtype: torch.dtype, pin_memory: bool = False) -> torch.Tensor:
    """An uninitialised 1-D tensor whose data starts on an ``ALIGN`` boundary and whose
    storage holds its bytes rounded up to the next boundary: direct I/O moves it in place.
    Pinned memory starts on a page already (and its allocator rounds sizes up to powers of
    two, so a page more could double a block): only the length is rounded there."""
    nbytes = numel * dtype.itemsize
    raw = torch.empty(round_up(nbytes), dtype=torch.uint8, pin_memory=pin_memory) \
        if pin_memory else None
    if raw is None or raw.data_ptr() % ALIGN:
        raw = torch.empty(round_up(nbytes) + ALIGN, dtype=torch.uint8, pin_memory=pin_memory)
    start = (-raw.data_ptr()) % ALIGN
    return raw[start:start + nbytes].view(dtype)


def _padded_bytes(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor's bytes rounded up to ``ALIGN`` as a uint8 view of its own storage, when it
    is aligned and owns them; else None (a bounce buffer is needed)."""
    nbytes = tensor.numel() * tensor.element_size()
    start = tensor.storage_offset() * tensor.element_size()
    storage = tensor.untyped_storage()
    if tensor.data_ptr() % ALIGN or storage.nbytes() - start < round_up(nbytes):
        return None
    return torch.empty(0, dtype=torch.uint8).set_(storage, start, (round_up(nbytes),))


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (any dtype, bfloat16 included), shared."""
    return tensor.detach().reshape(-1).view(torch.uint8)


class _Bounce(threading.local):
    """One aligned window per I/O thread (anonymous mmap: page-aligned)."""

    def get(self) -> torch.Tensor:
        if not hasattr(self, "tensor"):
            self.buffer = mmap.mmap(-1, WINDOW)
            self.tensor = torch.frombuffer(self.buffer, dtype=torch.uint8)
        return self.tensor


_bounce = _Bounce()


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):  # one write moves at most ~2 GiB on Linux
        done += os.pwrite(fd, data[done:], offset + done)


def _pread_all(fd: int, data: memoryview, offset: int) -> int:
    """Fill ``data`` from ``offset``; the bytes read (fewer only where the file ended)."""
    done = 0
    while done < len(data):
        got = os.preadv(fd, [data[done:]], offset + done)
        if got == 0:
            break
        done += got
    return done


def write_direct(fd: int, tensor: torch.Tensor) -> None:
    """Write the tensor's bytes at offset 0 of ``fd`` (opened with ``O_DIRECT``) and set the
    file's size to exactly them."""
    nbytes = tensor.numel() * tensor.element_size()
    own = _padded_bytes(tensor)
    if own is not None:
        _pwrite_all(fd, memoryview(own.numpy()), 0)
    else:
        data, bounce = _byte_view(tensor), _bounce.get()
        for start in range(0, nbytes, WINDOW):
            n = min(WINDOW, nbytes - start)
            bounce[:n].copy_(data[start:start + n])  # releases the GIL
            _pwrite_all(fd, memoryview(bounce.numpy())[:round_up(n)], start)
    os.ftruncate(fd, nbytes)


def read_direct(fd: int, out: torch.Tensor) -> int:
    """Fill ``out`` from offset 0 of ``fd`` (opened with ``O_DIRECT``); the bytes read."""
    nbytes = out.numel() * out.element_size()
    own = _padded_bytes(out)
    if own is not None:
        return min(nbytes, _pread_all(fd, memoryview(own.numpy()), 0))
    data, bounce, done = _byte_view(out), _bounce.get(), 0
    for start in range(0, nbytes, WINDOW):
        n = min(WINDOW, nbytes - start)
        got = min(n, _pread_all(fd, memoryview(bounce.numpy())[:round_up(n)], start))
        data[start:start + got].copy_(bounce[:got])
        done += got
        if got < n:
            break
    return done


def drop_page_cache(fd: int, offset: int = 0, length: int = 0) -> None:
    """Ask the kernel to forget the cached pages of ``fd``'s file (clean pages only; length 0:
    to the end)."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def write_cached(fd: int, tensor: torch.Tensor) -> None:
    """Without direct I/O: write a window at a time, each flushed and dropped from the cache
    before the next, so a large tensor never holds more than a window of page cache."""
    data = memoryview(_byte_view(tensor).numpy())
    for start in range(0, len(data), CACHE_WINDOW):
        window = data[start:start + CACHE_WINDOW]
        _pwrite_all(fd, window, start)
        _sync(fd)
        drop_page_cache(fd, start, len(window))
    os.ftruncate(fd, len(data))


def read_cached(fd: int, out: torch.Tensor) -> int:
    """Without direct I/O: fill ``out`` a window at a time, dropping each window's cache."""
    data = memoryview(_byte_view(out).numpy())
    done = 0
    while done < len(data):
        n = min(CACHE_WINDOW, len(data) - done)
        got = _pread_all(fd, data[done:done + n], done)
        drop_page_cache(fd, done, got)
        done += got
        if got < n:
            break
    return done


def direct_io_works(folder: Path) -> bool:
    """Whether files of ``folder`` take ``O_DIRECT`` (tmpfs, some FUSE and network filesystems
    refuse it): one aligned block written and read back."""
    if not DIRECT:
        return False
    path = Path(folder) / f".direct-{os.getpid()}-{threading.get_ident()}"
    block = aligned_empty(ALIGN, torch.uint8).fill_(7)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | DIRECT, 0o600)
        try:
            write_direct(fd, block)
            return read_direct(fd, block) == ALIGN
        finally:
            os.close(fd)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return False
        raise
    finally:
        path.unlink(missing_ok=True)


def measure_disk_bandwidth(folder: Path, nbytes: int = 256 * 2**20) -> tuple[float, float]:
    """(write, read) bytes per second of one sequential file of ``nbytes`` in ``folder``, the
    page cache bypassed: O_DIRECT with an aligned buffer where the filesystem takes it, else
    written with ``fdatasync`` and its cache dropped before reading. The file is removed."""
    block = 8 * 2**20
    buffer = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    buffer.write(os.urandom(4096) * (block // 4096))  # incompressible-ish, not zeros
    total = max(4096, -(-nbytes // 4096) * 4096)
    path = Path(folder) / f".bandwidth-{os.getpid()}-{threading.get_ident()}.tmp"
    try:
        direct = DIRECT
        try:
            write_s = _timed_write(path, buffer, total, direct)
        except OSError as e:
            if not direct or e.errno != errno.EINVAL:
                raise
            direct = 0  # the filesystem refuses O_DIRECT (or its alignment): the cache way
            write_s = _timed_write(path, buffer, total, direct)
        read_s = _timed_read(path, buffer, direct)
    finally:
        path.unlink(missing_ok=True)
        buffer.close()
    return total / max(write_s, 1e-9), total / max(read_s, 1e-9)


def _timed_write(path: Path, buffer: mmap.mmap, total: int, direct: int) -> float:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct, 0o600)
    try:
        with memoryview(buffer) as view:  # released before the buffer is closed
            start = time.perf_counter()
            done = 0
            while done < total:
                done += os.write(fd, view[:min(len(view), total - done)])
            _sync(fd)
            seconds = time.perf_counter() - start
        drop_page_cache(fd)
    finally:
        os.close(fd)
    return seconds


def _timed_read(path: Path, buffer: mmap.mmap, direct: int) -> float:
    fd = os.open(path, os.O_RDONLY | direct)
    try:
        drop_page_cache(fd)
        start = time.perf_counter()
        while os.readv(fd, [buffer]):
            pass
        seconds = time.perf_counter() - start
        drop_page_cache(fd)
    finally:
        os.close(fd)
    return seconds
