"""Sequence parallelism: the sequence split over ranks, three ways (``applier.py`` picks).

- ``split_gather.py``: Megatron sequence parallelism inside the tp group (``tp=N
  sp_mode=split_gather``): norms and dropout on sequence shards, all-gather / reduce-scatter at
  the tp boundaries.
- ``ulysses.py``: DeepSpeed-Ulysses over the sp axis (``sp_mode=all_to_all``): all-to-all from
  sequence shards to head shards around attention.
- ``ring_attention.py`` (+ ``ring_comms.py``, ``zigzag.py``): ring attention over the sp axis
  (``sp_mode=ring``): K/V passed around the ring, online softmax, zig-zag balance.

``shard_inputs.py`` splits an HF model's input by each rank's global positions and joins the
sequence after the blocks; ``hf_attention.py`` puts ring/Ulysses behind transformers' attention
interface. Gradients of the sp ranks' replicated parameters meet in data parallelism, which
folds sp into dp (``ParallelContext.fold_sp``).
"""
