"""Running one step's flat row of tokens through a parallelized model on this rank.

The model is whatever ``parallelize_model`` made of the user's: tensor-parallel layers split the
heads (each rank's cache holds its heads), offloaded weights are gathered unit by unit as the
forward reaches them, and a pipeline stage runs only its blocks (``parallel/pipeline/stage.py``):
a stage receives the previous stage's hidden states, ends its forward at its last block and
sends them on; the last stage computes the logits of the sampled positions only
(``logits_to_keep``). ``forward`` runs the stages one after another within a step;
``stage_forward`` runs this stage's part alone, for ``pipelined.py`` to keep several
micro-batches in flight, one on every stage.

``probe`` runs one token through the model once, with an attention function that records what
each attention layer of this rank hands it (key/value heads, head size): the cache's shape
comes from the model as it runs, under any split, rather than from config arithmetic. A
decoder outside transformers is called with ``position_ids`` and its
``scaled_dot_product_attention`` calls are its layers (``attention.SdpaLayers``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from kernels_runtime.inference.attention import PagedLayer, SdpaLayers, implementation, paged
from kernels_runtime.inference.batch import StepBatch
from kernels_runtime.inference.kv_cache import LayerShape
from kernels_runtime.mesh.context import ParallelContext
from kernels_runtime.parallel.pipeline.stage import StageExit
from kernels_runtime.parallel.state import ParallelState

_PROBE = "colossal_probe"


class ModelRunner:
    def __init__(self, model: nn.Module, state: ParallelState, attention: list[nn.Module] | None,
                 hidden: int, dtype: torch.dtype) -> None:
        """``attention``: the HF attention modules of this rank's blocks, or None for a
        generic decoder (its attention calls are found by ``SdpaLayers``)."""
        self.model, self.state, self.ctx = model, state, state.ctx
        self.attention, self.hidden, self.dtype = attention, hidden, dtype
        self.config = model.config if attention is not None else None
        self.vocab: int | None = None  # seen by the probe
        self.pipeline = state.schedule  # a PipelineRunner under pp > 1
        ctx: ParallelContext = state.ctx
        self.pp, self.stage = ctx.size("pp"), ctx.coord("pp")
        ranks = ctx.topology.group_of(ctx.rank, ("pp",))
        self.prev_rank = ranks[self.stage - 1] if self.stage > 0 else None
        self.next_rank = ranks[self.stage + 1] if self.stage < self.pp - 1 else None
        self.layers: list[PagedLayer] = []

    @property
    def is_last(self) -> bool:
        return self.next_rank is None

    # ---- one step -------------------------------------------------------------------------
    def forward(self, batch: StepBatch) -> Tensor | None:
        """(S, V) float32 logits of the sampled positions on the last stage, None elsewhere."""
        with torch.no_grad(), paged(self.config, self.layers, batch):
            out = self._stage_forward(batch.input_ids, batch.positions, batch.sample_index)
        return None if out is None else out[0].float()

    def _stage_forward(self, ids: Tensor, positions: Tensor, keep: Tensor,
                       exchange: bool = True) -> Tensor | None:
        """This stage's part of the forward; without ``exchange`` (the probe) a later stage
        starts from zeros and nothing is sent."""
        def call() -> Any:
            return self._call(ids, positions, keep)

        if self.pipeline is None:
            return call()
        comm, group = self.ctx.comm, self.ctx.group("pp")
        incoming = None
        if self.prev_rank is not None:  # (1, T, h) from the stage before
            incoming = self.incoming_buffer(ids.shape[1])
            if exchange:
                comm.recv(incoming, self.prev_rank, group)
        out = self._run_stage(call, incoming)
        if self.is_last:
            return out
        if exchange:
            comm.send(out, self.next_rank, group)
        return None

    def _run_stage(self, call: Any, incoming: Tensor | None) -> Tensor:
        """This stage's blocks from ``incoming`` (None: its own embeddings): the logits on the
        last stage, else the (1, T, h) hidden states its last block hands on."""
        with self.pipeline.blocks.running(0, incoming, exits=not self.is_last):
            try:
                return call()
            except StageExit as stop:
                return stop.output.to(self.dtype).contiguous()

    def incoming_buffer(self, tokens: int) -> Tensor:
        """(1, T, h) zeros to receive the previous stage's hidden states of T tokens into."""
        return torch.zeros(1, tokens, self.hidden, dtype=self.dtype, device=self.ctx.device)

    def stage_forward(self, batch: StepBatch, incoming: Tensor | None) -> Tensor:
        """This stage's part of ``batch`` with no exchange (the caller sends and receives:
        ``pipelined.py`` keeps several batches in flight): from ``incoming``, the previous
        stage's (1, T, h) (None on the first stage), the (1, T, h) hidden states to send on,
        or on the last stage the (R, V) float32 logits of the kept rows."""
        def call() -> Any:
            return self._call(batch.input_ids, batch.positions, batch.sample_index)

        with torch.no_grad(), paged(self.config, self.layers, batch):
            out = self._run_stage(call, incoming)
        return out[0].float() if self.is_last else out

    def _call(self, ids: Tensor, positions: Tensor, keep: Tensor) -> Any:
        if self.config is None:  # a generic decoder: every position's logits, then kept
            out = self.model(input_ids=ids, position_ids=positions)
            return getattr(out, "logits", out)[:, keep]
        return self.model(input_ids=ids, position_ids=positions, logits_to_keep=keep,
                          use_cache=False).logits

    # ---- cache shape ----------------------------------------------------------------------
    def probe(self) -> list[LayerShape]:
        """The key/value shape each of this rank's attention layers sees (one token's forward;
        every rank of the replica runs it together, as tensor-parallel layers communicate)."""
        seen: dict[Any, LayerShape] = {}

        def shape(key: Tensor) -> LayerShape:
            return LayerShape(int(key.shape[1]), int(key.shape[3]))

        ids = torch.zeros(1, 1, dtype=torch.long, device=self.ctx.device)
        keep = torch.zeros(1, dtype=torch.long, device=self.ctx.device)
        with torch.no_grad():
            if self.config is None:
                def call(i: int, q: Tensor, k: Tensor, v: Tensor, scale: Any) -> Tensor:
                    seen[i] = shape(k)
                    return torch.zeros_like(q)

                with SdpaLayers(call):
                    out = self._stage_forward(ids, torch.zeros_like(ids), keep, exchange=False)
                self.vocab = int(out.shape[-1]) if out is not None else None
                return [seen[i] for i in sorted(seen)]
            from transformers import AttentionInterface

            def record(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                       *args: Any, **kwargs: Any) -> tuple[Tensor, None]:
                seen[id(module)] = shape(key)
                return query.new_zeros(query.shape[0], query.shape[2], query.shape[1],
                                       query.shape[3]), None

            AttentionInterface.register(_PROBE, record)
            with implementation(self.config, _PROBE):
                self._stage_forward(ids, torch.zeros_like(ids), keep, exchange=False)
        missing = [m for m in self.attention if id(m) not in seen]
        if missing:
            raise TypeError(
                f"{type(missing[0]).__name__} does not compute attention through transformers' "
                "attention interface (ALL_ATTENTION_FUNCTIONS), so the paged KV cache cannot "
                "reach it; the inference engine serves HF decoders that do (GPT-2, LLaMA, "
                "Mistral, Qwen2/3) and decoders calling scaled_dot_product_attention")
        return [seen[id(m)] for m in self.attention]
