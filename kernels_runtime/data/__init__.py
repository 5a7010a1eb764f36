"""Download-free data for distributed demos and tests: a stdlib text corpus and DP batching."""

from kernels_runtime.data.corpus import (
    ByteTokenizer,
    build_stdlib_corpus,
    cache_path,
    stdlib_corpus,
    stdlib_files,
    train_val_split,
)
from kernels_runtime.data.loader import (
    ShardSampler,
    TokenBatches,
    distributed_loader,
    shard_indices,
)

__all__ = [
    "ByteTokenizer",
    "ShardSampler",
    "TokenBatches",
    "build_stdlib_corpus",
    "cache_path",
    "distributed_loader",
    "shard_indices",
    "stdlib_corpus",
    "stdlib_files",
    "train_val_split",
]
