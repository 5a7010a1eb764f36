"""Memory: what training keeps and where model state lives.

``saved_activations`` measures the bytes autograd keeps for backward (the planner's and the
tuner's activation figures). Heterogeneous memory (``offload=static|auto``, the last applier of
``parallelize``, ``offload.py``): parameters, gradients, fp32 masters and optimizer states in
chunks per unit (``chunks.py``), moved between device, host and disk (``tiers.py``,
``disk_traffic.py``, ``disk.py``, ``disk_io.py``, ``spill.py``; freed buffers reused on a
host-only machine, ``buffer_pool.py``) by a placement that keeps them under per-rank budgets and
evicts what is used furthest in the future (``placement.py``), gathered and reduced around each
unit's forward and backward (``chunk_sync.py``) and stepped chunk by chunk on the tier they live
on (``chunk_step.py``; a disk chunk's step at its next use, ``deferred_step.py``; what a
micro-batch keeps for backward reserved, ``activation_reserve.py``). A model built under
``deferred_parameters()`` is materialized here, one unit at a time (``deferred_params.py``)."""
