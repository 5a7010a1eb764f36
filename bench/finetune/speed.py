"""Speed of a LoRA step: the runtime against plain peft on one rank, and dp=2 against one rank.

Same model (the real SmolLM2-135M with peft's rank-8 adapters on the seven projections, fp32),
same batch, same optimizer (AdamW over the adapters) on both sides of each ratio:
- one rank: ``parallelize(model, opt, "dp=1")`` + ``train_step`` against the plain loop
  ``loss.backward(); opt.step(); opt.zero_grad()`` on an identical ``PeftModel`` in the same
  process with the same ``torch.set_num_threads``;
- dp=2 against one rank, in tokens/s: each dp rank its own batch of the one rank's size;
  beside it the machine's own ceiling: two plain peft loops run at once in the two ranks,
  nothing communicated, against one alone (what two processes get out of these cores).

Threads: this machine has 2 cores, so 2 ranks x 1 thread are compared with 1 rank x 1 thread:
each dp rank gets what the single rank had, and the ratio measures data-parallel scaling (the
gradient all-reduce, the ranks' synchronisation), not intra-op threading, which would credit or
charge the single rank for however well its kernels use a second core.

The rank processes keep their models between calls, so rounds interleave the three variants
(one rank runtime, one rank plain, dp=2; the first two alternate which goes first); medians
and the min-max spread of the per-round figures are printed.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from bench.common.spread import spread

_STATE: dict[str, Any] = {}  # in each rank process: variant -> (model, optimizer)


def prepare_on_rank(rank: int, world: int, folder: str, threads: int, plain: bool) -> int:
    """Build the runtime's model (dp=world) and, when ``plain``, peft's; one warm-up step
    each (states allocated). Returns the trainable element count."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    from bench.finetune.memory import with_lora
    from kernels_runtime import ParallelContext, parallelize

    logging.disable_progress_bar()
    torch.set_num_threads(threads)
    model = with_lora(AutoModelForCausalLM.from_pretrained(folder))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    _STATE["runtime"] = parallelize(model, opt, ctx=ParallelContext.build(f"dp={world}"),
                                    verbose=False)
    if plain:
        ref = with_lora(AutoModelForCausalLM.from_pretrained(folder))
        ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-4)
        _STATE["plain"] = (ref, ref_opt)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def time_on_rank(rank: int, world: int, variant: str, steps: int, first: int, batch: int,
                 seq: int) -> list[float]:
    """Seconds of each of ``steps`` steps of ``variant`` on this rank's own batches."""
    from kernels_runtime import train_step
    from kernels_runtime.calibrate.trial import next_token_loss, token_batch

    model, opt = _STATE[variant]
    times = []
    for s in range(first, first + steps):
        data = token_batch(s, rank, batch, seq)  # (b, s) tokens, different per rank and step
        t0 = time.perf_counter()
        if variant == "plain":
            next_token_loss(model, data).backward()
            opt.step()
            opt.zero_grad()
        else:
            train_step(model, opt, [data], loss_fn=next_token_loss)
        times.append(time.perf_counter() - t0)
    return times


def run(folder: str, rounds: int, steps: int, batch: int, seq: int,
        pools: dict[int, Any] | None = None) -> dict[str, Any]:
    """Interleaved rounds on a 1-rank pool (runtime and plain peft) and a 2-rank pool;
    ``pools`` ({world: RankPool}) lends them (the caller's other parts ran there and the
    caller closes them), else they are started and closed here."""
    import contextlib

    from kernels_runtime.testing import RankPool

    per_round: dict[str, list[float]] = {"runtime": [], "plain": [], "dp2": [], "two": []}
    lent = pools or {}
    with contextlib.ExitStack() as stack:
        one, two = (lent.get(w) or stack.enter_context(RankPool(w, pg_timeout_s=600))
                    for w in (1, 2))
        trainable = one.run(prepare_on_rank, folder, 1, True, timeout_s=600)[0]
        two.run(prepare_on_rank, folder, 1, True, timeout_s=600)
        step = 0
        for r in range(rounds + 1):  # round 0 warms up every variant
            order = ("runtime", "plain") if r % 2 else ("plain", "runtime")
            for variant in order:
                t = one.run(time_on_rank, variant, steps, step, batch, seq, timeout_s=600)[0]
                if r:
                    per_round[variant].append(statistics.median(t))
            t2 = two.run(time_on_rank, "runtime", steps, step, batch, seq, timeout_s=600)
            if r:  # a dp step ends when its slowest rank's does
                per_round["dp2"].append(statistics.median(max(a) for a in zip(*t2)))
            # the machine's ceiling: two plain loops at once, nothing communicated
            t2 = two.run(time_on_rank, "plain", steps, step, batch, seq, timeout_s=600)
            if r:
                per_round["two"].append(statistics.median(max(a) for a in zip(*t2)))
            step += steps
    return {"per_round": per_round, "batch": batch, "seq": seq, "steps": steps,
            "trainable": trainable}


def report(out: dict[str, Any]) -> dict[str, float]:
    """Print the step times and ratios; return their medians over rounds."""
    from bench.common.table import print_table

    pr = out["per_round"]
    tokens = out["batch"] * out["seq"]
    vs_peft = [a / b for a, b in zip(pr["runtime"], pr["plain"])]
    scaling = [(2 * tokens / d) / (tokens / one) for d, one in zip(pr["dp2"], pr["runtime"])]
    ceiling = [(2 * tokens / t) / (tokens / one) for t, one in zip(pr["two"], pr["plain"])]
    print(f"LoRA step, SmolLM2-135M fp32, {out['trainable'] / 1e6:.2f}M trainable, batch "
          f"{out['batch']} x {out['seq']} tokens per rank, AdamW; {len(vs_peft)} rounds of "
          f"{out['steps']} steps (median step per round), variants interleaved; 1 thread per "
          "rank on both sides (2 cores: 2 ranks x 1 thread against 1 rank x 1 thread)")
    print_table(["variant", "s/step (spread)", "tokens/s"], [
        ["1 rank: parallelize + train_step", spread(pr["runtime"]),
         tokens / statistics.median(pr["runtime"])],
        ["1 rank: plain peft loop", spread(pr["plain"]), tokens / statistics.median(pr["plain"])],
        ["dp=2 (each rank its own batch)", spread(pr["dp2"]),
         2 * tokens / statistics.median(pr["dp2"])],
        ["2 plain peft loops at once, no comms", spread(pr["two"]),
         2 * tokens / statistics.median(pr["two"])],
    ])
    print("per round: " + "; ".join(
        f"{a:.2f}/{b:.2f}/{d:.2f} s -> {v:.2f}, {x:.2f}" for a, b, d, v, x in
        zip(pr["runtime"], pr["plain"], pr["dp2"], vs_peft, scaling))
        + " (runtime/peft/dp=2 step -> runtime/peft, dp=2 scaling)")
    figures = {"vs_peft": statistics.median(vs_peft), "dp2_scaling": statistics.median(scaling),
               "ceiling": statistics.median(ceiling)}
    print(f"this machine's ceiling for 2 ranks: two independent plain loops at once / one "
          f"alone = {spread(ceiling)} in tokens/s")
    print(f"LoRA step 1 rank / plain peft: {spread(vs_peft)} (aim <= 1.1); dp=2 tokens/s / "
          f"1 rank: {spread(scaling)} (aim >= 1.6)")
    return figures
