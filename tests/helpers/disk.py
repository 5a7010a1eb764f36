"""A folder on a real disk for tests of the disk tier (the spill folder refuses tmpfs)."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from helpers.prereq import require_or_skip

REPO = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def disk_folder(first: Path, prefix: str) -> Iterator[Path]:
    """``first`` where it is on a disk, else a fresh folder under /var/tmp or the checkout,
    removed afterwards. A machine with no disk at all fails in CI (it must run the disk tier's
    tests) and skips elsewhere, as ``helpers.prereq`` does for daemons."""
    from kernels_runtime.memory.spill import MEMORY_FILESYSTEMS, mount_of

    if mount_of(first)[1] not in MEMORY_FILESYSTEMS:
        yield first
        return
    for parent in (Path("/var/tmp"), REPO / "artifacts"):
        if parent.is_dir() and mount_of(parent)[1] not in MEMORY_FILESYSTEMS:
            folder = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
            try:
                yield folder
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            return
    require_or_skip(f"no folder on a disk: {first}, /var/tmp and {REPO} are in memory "
                    f"({mount_of(first)[1]})")
