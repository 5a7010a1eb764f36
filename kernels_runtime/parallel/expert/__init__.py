"""Expert parallelism: the experts of a mixture-of-experts layer split over the ep axis.

- ``dispatch.py``: routing (Mixtral's softmax, top-k, renormalize), the dispatch of token rows to
  their experts' ranks, the local experts, and the combine back (dropless: no token dropped).
- ``dispatch_comms.py``: the variable-split all-to-all those use, with its reverse as backward,
  and the exchange of row counts before it.
- ``moe_layer.py``: ``ExpertParallelMoE``, a transformers Mixtral sparse-MoE block holding only
  this rank's experts.

Not yet wired into ``Plan``/``parallelize``: a caller swaps the blocks and sums the replicated
parameters' gradients over ep itself (``is_expert_parameter`` tells which to skip).
"""

from kernels_runtime.parallel.expert.dispatch import Routing, moe_forward, route
from kernels_runtime.parallel.expert.moe_layer import ExpertParallelMoE, is_expert_parameter

__all__ = ["ExpertParallelMoE", "Routing", "is_expert_parameter", "moe_forward", "route"]
