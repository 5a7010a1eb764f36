"""A small, real text corpus that needs no download: the Python standard library's own source.

Demos and tests want text a language model can actually learn (so loss curves mean something),
but engines often have no network. Every rank already has the stdlib on disk, so we concatenate
its ``*.py`` files in sorted order and treat the result as byte tokens (vocab 256, no tokenizer
files). The corpus is cached as raw bytes so later calls, and other ranks, skip the directory walk;
the cache is written atomically because several ranks commonly build it at the same moment.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import tempfile
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from kernels_runtime.user_cache import cache_root

# Bumped whenever the selection or separator changes, so stale caches are never reused.
_FORMAT = "v1"
# Directory names that hold tests, vendored packages or bytecode rather than library source.
_SKIP_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)


class ByteTokenizer:
    """UTF-8 bytes as tokens: nothing to download, and any text round-trips exactly."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int] | torch.Tensor) -> str:
        """Decode ids; sampled byte sequences may split a character, hence ``errors="replace"``."""
        if isinstance(ids, torch.Tensor):
            ids = ids.flatten().tolist()
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def _skipped_dir(name: str) -> bool:
    return name in _SKIP_DIRS or name.endswith(("_test", "_tests"))


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """The stdlib's library ``*.py`` files, as paths relative to ``root``, in sorted order."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    rels: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place: site-packages and test/ are larger than the library itself.
        dirnames[:] = [d for d in dirnames if not _skipped_dir(d)]
        here = Path(dirpath).relative_to(root)
        rels += [here / f for f in filenames if f.endswith(".py")]
    return sorted(rels, key=lambda r: r.as_posix())


def _iter_chunks(root: Path) -> Iterator[bytes]:
    """Separator-prefixed file contents; files that are not valid UTF-8 are skipped."""
    for rel in stdlib_files(root):
        data = (root / rel).read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if data:
            yield f"\n# ==== {rel.as_posix()} ====\n".encode() + data


def build_stdlib_corpus(max_bytes: int | None = None) -> bytes:
    """Walk the stdlib and return the concatenated corpus, stopping once ``max_bytes`` are in."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: list[bytes] = []
    total = 0
    for chunk in _iter_chunks(root):
        parts.append(chunk)
        total += len(chunk)
        if max_bytes is not None and total >= max_bytes:
            break
    if not parts:
        raise RuntimeError(f"no readable *.py files under the stdlib directory {root}")
    data = b"".join(parts)
    return data if max_bytes is None else data[:max_bytes]


def cache_path(max_bytes: int | None, cache_dir: str | Path | None = None) -> Path:
    """Where the corpus for this interpreter version and size lives (the file may not exist)."""
    base = cache_root(cache_dir)
    v = sys.version_info
    tag = f"{sys.implementation.name}{v.major}.{v.minor}.{v.micro}"
    size = "all" if max_bytes is None else str(max_bytes)
    return base / f"stdlib-corpus-{_FORMAT}-{tag}-{size}.bin"


def _write_atomic(path: Path, data: bytes) -> None:
    """Write to a unique temp file beside ``path`` then rename, so readers never see a prefix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _as_tensor(data: bytes | bytearray) -> torch.Tensor:
    # frombuffer shares memory; a bytearray is writable, so torch does not warn.
    buf = data if isinstance(data, bytearray) else bytearray(data)
    return torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)


def stdlib_corpus(
    max_bytes: int | None = 2_000_000, cache_dir: str | Path | None = None
) -> torch.Tensor:
    """The first ``max_bytes`` bytes of the stdlib corpus as a 1-D uint8 tensor (None: all).

    The cache directory is ``cache_dir``, else ``$WORKBENCH_CACHE_DIR``, else
    ``~/.cache/colossal-workbench``. The cache holds raw bytes only (no pickle), so reading it
    cannot execute code. An unwritable cache directory only costs a rebuild next time.
    """
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive or None, got {max_bytes}")
    path = cache_path(max_bytes, cache_dir)
    if path.is_file():
        data = bytearray(path.read_bytes())
        if data and (max_bytes is None or len(data) <= max_bytes):
            return _as_tensor(data)
    data = build_stdlib_corpus(max_bytes)
    try:
        _write_atomic(path, data)
    except OSError as e:
        warnings.warn(f"could not cache the corpus at {path}: {e}", stacklevel=2)
    return _as_tensor(data)


def train_val_split(
    tokens: torch.Tensor, val_fraction: float = 0.05
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a 1-D token tensor into a leading train part and a trailing validation part.

    A contiguous tail (not random windows) keeps validation text unseen during training.
    Both parts are views of ``tokens``.
    """
    if tokens.dim() != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    n_val = max(1, int(round(tokens.numel() * val_fraction)))
    n_train = tokens.numel() - n_val
    if n_train < 1:
        raise ValueError(f"{tokens.numel()} tokens are too few to split with {val_fraction=}")
    return tokens[:n_train], tokens[n_train:]
