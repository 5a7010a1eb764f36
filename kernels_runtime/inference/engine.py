"""``Engine``: serve generation requests from a model split over ranks, host and disk.

The engine is built on every rank of a pool, like ``parallelize``: the model is parallelized
without an optimizer (``parallelize_model``: tensor-parallel heads, pipeline stages, weights on
host or disk under an offloading plan), a paged KV cache is sized from ``kv_mem`` (both set up
in ``engine_setup.py``), and each ``step()`` runs one forward over the tokens the scheduler
picked (``scheduler.py``), samples the requests that reached the end of their tokens and
retires the finished ones. LoRA adapters
(``adapters={name: folder}``) ride on the base weights, so requests naming different adapters,
or none, share every step (``adapters.py``). Requests with ``speculate`` on verify
drafted tokens copied from their own context in the same forward (``speculation.py``), or
drafted by a small ``draft_model`` of the same tokenizer (``draft.py``).
Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) have their experts split over ep
and tp ranks (``moe_plans.py``, ``moe.py``); the ep ranks of a group form one replica.

Ranks of one replica (the tp x pp ranks sharing a dp coordinate) make the same calls with the
same arguments and keep identical schedulers; only activations and the sampled tokens pass
between them (the last pipeline stage broadcasts the tokens). Under pp, each ``step()`` is one
tick of a pipeline with a micro-batch of disjoint requests in flight on every stage
(``pipelined.py``; ``pipeline_overlap=False`` runs the stages one after another). Data-parallel
replicas are independent engines: ``generate`` deals the prompts out over them (on CPUs,
replicas often beat tensor parallelism) and gathers the results to every rank.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Iterator, Mapping
from collections.abc import Sequence as Seq
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kernels_runtime.inference.adapters import AdapterSet
from kernels_runtime.inference.attention import PagedLayer, install
from kernels_runtime.inference.batch import StepBatch, build_batch
from kernels_runtime.inference.blocks import BlockPool
from kernels_runtime.inference.compiled import compile_runner
from kernels_runtime.inference.draft import speculator
from kernels_runtime.inference.engine_setup import kv_blocks, parallelized_for_inference
from kernels_runtime.inference.kv_cache import PagedKVCache
from kernels_runtime.inference.model_reading import attention_modules, eos_token_ids
from kernels_runtime.inference.moe_plans import replicas
from kernels_runtime.inference.packed_linear import pack_linears
from kernels_runtime.inference.params import RequestOutput, SamplingParams
from kernels_runtime.inference.pipelined import overlap_steps
from kernels_runtime.inference.requests import (
    RequestError,
    check_fits,
    check_params,
    prompt_ids,
    prompt_ids_or_empty,
)
from kernels_runtime.inference.runner import ModelRunner
from kernels_runtime.inference.sampling import new_generator, sample, stop_check
from kernels_runtime.inference.scheduler import ScheduledStep, Scheduler
from kernels_runtime.inference.sequence import Sequence
from kernels_runtime.inference.speculation import target_tokens
from kernels_runtime.mesh.plan import Plan
from kernels_runtime.precision import compute_dtype


class Engine:
    """Paged-KV, continuously batched generation (module docstring). Collective: every rank
    builds it with the same arguments, then calls ``generate`` / ``stream`` together (or
    ``add_request`` / ``step`` / ``abort`` together within a replica). In a plain Python
    process, ``Engine(model)`` runs on one rank (``ParallelContext.build`` gives it a group of
    its own), as vLLM's ``LLM(model)`` does."""

    def __init__(self, model: nn.Module, plan: Plan | str | None = None, *, ctx: Any = None,
                 comm: Any = None, kv_mem: int | str | None = None, tokenizer: Any = None,
                 block_size: int = 16, max_num_seqs: int = 32, max_batch_tokens: int = 512,
                 max_model_len: int | None = None, prefix_sharing: bool = True,
                 preemption: str = "recompute", seed: int = 0, spill_dir: str | None = None,
                 adapters: Mapping[str, str | os.PathLike] | None = None,
                 draft_model: nn.Module | str | os.PathLike | None = None,
                 pipeline_overlap: bool | None = None, compile_model: bool = False,
                 pack_weights: bool = False, verbose: bool = True) -> None:
        if block_size < 1 or max_num_seqs < 1 or max_batch_tokens < 1:
            raise ValueError("block_size, max_num_seqs and max_batch_tokens must be >= 1")
        if compile_model and pack_weights:
            raise ValueError("compile_model=True and pack_weights=True both rewrite the "
                             "linears (inductor packs weights itself): choose one")
        # the model split over ranks, host and disk; a plan it cannot serve refused
        model, state, ep = parallelized_for_inference(model, plan, ctx, comm, spill_dir,
                                                      verbose)  # (engine_setup.py)
        self.model, self.state, self.ctx = model.eval(), state, state.ctx
        self.replicas = replicas(self.ctx, ep)  # under ep, an ep group is one replica
        self.tokenizer, self.block_size = tokenizer, block_size
        self.adapters = AdapterSet(model, state, adapters)  # LoRA adapters by name
        attention, hidden = attention_modules(model, state, max_model_len)
        config = model.config if attention is not None else None
        limit = getattr(config, "max_position_embeddings", None) or max_model_len or 2**31
        self.max_model_len = min(max_model_len or limit, limit)
        dtype = compute_dtype(self.ctx.plan.precision)
        self.runner = ModelRunner(model, state, attention, hidden, dtype)
        shapes = self.runner.probe()
        self.vocab = int(config.vocab_size) if config is not None else self.runner.vocab
        # this rank's KV budget, and the blocks every rank's fits (engine_setup.py)
        self.kv_mem, num_blocks = kv_blocks(kv_mem, shapes, dtype, block_size, max_num_seqs,
                                            self.max_model_len, self.ctx)
        self.cache = PagedKVCache(shapes, num_blocks, block_size, dtype, self.ctx.device)
        self.runner.layers = install(attention, self.cache) if attention is not None \
            else [PagedLayer(self.cache, i) for i in range(len(shapes))]
        if compile_model:  # torch.compile the forward: off by default (compiled.py)
            compile_runner(self.runner)
        if pack_weights:  # CPU: oneDNN-packed linears, no slow path for a few rows
            pack_linears(model, self.ctx.plan, self.ctx.device)  # (packed_linear.py)
        self.pool = BlockPool(num_blocks, block_size, prefix_sharing)
        self.scheduler = Scheduler(self.pool, max_num_seqs, max_batch_tokens, preemption)
        # pp > 1: micro-batches in flight on every stage, unless pipeline_overlap=False
        self.pipelined = overlap_steps(self, pipeline_overlap)  # (pipelined.py)
        # requests with speculate=... only: prompt lookup, or a draft model (draft.py)
        self.speculation = speculator(self.scheduler, draft_model, self.vocab, self.ctx.device,
                                      dtype)
        self.eos = eos_token_ids(model)
        self.generator = torch.Generator().manual_seed(seed)
        self.sequences: dict[str, Sequence] = {}
        self.rejected: list[RequestOutput] = []  # bad requests, reported by the next step
        self._ids = itertools.count()
        self.totals = {"steps": 0, "prompt_tokens": 0, "generated_tokens": 0, "requests": 0,
                       "finished": 0, "errors": 0, "aborted": 0}
        # summed over steps: tokens in the cache, slots of the blocks allocated for them, and
        # what contiguous allocation would reserve (prompt + max_new_tokens, or the context)
        self.kv_trace = dict.fromkeys(("tokens", "slots", "reserved", "context"), 0)

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, prompt: Any, params: SamplingParams | None = None,
                    request_id: str | None = None, adapter: str | None = None) -> str:
        """Queue one request, generated through LoRA ``adapter`` (a name given to the engine;
        None: the base model); its id. A bad one is finished at once with its ``error``."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.sequences:
            raise ValueError(f"request id {request_id!r} is already running")
        self.totals["requests"] += 1
        try:
            params = check_params(params, self.tokenizer is not None)
            slot = self.adapters.slot(adapter)
            ids = prompt_ids(prompt, self.tokenizer, self.vocab)
            check_fits(len(ids), params, self.max_model_len, self.block_size,
                       self.pool.num_blocks, self.kv_mem)
        except RequestError as err:
            ids = prompt_ids_or_empty(prompt, self.tokenizer)
            self.rejected.append(RequestOutput(request_id, ids, finish_reason="error",
                                               error=str(err), finished_s=0.0))
            self.totals["errors"] += 1
            return request_id
        seq = Sequence(request_id, list(ids), len(ids), params, adapter=slot)
        seq.generator = new_generator(params, self.generator)
        seq.output.text = "" if self.tokenizer is not None else None
        if params.return_logits:
            seq.output.logits = []
        self.sequences[request_id] = seq
        self.scheduler.add(seq)
        self.totals["prompt_tokens"] += len(ids)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; False if it is not running."""
        seq = self.sequences.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq)
        self._finish(seq, "abort", None)
        self.totals["aborted"] += 1
        self.rejected.append(seq.output)  # reported by the next step
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or bool(self.rejected)

    # ---- one step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One forward over the scheduled tokens; the outputs that changed (new tokens,
        finished, rejected or aborted requests)."""
        if self.pipelined is not None:  # one tick of the overlapped pipeline
            return self.pipelined.step()
        changed, self.rejected = self.rejected, []
        self.speculation.draft()  # drafted tokens ride in the decodes' chunks
        step = self.scheduler.schedule()
        self.speculation.fit(step)
        self._apply_cache_ops(step)  # before any return: a step of preemptions alone swaps out
        if not step.chunks:
            if self.scheduler.has_work and not step.preempted:
                raise RuntimeError("the scheduler found nothing to run while requests wait "
                                   "(a bug: every admitted request fits the cache)")
            self.ctx.telemetry.record_inference(self.stats())  # aborts changed the blocks
            return changed
        batch = build_batch(step.chunks, self.block_size, self.ctx.device)
        with self.adapters.routing(batch.adapters):
            logits = self.runner.forward(batch)
        tokens, logits = self._agree(batch, logits)
        outputs, made = self.commit(step, batch.sampled, batch.per_sequence(tokens),
                                    batch.per_sequence(logits))
        self.ctx.telemetry.record_inference(self.stats())
        self.ctx.telemetry.tick(tokens=made)  # tokens/s: generated tokens
        return changed + outputs

    def commit(self, step: ScheduledStep, sampled: list[Sequence], targets: list[list[int]],
               rows: list | None) -> tuple[list[RequestOutput], int]:
        """Settle a computed step: speculation keeps the accepted drafts, the scheduler counts
        the chunks, and each sampled sequence gets its new tokens (accepted drafts, then the
        target's). The changed outputs and the number of tokens made. Shared by ``step`` and
        the overlapped pipeline's commit of a micro-batch (``pipelined.py``)."""
        news = self.speculation.settle(step, sampled, targets)
        self.scheduler.finish_chunks(step)
        self.speculation.release()
        now, made, changed = time.perf_counter(), 0, []
        for seq, new, seq_rows in zip(sampled, news, rows):
            for token, row in zip(new, seq_rows):  # accepted drafts, then the target's token
                out = self._append(seq, token, row, now)
                made += 1
                if out.finished:
                    break
            changed.append(seq.output)
        self.totals["steps"] += 1
        self._trace_kv()
        return changed, made

    def _trace_kv(self) -> None:
        running, trace = self.scheduler.running, self.kv_trace
        trace["tokens"] += sum(s.computed for s in running)
        trace["slots"] += self.pool.num_used * self.block_size
        trace["reserved"] += sum(s.total_len_bound() for s in running)
        trace["context"] += len(running) * self.max_model_len

    def _apply_cache_ops(self, step: ScheduledStep) -> None:
        for seq, blocks in step.swap_out:
            seq.swapped_out = self.cache.save_blocks(blocks)
        self.cache.copy_blocks(step.copies)
        for seq, blocks in step.swap_in:
            self.cache.load_blocks(seq.swapped_out, blocks)
            seq.swapped_out = None

    def _agree(self, batch: StepBatch,
               logits: torch.Tensor | None) -> tuple[list[int], list | None]:
        """The tokens of every kept logits row (sampled at each sequence's last row; at its
        drafts' rows the argmax, or the rejection sampler's under sampling), and the rows
        asked for, from the last pipeline stage to every rank of the replica."""
        sampled = batch.sampled
        want = any(s.params.return_logits for s in sampled)
        total = sum(batch.rows)
        tokens = torch.zeros(total, dtype=torch.long, device=self.ctx.device)
        if logits is not None:
            if total == len(sampled):
                tokens = torch.tensor(sample(logits, sampled), device=self.ctx.device)
            else:  # drafts to verify: the target's token at every row (speculation.py)
                tokens = torch.tensor(target_tokens(logits, batch), device=self.ctx.device)
        if self.runner.pp > 1:
            group = self.ctx.group("pp")
            last_stage = self.ctx.topology.group_of(self.ctx.rank, ("pp",))[-1]
            self.ctx.comm.broadcast(tokens, src=last_stage, group=group)
            if want:
                if logits is None:
                    logits = torch.empty(total, self.vocab, device=self.ctx.device)
                self.ctx.comm.broadcast(logits, src=last_stage, group=group)
        rows = [row.cpu() for row in logits] if want and logits is not None else None
        return tokens.tolist(), rows

    def _append(self, seq: Sequence, token: int, row: torch.Tensor | None,
                now: float) -> RequestOutput:
        out = seq.output
        seq.tokens.append(token)
        out.token_ids.append(token)
        out.token_times_s.append(now - seq.arrival)
        if out.first_token_s is None:
            out.first_token_s = now - seq.arrival
        if row is not None and out.logits is not None:
            out.logits.append(row)
        if self.tokenizer is not None:
            out.text = self.tokenizer.decode(out.token_ids)
        self.totals["generated_tokens"] += 1
        ended = stop_check(seq, token, self.eos, self.tokenizer)
        if ended is not None:
            self.scheduler.finish(seq)
            self.sequences.pop(seq.request_id, None)
            self._finish(seq, *ended)
        return out

    def _finish(self, seq: Sequence, reason: str, why: Any) -> None:
        out = seq.output
        out.finish_reason, out.stop_reason = reason, why
        out.finished_s = time.perf_counter() - seq.arrival
        if reason == "stop" and isinstance(why, int) and self.tokenizer is not None:
            out.text = self.tokenizer.decode(out.token_ids[:-1])
        self.totals["finished"] += 1

    # ---- whole calls ----------------------------------------------------------------------
    def generate(self, prompts: Seq[Any] | str, params: SamplingParams | Seq[SamplingParams]
                 | None = None, *, adapter: str | Seq[str | None] | None = None,
                 on_step: Callable[[list[RequestOutput]], None] | None = None
                 ) -> list[RequestOutput]:
        """Every prompt's output, in order, on every rank (prompts are dealt over the dp
        replicas). ``params`` and ``adapter`` (a LoRA adapter's name, None for the base) are
        one for all or one per prompt; ``on_step`` is called with this replica's outputs that
        changed, after every step (to stream them elsewhere)."""
        mine = []
        for changed in self._steps(prompts, params, adapter):
            mine += [o for o in changed if o.finished]
            if on_step is not None and changed:
                on_step(changed)
        mine.sort(key=_index)
        if self.replicas.count == 1:
            return mine
        gathered: list[list[RequestOutput]] = [[] for _ in range(self.replicas.count)]
        dist.all_gather_object(gathered, mine, group=self.replicas.group)
        return sorted((o for part in gathered for o in part), key=_index)

    def stream(self, prompts: Seq[Any] | str, params: SamplingParams | Seq[SamplingParams]
               | None = None, adapter: str | Seq[str | None] | None = None
               ) -> Iterator[RequestOutput]:
        """This replica's outputs as they change, step by step (the same object for a request
        each time: read it, or copy it to keep a snapshot). Request ids end in the prompt's
        index."""
        for changed in self._steps(prompts, params, adapter):
            yield from changed

    def _steps(self, prompts: Seq[Any] | str,
               params: SamplingParams | Seq[SamplingParams] | None,
               adapter: str | Seq[str | None] | None = None
               ) -> Iterator[list[RequestOutput]]:
        """Add this replica's share of the prompts, then step until they are all finished;
        each step's changed outputs among them."""
        if isinstance(prompts, str) or not isinstance(prompts, (list, tuple)):
            prompts = [prompts]
        if not isinstance(params, (list, tuple)):
            params = [params] * len(prompts)
        adapters = adapter if isinstance(adapter, (list, tuple)) else [adapter] * len(prompts)
        for given, what in ((params, "SamplingParams"), (adapters, "adapter names")):
            if len(given) != len(prompts):
                raise ValueError(f"{len(given)} {what} for {len(prompts)} prompts; give one "
                                 "for all or one per prompt")
        call = next(self._ids)
        dp, me = self.replicas.count, self.replicas.index
        pending = {self.add_request(p, s, request_id=f"gen{call}-{i}", adapter=a)
                   for i, (p, s, a) in enumerate(zip(prompts, params, adapters)) if i % dp == me}
        self.ctx.telemetry.pause()
        while pending:
            changed = [o for o in self.step() if o.request_id in pending]
            pending -= {o.request_id for o in changed if o.finished}
            yield changed

    # ---- figures --------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Queue, KV blocks and totals now (this replica); what telemetry publishes. Every
        rank of a replica reports the same figures, so ``replica`` (the dp coordinate) and
        ``leader`` (its first tp and pp rank) let a reader count each replica once."""
        pool, s = self.pool, self.scheduler
        held = sum(q.computed for q in s.running)
        leader = self.ctx.coord("tp") == 0 and self.ctx.coord("pp") == 0 and self.replicas.first
        return {"replica": self.replicas.index, "leader": leader,
                "running": len(s.running), "waiting": len(s.waiting),
                "swapped": len(s.swapped), "blocks_total": pool.num_blocks,
                "blocks_used": pool.num_used, "blocks_free": pool.num_free,
                "blocks_shared": pool.num_shared, "blocks_cached": pool.num_cached,
                "block_size": self.block_size, "kv_tokens": held,
                "kv_bytes": self.cache.nbytes, "preemptions": s.preemptions,
                "prefix_hit_blocks": pool.hits,
                "kv_utilisation": self.kv_trace["tokens"] / self.kv_trace["slots"]
                if self.kv_trace["slots"] else None, "weights": self._weight_tiers(),
                **self.speculation.stats(), **self.totals}

    def _weight_tiers(self) -> dict[str, int] | None:
        """Bytes of weights per tier (device, host, disk) under an offloading plan."""
        tiers = getattr(self.state.model_state, "tier_bytes", None)
        return dict(tiers()) if tiers is not None else None


def _index(out: RequestOutput) -> int:
    """The prompt's index in its ``generate`` call (request ids end in it)."""
    return int(out.request_id.rsplit("-", 1)[1])
