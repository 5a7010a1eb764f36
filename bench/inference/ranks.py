"""The rank side of ``python -m bench inference``: the same requests through our engine and
through HF ``generate``, on each of the ranks (one thread each).

- ``engine``: ``Engine`` under ``dp=<ranks>`` (a replica per rank, requests dealt round-robin,
  as ``generate`` does), continuous batching of at most ``batch`` sequences;
- ``static engine``: static batching as HF ``generate`` and static-batch servers do it, on the
  same engine: ``batch`` requests per replica at a time, every row of a batch decoding until
  the batch's longest answer is done (a finished row keeps its slot, computing tokens nobody
  asked for; only the asked-for tokens are counted), each batch finished before the next starts;
- ``drained engine``: the same batches, but a finished row leaves at once (the batch shrinks,
  nothing new joins): what the engine saves without continuous batching's refill, the
  lower bound of its win;
- ``hf``: HF ``generate`` in every rank process on that rank's share (the same round-robin
  deal), in arrival order, in static left-padded batches of ``batch``, greedy, each batch run
  to the longest output it holds.

Every request asks for exactly its output length (end-of-sequence ignored on both sides), so
both sides produce the same useful tokens. Engines are built once per process and reused over
rounds with prefix sharing off (the rounds repeat the same prompts, which a prefix cache would
remember); the prefix-sharing measurement builds fresh engines.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

_ENGINES: dict[tuple, Any] = {}


def workload(spec: dict) -> list[tuple[list[int], int]]:
    """``spec['requests']`` (prompt ids, output length), seeded: lengths drawn from log-normals
    (sigma 0.6 for prompts, 0.9 for answers: a long tail of long answers) whose medians the
    spec gives; the full run's, 160 and 100 tokens in a 1024-token context, are shaped like
    ShareGPT's chat traffic (means 161 in, 338 out, as the vLLM paper measured it)."""
    g = torch.Generator().manual_seed(spec["seed"])
    out = []
    for _ in range(spec["requests"]):
        n_in = int(torch.empty(()).log_normal_(spec["prompt_log_mean"], 0.6, generator=g))
        n_out = int(torch.empty(()).log_normal_(spec["output_log_mean"], 0.9, generator=g))
        n_in = min(max(n_in, 8), spec["max_prompt"])
        n_out = min(max(n_out, 4), spec["max_output"])
        out.append((torch.randint(1, spec["vocab"], (n_in,), generator=g).tolist(), n_out))
    return out


def shared_workload(spec: dict) -> list[list[int]]:
    """Requests that all start with the same long system prompt."""
    g = torch.Generator().manual_seed(spec["seed"] + 1)
    system = torch.randint(1, spec["vocab"], (spec["system_prompt"],), generator=g).tolist()
    return [system + torch.randint(1, spec["vocab"], (int(n),), generator=g).tolist()
            for n in torch.randint(8, 64, (spec["requests"],), generator=g)]


def model(spec: dict) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(
        vocab_size=spec["vocab"], n_positions=spec["context"], n_embd=spec["hidden"],
        n_layer=spec["layers"], n_head=spec["heads"], resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")).eval()


def _engine(spec: dict, world: int, prefix_sharing: bool = False, fresh: bool = False):
    from kernels_runtime.inference import Engine

    key = (tuple(sorted(spec.items())), prefix_sharing)
    if fresh or key not in _ENGINES:
        _ENGINES[key] = Engine(model(spec), f"dp={world}", kv_mem=spec["kv_mem"],
                               max_num_seqs=spec["batch"],
                               max_batch_tokens=spec["batch_tokens"],
                               prefix_sharing=prefix_sharing, verbose=False)
    return _ENGINES[key]


def _params(requests: list[tuple[list[int], int]]) -> list:
    from kernels_runtime.inference import SamplingParams

    return [SamplingParams(max_new_tokens=n, ignore_eos=True) for _, n in requests]


def run_round(rank: int, world: int, spec: dict, which: str) -> dict:
    """One side's whole workload; wall seconds (the same on every rank) and figures."""
    torch.set_num_threads(1)
    requests = workload(spec)
    engine = _engine(spec, world) if which != "hf" else None
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    figures: dict[str, Any] = {}
    if which == "engine":
        figures = _continuous(engine, requests)
    elif which in ("static engine", "drained engine"):
        step = spec["batch"] * world  # a batch per replica at a time
        for i in range(0, len(requests), step):
            group = requests[i:i + step]
            if which == "static engine":  # every row runs to its replica batch's longest
                group = _held_to_longest(group, world)
            engine.generate([p for p, _ in group], _params(group))
    else:
        _hf(model_cached(spec), requests[rank::world], spec["batch"])
    figures["cpu"] = _cpu_seconds(cpu)
    dist.barrier()
    figures["seconds"] = time.perf_counter() - start
    figures["tokens"] = sum(n for _, n in requests)
    return figures


def _held_to_longest(group: list[tuple[list[int], int]],
                     world: int) -> list[tuple[list[int], int]]:
    """Each request's output length raised to the longest of its replica's batch
    (``generate`` deals a group round-robin: replica r takes ``group[r::world]``)."""
    longest = [max((n for _, n in group[r::world]), default=0) for r in range(world)]
    return [(p, longest[i % world]) for i, (p, _) in enumerate(group)]


def _cpu_seconds(since: float) -> float:
    """CPU seconds of every rank process since ``since`` (its ``process_time``), summed: the
    work a side did, which, unlike its wall time, does not grow with what else the machine
    runs (the bench shares its cores)."""
    cpu = torch.tensor([time.process_time() - since], dtype=torch.float64)
    dist.all_reduce(cpu)
    return float(cpu)


_MODELS: dict[tuple, nn.Module] = {}


def model_cached(spec: dict) -> nn.Module:
    key = tuple(sorted(spec.items()))
    if key not in _MODELS:
        _MODELS[key] = model(spec)
    return _MODELS[key]


def _continuous(engine: Any, requests: list[tuple[list[int], int]]) -> dict:
    """``generate``, with the engine's per-step KV trace (``Engine.kv_trace``: tokens held,
    slots of the blocks allocated, what contiguous allocation would reserve) and every
    request's time to first token and per output token, from every replica."""
    before = dict(engine.kv_trace)
    outs = [o for o in engine.stream([p for p, _ in requests], _params(requests))
            if o.finished]
    kv = {k: engine.kv_trace[k] - before[k] for k in before}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [(o.first_token_s, o.per_token_s()) for o in outs])
    return {"kv": kv, "timings": [t for part in gathered for t in part]}


def _hf(model: nn.Module, requests: list[tuple[list[int], int]], batch: int) -> None:
    with torch.no_grad():
        for i in range(0, len(requests), batch):
            group = requests[i:i + batch]
            longest = max(len(p) for p, _ in group)
            ids = torch.zeros(len(group), longest, dtype=torch.long)
            mask = torch.zeros(len(group), longest, dtype=torch.long)
            for row, (p, _) in enumerate(group):  # left padding
                ids[row, longest - len(p):] = torch.tensor(p)
                mask[row, longest - len(p):] = 1
            model.generate(ids, attention_mask=mask, max_new_tokens=max(n for _, n in group),
                           do_sample=False, pad_token_id=0, eos_token_id=None)


def prefix_round(rank: int, world: int, spec: dict, sharing: bool) -> dict:
    """The shared-system-prompt requests on a fresh engine: blocks taken from the prefix index
    instead of computed, peak blocks in use, and the time."""
    from kernels_runtime.inference import SamplingParams

    torch.set_num_threads(1)
    engine = _engine(spec, world, prefix_sharing=sharing, fresh=True)
    prompts = shared_workload(spec)
    peak = 0
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    for _ in engine.stream(prompts, SamplingParams(max_new_tokens=16, ignore_eos=True)):
        peak = max(peak, engine.pool.num_used)
    cpu = _cpu_seconds(cpu)
    dist.barrier()
    stats = engine.stats()
    return {"seconds": time.perf_counter() - start, "cpu": cpu,
            "hits": stats["prefix_hit_blocks"],
            "peak_blocks": peak, "prompt_tokens": stats["prompt_tokens"],
            "computed_prompt_tokens": stats["prompt_tokens"]
            - stats["prefix_hit_blocks"] * stats["block_size"]}
