"""Tensor parallelism: 1D (Megatron column/row-parallel layers) and 2D / 2.5D grids (``grid/``).

``sharding.py`` cuts a weight into this rank's shard with its ``ParamLayout`` (column, row,
fused QKV by heads, a padded vocabulary); ``layers.py`` holds the column- and row-parallel
linear (also in GPT-2's transposed ``Conv1D`` storage) and the vocabulary-parallel embedding;
``cross_entropy.py`` the loss on vocabulary-parallel logits without gathering them; their
collectives are ``kernels_runtime.comm.autograd``'s. ``tensor_parallel.py`` swaps a model's
modules for them by its policy's plan; ``grid/`` holds the SUMMA (2D) and Tesseract (2.5D)
layers and their communication (``grid_comms.py``), ``grid_parallel.py`` swaps them in;
``lora.py`` splits LoRA adapters along with their base layers. ``applier.py`` is what
``parallelize`` runs first: 1D or a grid by ``tp_mode``, refusing models the policy cannot
read with what to do instead.
"""
