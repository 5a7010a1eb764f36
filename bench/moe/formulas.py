"""What expert parallelism should move and keep, per MoE layer and per rank, in T (tokens of an
ep group per step), k (experts per token), h (hidden), E (experts), ep, e (bytes per element).

All-to-all (``kernels_runtime.parallel.expert.dispatch``), counted as the instrumented
``Collectives`` count it: an op's bytes are the input this rank hands to it.

- forward: one exchange of the E row counts per rank (int64: 8E bytes each), then the
  dispatch sends every (token, choice) row, t*k*h*e on a rank (rows for its own experts
  included: all_to_all_single takes them too), and the combine sends back the rows each rank's
  experts computed. Summed over the ep group both are T*k*h*e: rows go out and come back.
- backward: the two row exchanges again, reversed (no counts): 2*T*k*h*e over the group.

Model state per rank (zero 0, fp32, AdamW: parameter, gradient, exp_avg, exp_avg_sq; the fp32
parameters are their own masters): (4 + 4 + 8) * (P_dense + P_experts / ep) bytes, P_dense
the parameters every rank holds (attention, norms, routers, embeddings) and P_experts those of
all experts, of which a rank holds 1/ep.

Torch-free, so the parent process and the tests use it without ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

COUNT_BYTES = 8  # the row counts travel as int64
ADAMW_STATE_BYTES = 4 + 4 + 8  # fp32 parameter, gradient, exp_avg and exp_avg_sq


@dataclass(frozen=True)
class Shape:
    batch: int  # sequences per rank
    seq: int
    hidden: int  # h
    ffn: int  # each expert's intermediate width
    experts: int  # E
    top_k: int  # k
    layers: int
    vocab: int
    ep: int
    elem: int = 4  # e: fp32

    @property
    def group_tokens(self) -> int:
        """T: the tokens of one ep group in one step (each rank's batch of sequences)."""
        return self.ep * self.batch * self.seq

    def rows_bytes(self) -> int:
        """Bytes of every (token, choice) row of the group once: T * k * h * e."""
        return self.group_tokens * self.top_k * self.hidden * self.elem

    def all_to_all_bytes(self, forward: bool) -> int:
        """All-to-all bytes of one MoE layer in one pass, summed over the ep group's ranks."""
        counts = self.ep * self.experts * COUNT_BYTES if forward else 0
        return 2 * self.rows_bytes() + counts

    def describe(self) -> str:
        return (f"Mixtral {self.layers} layers, h={self.hidden}, {self.experts} experts of "
                f"width {self.ffn}, top-{self.top_k}, vocab {self.vocab}; batch {self.batch} x "
                f"{self.seq} tokens per rank, fp32")


def model_state_bytes(dense: int, experts: int, ep: int) -> int:
    """Bytes of parameters, gradients and AdamW states on one rank (zero 0, fp32)."""
    if experts % ep:
        raise ValueError(f"{experts} expert parameters do not split over ep={ep}")
    return ADAMW_STATE_BYTES * (dense + experts // ep)
