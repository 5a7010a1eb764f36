"""Data parallelism against PyTorch's own: step time and per-rank model-state memory.

In one run on the same model (HF GPT-2, small config) and the same ranks:
- step time of zero=0 against ``torch.nn.parallel.DistributedDataParallel`` (aim <= 1.05) and
  of zero=3 against FSDP2 ``fully_shard`` per block (aim <= 1.10); zero=1/2 shown too;
- bytes per rank of parameters, gradients and optimizer states (fp32 masters included) for each
  zero stage, measured on the live tensors, against the ZeRO paper's formulas and against DDP.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.common.table import print_table
from bench.common.trial import gpt2_model, next_token_loss, token_batch

FORMULA_BYTES = {  # bytes per parameter on one of N ranks: (params, grads, optimizer states)
    "fp32": {0: lambda n: (4, 4, 8), 1: lambda n: (4, 4, 8 / n), 2: lambda n: (4, 4 / n, 8 / n),
             3: lambda n: (4 / n, 4 / n, 8 / n)},
    "bf16": {0: lambda n: (2, 2, 12), 1: lambda n: (2, 2, 12 / n), 2: lambda n: (2, 2 / n, 12 / n),
             3: lambda n: (2 / n, 2 / n, 12 / n)},
}


def _time_steps(step_fn, warmup: int, steps: int) -> float:
    for s in range(warmup):
        step_fn(s)
    times = []
    for s in range(steps):
        t0 = time.perf_counter()
        step_fn(warmup + s)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _native_state_bytes(model, opt) -> dict[str, int]:
    from torch.distributed.tensor import DTensor

    from kernels_runtime.optim import optimizer_state_tensors, tensor_bytes

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    params = [local(p) for p in model.parameters()]
    grads = [local(p.grad) for p in model.parameters() if p.grad is not None]
    return {"params": tensor_bytes(params), "grads": tensor_bytes(grads),
            "optimizer": tensor_bytes([local(t) for t in optimizer_state_tensors(opt)])}


def _run(rank: int, world: int, args: argparse.Namespace) -> dict:
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from kernels_runtime import ParallelContext, parallelize

    base = ParallelContext.build(f"dp={world}")
    results: dict = {"time": {}, "memory": {}, "numel": None}

    def make_step(model, opt, boosted: bool):
        def step(s: int) -> None:
            loss = next_token_loss(model, token_batch(s, rank, args.batch, args.seq))
            if boosted:
                opt.backward(loss)
                opt.step()
            else:
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=False)
        return step

    def fresh():
        model = gpt2_model(args.layers, args.hidden, args.seq)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    model, opt = fresh()
    results["numel"] = sum(p.numel() for p in model.parameters())
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    results["time"]["ddp"] = _time_steps(make_step(ddp, opt, False), args.warmup, args.steps)
    results["memory"][("ddp", "fp32")] = _native_state_bytes(ddp, opt)

    model, opt = fresh()
    for block in model.transformer.h:
        fully_shard(block, mesh=base.mesh["dp"])
    fully_shard(model, mesh=base.mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    results["time"]["fsdp2"] = _time_steps(make_step(model, opt, False), args.warmup, args.steps)

    for precision in ("fp32", "bf16"):
        for zero in (0, 1, 2, 3):
            model, opt = fresh()
            model, bopt = parallelize(model, opt, ctx=base.with_plan(
                f"dp={world} zero={zero} {precision}"))
            step = make_step(model, bopt, True)
            if precision == "fp32":
                results["time"][f"zero{zero}"] = _time_steps(step, args.warmup, args.steps)
            else:
                step(0)
            # measure at the peak of model states: gradients reduced, optimizer state built
            loss = next_token_loss(model, token_batch(0, rank, args.batch, args.seq))
            bopt.backward(loss)
            bopt.finish_grad_sync()
            results["memory"][(f"zero{zero}", precision)] = bopt.memory_breakdown()
            bopt.zero_grad()
    return results


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench data_parallel")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="per rank")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)

    from kernels_runtime.testing import run_ranks

    per_rank = run_ranks(_run, args.world, args, timeout_s=3600)
    r0 = per_rank[0]
    n, psi = args.world, r0["numel"]
    t = {k: statistics.mean(r["time"][k] for r in per_rank) for k in r0["time"]}
    print(f"GPT-2 {args.layers} layers, hidden {args.hidden}, seq {args.seq}, batch {args.batch}"
          f"/rank, {n} ranks, {psi / 1e6:.2f} M parameters, AdamW")
    print("\nstep time (median of steps, mean over ranks)")
    print_table(("runtime", "ms/step", "native", "ratio"), [
        ("zero=0", t["zero0"] * 1e3, "DDP", t["zero0"] / t["ddp"]),
        ("zero=1", t["zero1"] * 1e3, "DDP", t["zero1"] / t["ddp"]),
        ("zero=2", t["zero2"] * 1e3, "DDP", t["zero2"] / t["ddp"]),
        ("zero=3", t["zero3"] * 1e3, "FSDP2", t["zero3"] / t["fsdp2"]),
        ("DDP", t["ddp"] * 1e3, "-", 1.0),
        ("FSDP2", t["fsdp2"] * 1e3, "-", 1.0),
    ])
    ddp_total = sum(r0["memory"][("ddp", "fp32")].values())
    rows = []
    for precision in ("fp32", "bf16"):
        for zero in (0, 1, 2, 3):
            m = r0["memory"][(f"zero{zero}", precision)]
            total = sum(m.values())
            formula = sum(FORMULA_BYTES[precision][zero](n)) * psi
            rows.append((f"zero={zero}", precision, m["params"] / 2**20, m["grads"] / 2**20,
                         m["optimizer"] / 2**20, total / 2**20, formula / 2**20,
                         total / formula, total / ddp_total))
    print("\nmodel-state memory per rank (MiB; optimizer includes fp32 masters)")
    print_table(("stage", "precision", "params", "grads", "optimizer", "total", "formula",
                 "vs formula", "vs DDP fp32"), rows)
    worst = max(abs(r[7] - 1) for r in rows)
    print(f"\nheadline: zero=0/DDP step time = {t['zero0'] / t['ddp']:.2f}x (aim <= 1.05), "
          f"zero=3/FSDP2 = {t['zero3'] / t['fsdp2']:.2f}x (aim <= 1.10), memory within "
          f"{worst * 100:.1f}% of the ZeRO formulas")
