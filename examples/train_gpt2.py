"""Train a small GPT-2 on the Python standard library's sources with data parallelism and
ZeRO, from a plain script: the runtime does not need the notebook workbench.

    torchrun --nproc-per-node 2 examples/train_gpt2.py --plan "dp=2 zero=2 bf16" --steps 200
    torchrun --nproc-per-node 2 examples/train_gpt2.py --save ckpt --steps 100
    torchrun --nproc-per-node 2 examples/train_gpt2.py --resume ckpt --steps 200

Prints the loss every ``--log-every`` steps on rank 0, then tokens/s and peak memory per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from kernels_runtime import RankSession, load, parallelize, save, train_step
from kernels_runtime.data import TokenBatches, stdlib_corpus


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", default="zero=2 bf16")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--save", default=None, help="checkpoint directory to write at the end")
    p.add_argument("--resume", default=None, help="checkpoint directory to resume from")
    p.add_argument("--json", action="store_true", help="print a JSON summary line at the end")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    session = RankSession.from_env()
    ctx = session.context(args.plan)  # = ParallelContext.build(args.plan, session.comm)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=args.seq, n_embd=args.hidden,
                        n_layer=args.layers, n_head=4, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    model, opt = parallelize(model, opt, ctx=ctx, max_grad_norm=1.0)
    data = TokenBatches(stdlib_corpus(1_000_000), args.seq, args.global_batch,
                        ctx.dp_rank, ctx.dp_size, seed=0)
    start = 0
    if args.resume:
        start = load(args.resume, model, opt)["step"]
    losses, t0 = [], time.perf_counter()
    for step in range(start, args.steps):
        result = train_step(model, opt, data.microbatches(step, args.microbatches))
        losses.append(result.loss)
        if session.rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"step {step:5d}  loss {result.loss:.4f}", flush=True)
    seconds = time.perf_counter() - t0
    if args.save:
        save(args.save, model, opt, step=args.steps)
    tokens = (args.steps - start) * args.global_batch * args.seq
    memory = session.state.accelerator.memory_in_use()
    peak = torch.tensor([memory["host_peak"], memory["device_peak"]], dtype=torch.float64)
    peaks = [torch.zeros_like(peak) for _ in range(session.world_size)]
    torch.distributed.all_gather(peaks, peak)
    if session.rank == 0:
        print(f"{tokens / seconds:,.0f} tokens/s over {session.world_size} ranks")
        for r, p in enumerate(peaks):
            print(f"rank {r}: peak host memory {p[0] / 2**20:,.0f} MiB, "
                  f"peak device memory {p[1] / 2**20:,.0f} MiB")
        if args.json:
            print(json.dumps({"losses": losses, "start": start, "tokens_per_s": tokens / seconds}))
    session.close()


if __name__ == "__main__":
    main()
    # All work is done and the process group destroyed. Skip interpreter teardown: seen once in
    # CI under heavy load, a gloo/store thread still joinable while C++ statics were destroyed
    # aborted the process ("terminate called without an active exception") after a clean run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
