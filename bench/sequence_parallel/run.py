"""Sequence parallelism's point: a sequence sp times longer under the same per-rank memory.

On 4 gloo ranks, a small HF LLaMA (GQA) trains one step on b sequences of length s per rank
without sequence parallelism (``dp=4``: each rank holds whole sequences) and on b sequences of
length 4s under ``sp=4`` with ring attention (zig-zag shards) and with Ulysses (all-to-all).
Per rank it prints the bytes autograd saves for backward (``SavedActivations``: the
activation memory, parameters excluded) in the blocks and outside them, and their ratio to the
sp=1 run: ~1.0 means the 4x longer sequence fits where the short one did. The loss is
``causal_lm_loss``, which under sp never joins the sequence or its logits.

Also printed: the same sp=4 runs at the short length s (each rank holds s/4 tokens), whose
ratio to sp=1 shows activation memory falling with sp at a fixed sequence.
"""

from __future__ import annotations

import argparse
from typing import Any

from bench.common.table import print_table

PLANS = (("sp=1 (dp=4)", "dp=4", 1), ("sp=4 ring", "sp=4 sp_mode=ring", 4),
         ("sp=4 Ulysses", "sp=4 sp_mode=all_to_all", 4))


def _model(args: argparse.Namespace, seq: int):
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=args.vocab,
        max_position_embeddings=seq, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config)


_COMMS: list = []  # one Collectives per rank process: plans reuse their cached groups


def _comm():
    from kernels_runtime.comm import Collectives

    if not _COMMS:
        _COMMS.append(Collectives())
    return _COMMS[0]


def saved_bytes(rank: int, world: int, args: argparse.Namespace, plan: str, seq: int,
                comm_factory: Any = None) -> dict[str, Any]:
    """One training step of ``plan`` on (batch, seq) tokens per rank: bytes saved for backward
    in the blocks and outside, on this rank (``comm_factory``: the process's Collectives)."""
    import torch

    from kernels_runtime import ParallelContext, causal_lm_loss, parallelize
    from kernels_runtime.memory.saved_activations import SavedActivations

    ctx = ParallelContext.build(plan, (comm_factory or _comm)())
    model = _model(args, seq)
    model, opt = parallelize(model, torch.optim.SGD(model.parameters(), lr=0.01), ctx=ctx,
                             verbose=False)
    ids = torch.randint(0, args.vocab, (args.batch, seq),
                        generator=torch.Generator().manual_seed(rank if "dp" in plan else 0))
    blocks = model.parallel_state.blocks
    with SavedActivations(blocks) as saved:
        loss = causal_lm_loss(model, (ids, ids))
    opt.backward(loss)
    opt.step()
    opt.zero_grad()
    inside = sum(v for k, v in saved.by_block.items() if k != "outside")
    return {"blocks": inside, "outside": saved.by_block.get("outside", 0),
            "total": saved.total, "tokens": seq // (4 if "sp=4" in plan else 1)}


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every plan at its sequence length, on one pool of 4 ranks."""
    from kernels_runtime.testing import RankPool

    rows = []
    cases = [(name, plan, args.seq * factor) for name, plan, factor in PLANS]
    cases += [(f"{name} at s", plan, args.seq) for name, plan, factor in PLANS if factor > 1]
    with RankPool(4) as pool:
        for name, plan, seq in cases:
            per_rank = pool.run(saved_bytes, args, plan, seq, timeout_s=1200)
            rows.append({"name": name, "seq": seq, **max(per_rank, key=lambda r: r["total"])})
    return rows


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench sequence_parallel")
    parser.add_argument("--seq", type=int, default=256, help="sp=1 sequence length")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--quick", action="store_true", help="seq 64, hidden 64")
    args = parser.parse_args(argv)
    if args.quick:
        args.seq, args.hidden = 64, 64
    return args


def main(argv: list[str]) -> None:
    args = parse(argv)
    rows = measure(args)
    base = rows[0]
    mib = 2**20
    print(f"LLaMA {args.layers} layers, h={args.hidden}, 4 heads (2 kv), vocab {args.vocab}, "
          f"batch {args.batch} per rank, fp32; 4 gloo ranks; bytes saved for backward on the "
          "rank saving most")
    print_table(["run", "sequence", "tokens/rank", "blocks MiB", "outside MiB", "total MiB",
                 "blocks / sp=1", "total / sp=1"],
                [[r["name"], r["seq"], r["tokens"], f"{r['blocks'] / mib:.2f}",
                  f"{r['outside'] / mib:.2f}", f"{r['total'] / mib:.2f}",
                  f"{r['blocks'] / base['blocks']:.3f}", f"{r['total'] / base['total']:.3f}"]
                 for r in rows])
    longest = [r for r in rows[1:3]]
    print("headline: a 4x longer sequence under sp=4 holds under "
          + ", ".join(f"{r['name']} {r['total'] / base['total']:.2f}x" for r in longest)
          + " the sp=1 per-rank activation memory (aim ~1.0)")
