"""Data for distributed training: a download-free stdlib text corpus and DP batching; rows from
local files sharded over dp ranks, chat SFT examples, padding and packing."""

from kernels_runtime.data.corpus import (
    ByteTokenizer,
    build_stdlib_corpus,
    cache_path,
    stdlib_corpus,
    stdlib_files,
    train_val_split,
)
from kernels_runtime.data.files import (
    eval_batches,
    load_rows,
    shard_order,
    shard_rows,
    train_batches,
)
from kernels_runtime.data.loader import (
    ShardSampler,
    TokenBatches,
    distributed_loader,
    shard_indices,
)
from kernels_runtime.data.packing import counted_tokens, pack, pad_rows
from kernels_runtime.data.sft import chat_example, chat_examples, chat_segments
from kernels_runtime.data.stdlib_qa import build_stdlib_qa, read_jsonl

__all__ = [
    "ByteTokenizer",
    "build_stdlib_qa",
    "read_jsonl",
    "ShardSampler",
    "TokenBatches",
    "build_stdlib_corpus",
    "cache_path",
    "distributed_loader",
    "shard_indices",
    "stdlib_corpus",
    "stdlib_files",
    "train_val_split",
    "chat_example",
    "chat_examples",
    "chat_segments",
    "counted_tokens",
    "eval_batches",
    "load_rows",
    "pack",
    "pad_rows",
    "shard_order",
    "shard_rows",
    "train_batches",
]
