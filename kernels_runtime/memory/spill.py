"""Where the disk tier keeps its files: one folder per rank, on a real disk, removed at exit.

On a machine without an accelerator "device" and "host" memory are the same RAM, so disk is
the only tier that lowers resident memory, and only if the files are on a disk: a folder on
tmpfs or ramfs is RAM too (and a cgroup memory limit counts it), so ``SpillDir`` refuses one
with a message that says how to choose another. It also proves the folder writable by writing a
probe file (permission bits say nothing to root, and nothing about a read-only mount).

Layout: ``<root>/<pool>/rank<rank>/``. The pool is the engine pool's id (``WORKBENCH_POOL_ID``),
so ranks of one pool share a parent and a restarted pool finds its dead ranks' folders; each
rank folder has an ``owner.json`` (pid, host, start time) by which ``remove_stale`` tells a dead
owner's folder from a live one without touching other pools.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import shutil
import socket
import time
from pathlib import Path

import psutil

SPILL_ENV = "WORKBENCH_SPILL_DIR"
POOL_ENV = "WORKBENCH_POOL_ID"
MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")
OWNER_FILE = "owner.json"
FIX = (f"pass parallelize(..., spill_dir=...) or set {SPILL_ENV} to a writable folder on a "
       "disk")
_RANK_FOLDER = re.compile(r"rank\d+")
_HELD: set[Path] = set()  # folders held by a SpillDir of this process (until its cleanup)


class SpillError(OSError):
    """The spill directory cannot be used; the message names it, the problem and the fix."""


class SpillDirNotWritable(SpillError):
    pass


class SpillDirInMemory(SpillError):
    pass


class SpillDirInUse(SpillError):
    pass


def spill_root(spill_dir: str | os.PathLike | None = None) -> Path:
    """The folder spill directories go under: ``spill_dir``, else ``$WORKBENCH_SPILL_DIR``, else
    ``workbench-spill`` in Jupyter's runtime folder (``~/.cache/colossal-workbench`` without
    jupyter_core)."""
    chosen = spill_dir if spill_dir is not None else os.environ.get(SPILL_ENV)
    if chosen:
        return Path(chosen).expanduser()
    try:
        from jupyter_core.paths import jupyter_runtime_dir
        base = Path(jupyter_runtime_dir())
    except ImportError:
        base = Path("~/.cache/colossal-workbench").expanduser()
    return base / "workbench-spill"


def _unescape(field: str) -> str:
    """Mount tables write space, tab, newline and backslash as octal escapes (``\\040``)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _mounts() -> list[tuple[str, str]]:
    """(mount point, filesystem type) of every mount, in mount order."""
    try:
        with open("/proc/self/mountinfo") as table:  # fields ... mountpoint ... - fstype ...
            rows = [line.split() for line in table]
        return [(_unescape(r[4]), r[r.index("-") + 1]) for r in rows if "-" in r]
    except OSError:
        try:
            with open("/proc/mounts") as table:  # device mountpoint fstype options ...
                return [(_unescape(r[1]), r[2]) for r in map(str.split, table) if len(r) > 2]
        except OSError:  # not Linux: no mount table to read
            return []


def mount_of(path: str | os.PathLike) -> tuple[Path, str]:
    """(mount point, filesystem type) of the mount holding ``path`` (which need not exist yet:
    a folder created there lands on its nearest existing ancestor's mount); ``("/", "")`` when
    the platform has no mount table."""
    resolved = Path(path).expanduser().resolve()
    best, kind = Path("/"), ""
    for point, fstype in _mounts():
        mount = Path(point)
        # the longest mount point containing the path; a later mount of the same point hides
        # the earlier one, so ties go to the later row
        if resolved.is_relative_to(mount) and len(mount.parts) >= len(best.parts):
            best, kind = mount, fstype
    return best, kind


def _process_start(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def _owner_alive(owner: dict) -> bool:
    """Whether the process that wrote ``owner`` still runs (a reused pid has a later start
    time; a zombie has finished). Unreadable owners of another host count as alive."""
    if owner.get("hostname") != socket.gethostname():
        return True
    pid = owner.get("pid")
    if not isinstance(pid, int):
        return False
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        started = process.create_time()
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # access denied: it exists, leave it be
        return True
    recorded = owner.get("process_start")
    return not isinstance(recorded, (int, float)) or abs(started - recorded) < 1.0


def _read_owner(folder: Path) -> dict | None:
    try:
        owner = json.loads((folder / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None


class SpillDir:
    """This rank's spill folder ``root/<pool>/rank<rank>``, checked, created (mode 0700) and
    removed again by ``cleanup()`` or at the process's normal exit.

    ``pool`` defaults to ``$WORKBENCH_POOL_ID``, else ``process-<pid>`` (a folder of its own).
    A folder left by a dead owner is emptied and reused; one of a live other process is refused.
    """

    def __init__(self, root: Path, rank: int, pool: str | None = None) -> None:
        self.root = Path(root).expanduser()
        self.rank = rank
        self.pool = pool or os.environ.get(POOL_ENV) or f"process-{os.getpid()}"
        self.path = self.root / self.pool / f"rank{rank}"
        self._owner_pid = os.getpid()
        self._held = False
        self._check_on_disk()
        self._claim()
        self._create()
        self._probe()
        self._write_owner()
        _HELD.add(self.path.resolve())
        self._held = True
        atexit.register(self._remove_at_exit)

    def _check_on_disk(self) -> None:
        mount, fstype = mount_of(self.path)
        if fstype in MEMORY_FILESYSTEMS:
            raise SpillDirInMemory(
                f"spill directory {self.path} is on {fstype} (mounted at {mount}), which is "
                f"RAM: spilling there frees no memory; {FIX}")

    def _claim(self) -> None:
        if self.path.resolve() in _HELD:
            raise SpillDirInUse(f"spill directory {self.path} is already used by another "
                                "SpillDir of this process; call its cleanup() first")
        if not self.path.is_dir():
            return
        owner = _read_owner(self.path)
        if owner is not None and owner.get("pid") != os.getpid() and _owner_alive(owner):
            raise SpillDirInUse(
                f"spill directory {self.path} belongs to live process {owner.get('pid')} on "
                f"{owner.get('hostname')}; give this process a pool of its own ({POOL_ENV}) "
                f"or {FIX}")
        shutil.rmtree(self.path, ignore_errors=True)  # a dead owner's files are worthless

    def _create(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            for _ in range(3):  # a pool folder removed by a finishing rank meanwhile: again
                try:
                    (self.root / self.pool).mkdir(exist_ok=True, mode=0o700)
                    self.path.mkdir(exist_ok=True, mode=0o700)
                    break
                except FileNotFoundError:
                    continue
            self.path.chmod(0o700)
        except OSError as e:
            raise SpillDirNotWritable(
                f"spill directory {self.path} cannot be created ({e.strerror or e}); {FIX}"
            ) from e

    def _probe(self) -> None:
        probe = self.path / f".probe-{os.getpid()}"
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, b"spill probe")
            finally:
                os.close(fd)
            probe.unlink()
        except OSError as e:
            raise SpillDirNotWritable(
                f"spill directory {self.path} is not writable ({e.strerror or e}); {FIX}"
            ) from e

    def _write_owner(self) -> None:
        owner = {"pid": os.getpid(), "hostname": socket.gethostname(), "start_time": time.time(),
                 "process_start": _process_start(os.getpid())}
        partial = self.path / f".{OWNER_FILE}.tmp"
        partial.write_text(json.dumps(owner))
        partial.replace(self.path / OWNER_FILE)  # never read half-written

    def _remove_at_exit(self) -> None:
        # a forked child exiting does not own the folder; a second call must not remove the
        # folder of a later SpillDir of the same path
        if os.getpid() != self._owner_pid or not self._held:
            return
        self._held = False
        _HELD.discard(self.path.resolve())
        shutil.rmtree(self.path, ignore_errors=True)
        with contextlib.suppress(OSError):  # other ranks' folders still there, or gone
            self.path.parent.rmdir()

    def cleanup(self) -> None:
        """Remove the folder (and the pool's folder once empty). Safe to call again."""
        atexit.unregister(self._remove_at_exit)
        self._remove_at_exit()

    def __repr__(self) -> str:
        return f"SpillDir({str(self.path)!r})"


def remove_stale(root: Path, pool: str) -> list[Path]:
    """Remove ``pool``'s rank folders whose owner no longer runs on this host (after a restart,
    the dead ranks' spill); other pools and live owners are untouched. Returns what went."""
    removed = []
    pool_folder = Path(root).expanduser() / pool
    if not pool_folder.is_dir():
        return removed
    for folder in sorted(pool_folder.iterdir()):
        if not (_RANK_FOLDER.fullmatch(folder.name) and folder.is_dir()):
            continue
        owner = _read_owner(folder)
        if owner is None or _owner_alive(owner):  # no owner yet: maybe being created now
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed
