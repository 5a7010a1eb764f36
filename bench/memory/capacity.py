"""How large a model trains under a device budget: plain PyTorch against the host tier.

The headline of heterogeneous memory is capacity, not speed: with model state on the host,
the device holds only what is computed now. Both sides are GPT-2-shaped (byte vocabulary,
``hidden // 64`` heads, one sequence of ``seq`` tokens per step, fp32, AdamW) and counted the
way a GPU's allocator would count them on this CPU-only machine:

- plain PyTorch: the peak bytes of live tensors over a whole steady-state step (parameters,
  AdamW states, gradients, activations, temporaries), counted op by op by ``LiveBytes``;
  printed beside the textbook 16 bytes per parameter (it can only be above) as a check of the
  counter. The largest model of a ladder (widths x depths) whose
  peak fits the budget is plain PyTorch's largest.
- the host tier: ``zero=3 offload=auto device_mem=<the budget>``, two steps: the first measures
  what autograd keeps for backward and the placement reserves it (model state is evicted as
  activations grow), the second runs under that reserve. Its device peak is the runtime's own
  account over the second step: model state, chunks gathered for compute and their gradient
  buffers, and the activations it measured, at each moment together. The device budget does not
  bound depth, only width (one block gathered with its gradient buffer must fit); the depth
  trained here is bounded by this machine's host memory and the benchmark's time, so the ratio
  printed is what was shown to train, not a ceiling.
"""

from __future__ import annotations

import argparse
import time

from bench.common.table import print_table

VOCAB = 256


def shape(hidden: int, layers: int, seq: int) -> dict:
    return {"model_type": "gpt2", "vocab": VOCAB, "seq": seq, "hidden": hidden,
            "layers": layers, "heads": max(1, hidden // 64), "attention": "sdpa"}


def plain_peak(hidden: int, layers: int, seq: int) -> dict:
    """The peak live bytes of a plain PyTorch step in steady state (the second: AdamW's
    states exist from the first on), and the textbook 16 bytes per parameter beside it."""
    from bench.common.live_bytes import plain_step_peak

    return {"hidden": hidden, "layers": layers, **plain_step_peak(shape(hidden, layers, seq))}


def largest_plain(budget: int, widths: list[int], seq: int) -> tuple[dict, list[dict]]:
    """Deepen each width until a step's peak passes ``budget``; the largest that fits."""
    tried, fits = [], []
    for hidden in widths:
        for layers in range(1, 64):
            row = plain_peak(hidden, layers, seq)
            tried.append(row)
            if row["peak"] > budget:
                break
            fits.append(row)
    if not fits:
        raise RuntimeError(f"no model of the ladder (widths {widths}) trains a plain step in "
                           f"{budget} bytes; give smaller --capacity-widths")
    return max(fits, key=lambda r: r["numel"]), tried


def offloaded_step(hidden: int, layers: int, seq: int, budget: int, spill: str) -> dict:
    """Two steps of ``zero=3 offload=auto device_mem=<budget>``: the first measures the
    activations (the placement's device reserve), the second runs under it."""
    import torch

    from kernels_runtime import ParallelContext, parallelize, train_step
    from kernels_runtime.byte_sizes import format_bytes
    from kernels_runtime.calibrate.trial import build_model, next_token_loss, token_batch

    model = build_model(shape(hidden, layers, seq))
    numel = sum(p.numel() for p in model.parameters())
    plan = f"dp=1 zero=3 offload=auto device_mem={format_bytes(budget)}"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    model, opt = parallelize(model, opt, ctx=ParallelContext.build(plan), verbose=False,
                             spill_dir=spill)
    t0 = time.perf_counter()
    peak, evictions, activations = 0, [], 0
    for step in range(2):
        result = train_step(model, opt, [token_batch(step, 0, 1, seq)],
                            loss_fn=next_token_loss)
        last = opt.sync.last_step
        if step:  # the first step measures the activations as they appear
            peak = max(peak, last["device_total_peak"])
        activations = max(activations, last["activations"])
        evictions.append(last["evictions"])
    seconds = (time.perf_counter() - t0) / 2
    return {"hidden": hidden, "layers": layers, "numel": numel, "plan": plan,
            "activations": activations, "device_state_peak": peak - activations,
            "peak": peak, "tiers": opt.sync.tier_bytes(),
            "loss": float(result.loss), "seconds": seconds, "evictions": evictions}


def run(args: argparse.Namespace, spill: str) -> dict:
    """On one rank: plain PyTorch's largest under the budget, then the host tier's step."""
    from kernels_runtime.byte_sizes import parse_bytes

    budget = parse_bytes(args.capacity_budget)
    best, tried = largest_plain(budget, args.capacity_widths, args.capacity_seq)
    offload = offloaded_step(args.offload_hidden, args.offload_layers, args.capacity_seq,
                             budget, spill)
    return {"budget": budget, "seq": args.capacity_seq, "plain": best, "tried": tried,
            "offload": offload}


def report(out: dict) -> float:
    from kernels_runtime.byte_sizes import human_bytes

    budget, best, off = out["budget"], out["plain"], out["offload"]
    print(f"device budget {human_bytes(budget)} (the runtime's accounting, as on a GPU), "
          f"GPT-2-shaped, one sequence of {out['seq']} tokens per step, fp32 AdamW")
    rows = [[f"plain h={r['hidden']} L={r['layers']}", f"{r['numel'] / 1e6:.1f}M",
             human_bytes(r["peak"]), human_bytes(r["textbook"]),
             "fits" if r["peak"] <= budget else "over"] for r in out["tried"]]
    rows.append([f"host tier h={off['hidden']} L={off['layers']}", f"{off['numel'] / 1e6:.1f}M",
                 human_bytes(off["peak"]),
                 f"state <= {human_bytes(off['device_state_peak'])} + act "
                 f"{human_bytes(off['activations'])}",
                 "fits" if off["peak"] <= budget else "over"])
    print_table(["model", "parameters", "device peak", "16 B/param / split", "budget"], rows)
    tiers = ", ".join(f"{k} {human_bytes(v)}" for k, v in off["tiers"].items())
    print(f"host tier: plan '{off['plan']}', {off['seconds']:.1f} s per step, loss "
          f"{off['loss']:.4f}, evictions per step {off['evictions']}; model state now: {tiers}")
    if off["peak"] > budget:
        raise RuntimeError(f"the host-tier step's device peak {human_bytes(off['peak'])} "
                           f"passed the budget {human_bytes(budget)}")
    ratio = off["numel"] / best["numel"]
    print(f"largest plain PyTorch step in {human_bytes(budget)}: {best['numel'] / 1e6:.1f}M "
          f"parameters; trained with the host tier: {off['numel'] / 1e6:.1f}M -> {ratio:.1f}x "
          "(aim >= 25x)")
    return ratio


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--capacity-budget", default="256MiB")
    parser.add_argument("--capacity-widths", type=int, nargs="+", default=[256, 384, 512])
    parser.add_argument("--capacity-seq", type=int, default=16)
    parser.add_argument("--offload-hidden", type=int, default=1024)
    parser.add_argument("--offload-layers", type=int, default=36)


QUICK = {"capacity_budget": "8MiB", "capacity_widths": [64], "capacity_seq": 16,
         "offload_hidden": 64, "offload_layers": 12}
