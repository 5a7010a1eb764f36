"""Tensor parallelism: 1D (Megatron column/row-parallel layers) and 2D/2.5D grids.

Landed: the 1D building blocks, each tested against one process on 2 and 4 ranks:
``sharding.py`` (a weight cut into this rank's shard with its ``ParamLayout``: column, row,
fused QKV by heads, a padded vocabulary), ``layers.py`` (column- and row-parallel linear, also
in GPT-2's transposed ``Conv1D`` storage; vocabulary-parallel embedding) and
``cross_entropy.py`` (the loss on vocabulary-parallel logits without gathering them); their
collectives are ``kernels_runtime.comm.autograd``'s. Not yet: the applier that swaps a model's
modules for them by its policy's plan, so ``applier.py`` still refuses plans with tp > 1.
"""
