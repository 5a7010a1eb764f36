"""Tensor parallelism: 1D (Megatron column/row-parallel layers); 2D/2.5D grids still to come.

``sharding.py`` cuts a weight into this rank's shard with its ``ParamLayout`` (column, row,
fused QKV by heads, a padded vocabulary); ``layers.py`` holds the column- and row-parallel
linear (also in GPT-2's transposed ``Conv1D`` storage) and the vocabulary-parallel embedding;
``cross_entropy.py`` the loss on vocabulary-parallel logits without gathering them; their
collectives are ``kernels_runtime.comm.autograd``'s. ``tensor_parallel.py`` swaps a model's
modules for them by its policy's plan, and ``applier.py`` is what ``parallelize`` runs first:
it refuses tp_mode 2d/2.5d, and models the policy cannot read, with what to do instead.
"""
