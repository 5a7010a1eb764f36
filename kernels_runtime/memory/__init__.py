"""Memory: what training keeps and where model state lives.

``saved_activations`` measures the bytes autograd keeps for backward (the planner's and the
tuner's activation figures). Heterogeneous memory (``offload=static|auto``, the last applier of
``parallelize``, ``offload.py``): parameters, gradients, fp32 masters and optimizer states in
chunks per unit (``chunks.py``), moved between device, host and disk (``tiers.py``, ``disk.py``,
``spill.py``) by a placement that keeps them under per-rank budgets and evicts what is used
furthest in the future (``placement.py``), gathered and reduced around each unit's forward and
backward (``chunk_sync.py``) and stepped chunk by chunk on the tier they live on
(``chunk_step.py``). A model built under ``deferred_parameters()`` is materialized here, one
unit at a time (``policies/deferred.py``)."""
