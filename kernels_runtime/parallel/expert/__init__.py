"""Expert parallelism: the experts of a mixture-of-experts layer split over the ep ranks.

The plan's ``ep`` carves groups of ep adjacent data-parallel ranks out of dp (``mesh``: the
"ep" and "edp" groups); ``parallelize`` runs the appliers here when ep > 1.

- ``dispatch.py``: routing (Mixtral's softmax, top-k, renormalize), the dispatch of token rows to
  their experts' ranks, the local experts, and the combine back (dropless: no token dropped).
- ``dispatch_comms.py``: the variable-split all-to-all those use, with its reverse as backward,
  and the exchange of row counts before it.
- ``expert_compute.py``: the local experts' SwiGLU MLPs, two grouped GEMMs on a GPU that runs
  them, a loop elsewhere (training's ``LocalExperts`` and the engine's ``ServedExperts``).
- ``moe_layer.py``: ``ExpertParallelMoE``, a transformers sparse-MoE block (Mixtral, Qwen2-MoE
  with its shared expert, Qwen3-MoE; read through ``policies.moe``) holding only this rank's
  experts.
- ``modulelist_layer.py``: the same for a block whose experts are an ``nn.ModuleList`` behind a
  router ``nn.Linear`` (read through ``policies.moe_modulelist``): each rank keeps its expert
  modules themselves, under the plain model's names.
- ``applier.py``: the expert applier (which plans and models it runs, and the swap).
- ``data_step.py``, ``grad_sync.py``, ``zero3.py``: the data applier's step under ep: replicas
  made equal per group, non-expert gradients reduced over dp and expert ones over expert-dp
  (ZeRO 0-2 on flat buckets, ZeRO-3 on FSDP2 with the experts as their own unit; under offload
  the memory layer's ``ExpertChunkSync`` runs the chunk sync once per kind, on ``ParamView``).
- ``layouts.py``: each expert slice's box of its global tensor, through which checkpoints save
  it and reshard it under another ep or into one plain process.
- ``aux_loss.py``: the router's load-balancing loss over the whole data-parallel batch, equal
  to HF's on one process; ``router_stats.py``: the same loss under pp, its sums carried from
  stage to stage behind the activation (``stage_aux_loss`` on the last stage).
"""

from kernels_runtime.parallel.expert.aux_loss import load_balancing_loss
from kernels_runtime.parallel.expert.dispatch import Routing, moe_forward, route
from kernels_runtime.parallel.expert.moe_layer import ExpertParallelMoE, is_expert_parameter
from kernels_runtime.parallel.expert.router_stats import stage_aux_loss

__all__ = ["ExpertParallelMoE", "Routing", "is_expert_parameter", "load_balancing_loss",
           "moe_forward", "route", "stage_aux_loss"]
