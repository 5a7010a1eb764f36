"""Model-state bytes per rank of LoRA fine-tuning the real SmolLM2-135M, against the formula.

Under LoRA the model state of a rank is the frozen base (in its dtype, split as the plan splits
it) plus the adapters, their gradients and their optimizer states (ZeRO's stages applied to
those three only: nothing else trains). The formula here is written from the model's shapes and
the plan alone, not from the runtime:

- frozen: every frozen parameter once (SmolLM2 ties its head to the embedding), a block's seven
  projections and the vocab-parallel embedding divided by tp, norms whole; zero=3 divides all
  of it by dp;
- adapters: r (in + out) per projection; under tp a column-parallel layer's B splits by output
  and a row-parallel layer's A by input (``parallel/tensor/lora.py``), so each is over tp;
  fp32 AdamW: 4 B params + 4 B grads + 8 B states per adapter element, over dp for zero>=3,
  >=2, >=1 respectively.

Measured per rank, after a step (states exist) and the next backward (gradients reduced), in
two ways: the runtime's own account (``optimizer.memory_breakdown()``, plus the frozen
parameters' local bytes where it leaves them out), and what torch allocated: the distinct
storages under the model's parameters, their gradients, the optimizer's states and masters.
"""

from __future__ import annotations

from typing import Any

RANK_R = 8
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ROW_PARALLEL = ("o_proj", "down_proj")  # the others are column-parallel under tp
PLANS = (("dp=1", 1), ("dp=2 zero=0", 2), ("dp=2 zero=1", 2), ("dp=2 zero=2", 2),
         ("dp=2 zero=3", 2), ("tp=3", 3))


def with_lora(model, seed: int = 1):
    """``model`` as a peft ``PeftModel``: rank-8 adapters on the seven projections of every
    block, dropout off; peft freezes everything else."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=RANK_R, lora_alpha=16, target_modules=list(TARGETS),
                        lora_dropout=0.0)
    return get_peft_model(model, config)


def formula(model, plan: str) -> dict[str, float]:
    """Per-rank bytes of frozen weights, adapters, adapter grads and adapter optimizer states
    that ``plan`` should leave on a rank, from the (peft-wrapped, unparallelized) model."""
    from kernels_runtime.mesh.plan import Plan

    p = Plan.parse(plan)
    tp, dp, zero = p.tp, p.dp or 1, p.zero_stage
    frozen = 0.0
    seen: set[int] = set()
    for name, param in model.named_parameters():
        if param.requires_grad or param.untyped_storage().data_ptr() in seen:
            continue
        seen.add(param.untyped_storage().data_ptr())
        split = tp if (name.endswith("base_layer.weight") or "embed_tokens" in name) else 1
        frozen += param.numel() * param.element_size() / split / (dp if zero >= 3 else 1)
    adapter = 0.0  # elements per rank
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        layer = name.split(".lora_")[0].rsplit(".", 1)[-1]
        factor = "A" if ".lora_A." in name else "B"
        split = (layer in ROW_PARALLEL) == (factor == "A")  # row: A by input; column: B by out
        adapter += param.numel() / (tp if split else 1)
    n = dp
    return {"frozen": frozen, "params": 4 * adapter / (n if zero >= 3 else 1),
            "grads": 4 * adapter / (n if zero >= 2 else 1),
            "optimizer": 8 * adapter / (n if zero >= 1 else 1)}


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _storages(tensors) -> int:
    """Bytes of the distinct storages under ``tensors`` (views of one bucket count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        s = _local(t).untyped_storage()
        if s.nbytes():
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def measure_on_rank(rank: int, world: int, folder: str, plan: str, seq: int) -> dict[str, Any]:
    """One fresh SmolLM2 + LoRA under ``plan``: formula, the runtime's account and the live
    storages, after one AdamW step and the next backward."""
    import torch
    from transformers import AutoModelForCausalLM

    from kernels_runtime import ParallelContext, parallelize, train_step
    from kernels_runtime.calibrate.trial import next_token_loss, token_batch
    from kernels_runtime.optim import optimizer_state_tensors

    model = with_lora(AutoModelForCausalLM.from_pretrained(folder))
    want = formula(model, plan)
    frozen_dtypes = sorted({str(p.dtype) for p in model.parameters() if not p.requires_grad})
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ctx = ParallelContext.build(plan)
    model, bopt = parallelize(model, opt, ctx=ctx, verbose=False)
    batch = token_batch(0, ctx.dp_rank, 1, seq)
    train_step(model, bopt, [batch], loss_fn=next_token_loss)
    bopt.backward(next_token_loss(model, token_batch(1, ctx.dp_rank, 1, seq)))
    bopt.finish_grad_sync()
    breakdown = dict(bopt.memory_breakdown())
    params = list(model.parameters())
    frozen = [p for p in params if not p.requires_grad]
    frozen_bytes = _storages(frozen)
    frozen_grads = sum(1 for p in frozen if p.grad is not None)
    sync = bopt.sync
    # every GradSync counts the frozen weights in "params" (its buckets or shards and the
    # parameters outside them); the column stays, so a sync that left them out would show
    counted_frozen = True
    live = _storages([*params, *(p.grad for p in params),
                      *optimizer_state_tensors(bopt.inner),
                      *getattr(sync, "masters", []), *getattr(sync, "_grad_store", [])])
    bopt.zero_grad()
    return {"formula": want, "breakdown": breakdown, "frozen": frozen_bytes,
            "frozen_counted": counted_frozen, "frozen_grads": frozen_grads,
            "frozen_dtypes": frozen_dtypes, "sync": type(sync).__name__, "live": live}


def run(folder: str, seq: int, plans: list[str],
        pools: dict[int, Any] | None = None) -> dict[str, list[dict]]:
    """Every plan on ranks of its size (a pool per size, plans in turn; each plan builds its
    own model). ``pools`` ({world: RankPool}) lends pools the caller keeps for its other
    parts (starting ranks is a good share of a --quick run); missing sizes are started and
    closed here."""
    import contextlib

    from kernels_runtime.testing import RankPool

    worlds = dict(PLANS)
    out: dict[str, list[dict]] = {}
    for world in sorted({worlds[p] for p in plans}):
        lent = (pools or {}).get(world)
        with contextlib.nullcontext(lent) if lent else RankPool(world, pg_timeout_s=600) as pool:
            for plan in (p for p in plans if worlds[p] == world):
                out[plan] = pool.run(measure_on_rank, folder, plan, seq, timeout_s=900)
    return out


def report(results: dict[str, list[dict]]) -> dict[str, float]:
    """Print formula vs measured per plan (rank 0; every rank's total checked) and return
    {plan: measured total / formula total} (the worst rank's)."""
    from bench.common.table import print_table

    mib = 2**20
    rows, ratios = [], {}
    for plan, ranks in results.items():
        worst = 1.0
        for r in ranks:
            f, b = r["formula"], r["breakdown"]
            frozen_runtime = 0 if r["frozen_counted"] else r["frozen"]
            runtime = sum(b.values()) + frozen_runtime
            total = sum(f.values())
            ratio, live_ratio = runtime / total, r["live"] / total
            worst = max(worst, ratio, live_ratio, key=lambda x: abs(x - 1))
        ratios[plan] = worst
        r = ranks[0]
        f, b = r["formula"], r["breakdown"]
        frozen_runtime = "yes (params)" if r["frozen_counted"] else "no: added"
        adapter_params = b["params"] - (r["frozen"] if r["frozen_counted"] else 0)
        total = sum(f.values())
        runtime = sum(b.values()) + (0 if r["frozen_counted"] else r["frozen"])
        rows.append([plan, r["sync"], f["frozen"] / mib, r["frozen"] / mib, frozen_runtime,
                     f"{f['params'] / mib:.2f}/{adapter_params / mib:.2f}",
                     f"{f['grads'] / mib:.2f}/{b['grads'] / mib:.2f}",
                     f"{f['optimizer'] / mib:.2f}/{b['optimizer'] / mib:.2f}",
                     total / mib, runtime / mib, r["live"] / mib, runtime / total,
                     r["live"] / total, sum(x["frozen_grads"] for x in ranks)])
    print("model-state MiB per rank (rank 0), formula vs measured; fp32 AdamW, LoRA r=8 on "
          "the seven projections")
    print_table(["plan", "sync", "frozen f", "frozen live", "frozen in breakdown",
                 "adapters f/m", "grads f/m", "optim f/m", "formula", "runtime",
                 "torch storages", "runtime/f", "storages/f", "frozen .grad"], rows)
    print("(f: formula, m: the runtime's memory_breakdown(); 'frozen in breakdown' says whether "
          "memory_breakdown() counts the frozen weights: where it does not, their live bytes are "
          "added to 'runtime'; 'frozen .grad': frozen parameters holding a gradient, all ranks)")
    return ratios
