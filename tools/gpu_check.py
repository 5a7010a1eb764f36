"""One short check of the runtime's GPU path, for a machine with at least one CUDA device.

    python tools/gpu_check.py            # prints one JSON line; exits 1 if a check failed

It runs in one process (world size 1 on nccl; more ranks need more GPUs) and checks what the
CPU test suite cannot: the accelerator picks cuda/nccl by itself; a collective's ``wait`` does
not block the host while the device is busy (no timed host wait on nccl); its timing arrives
from device events without a synchronize; ``train_step`` of a tiny GPT-2 on the GPU records a
step split from events; a checkpoint round trip restores the weights and the CUDA RNG state;
offloaded training (state in pinned host memory, parameters prefetched to the device on a side
stream) gives the same losses; the inference engine's paged KV cache on the device gives HF
``generate``'s greedy tokens, also when a small cache swaps requests to pinned host memory; the
local experts' grouped GEMMs (``parallel/expert/expert_compute.py``) give the loop's outputs and
gradients in bf16, and it reports which path the automatic choice takes (and why not grouped)
and each path's forward-and-backward time from CUDA events, rounds interleaved (reported, not
checked).

It is a tool, not a benchmark (it compares nothing, so ``python -m bench`` does not list it), and
not part of the runtime (it names cuda and nccl throughout, which only ``kernels_runtime.comm``
may): it drives the installed ``kernels_runtime`` from outside.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time


def _busy(device, seconds_hint: int = 64):
    import torch

    a = torch.randn(4096, 4096, device=device)
    for _ in range(seconds_hint):
        a = a @ a
        a = a / a.norm()
    return a


def main(argv: list[str] | None = None) -> int:
    import torch

    from kernels_runtime import ParallelContext, load, parallelize, save, train_step
    from kernels_runtime.comm import Accelerator, Collectives, CommStats, find_free_port
    from kernels_runtime.session import RankSession

    checks: dict[str, object] = {}
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    acc = Accelerator.detect()
    checks["accelerator"] = [acc.kind, acc.backend, str(acc.device)]
    session = RankSession.start(0, 1, "127.0.0.1", find_free_port(), None, 60.0)
    comm = Collectives(CommStats(), timeout_s=60.0)
    # a collective queued behind a long matmul chain: wait() must return before the device does
    x = _busy(acc.device)
    t = torch.ones(1 << 20, device=acc.device)
    issued = time.perf_counter()
    op = comm.all_reduce_async(t)
    op.wait()
    waited = time.perf_counter() - issued
    pending_before_sync = comm.stats.totals()["calls"]
    torch.cuda.synchronize()
    device_done = time.perf_counter() - issued
    checks["wait_s"], checks["device_s"] = round(waited, 4), round(device_done, 4)
    checks["host_not_blocked"] = waited < 0.5 * device_done
    checks["timing_deferred_then_resolved"] = [pending_before_sync,
                                               comm.stats.totals()["calls"]]
    del x
    # a training step on the GPU, timed by events
    from transformers import GPT2Config, GPT2LMHeadModel

    ctx = ParallelContext.build("dp=1 bf16", session.comm)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=128, n_layer=2,
                                       n_head=4, bos_token_id=0, eos_token_id=0))
    model, opt = parallelize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), ctx=ctx,
                             max_grad_norm=1.0)
    ids = torch.randint(0, 256, (4, 64))
    losses = [train_step(model, opt, [(ids, ids)]).loss for _ in range(5)]
    record = session.telemetry.recent[-1]
    checks["losses"] = [round(v, 4) for v in losses]
    checks["step_split"] = {"seconds": record.seconds, "compute": record.compute,
                            "comm": record.comm, "waiting": record.waiting}
    checks["split_sane"] = 0 < record.compute <= record.seconds * 1.05
    with tempfile.TemporaryDirectory() as tmp:
        save(tmp, model, opt, step=5)
        rng = torch.cuda.get_rng_state()
        torch.cuda.manual_seed(123)
        fresh = GPT2LMHeadModel(model.config)
        fresh, fresh_opt = parallelize(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-3),
                                       ctx=ctx.with_plan("dp=1 bf16"))
        load(tmp, fresh, fresh_opt)
        same = all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
        checks["checkpoint_round_trip"] = same
        checks["cuda_rng_restored"] = torch.equal(torch.cuda.get_rng_state(), rng)
    checks.update(_offload(ctx, model.config))
    checks.update(_inference(session.comm, model.config, "cuda"))
    checks.update(_experts(acc.device))
    session.close()
    ok = all(checks[k] is True for k in (
        "host_not_blocked", "split_sane", "checkpoint_round_trip", "cuda_rng_restored",
        "offload_same_losses", "offload_prefetched", "inference_tokens_equal",
        "inference_swapped_equal", "experts_grouped_equal"))
    ok = ok and checks["timing_deferred_then_resolved"] == [0, 1]
    checks["ok"] = ok
    print(json.dumps(checks))
    return 0 if ok else 1


def _offload(ctx, config) -> dict:
    """Heterogeneous memory on the GPU: every kind of state in pinned host memory, parameters
    prefetched to the device on the side stream while the unit before computes; the losses
    match training without offload (fp32; GPU kernels, so 1e-5) and prefetches happened."""
    import torch
    from transformers import GPT2LMHeadModel

    from kernels_runtime import parallelize, train_step

    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1))
    losses, uploads = {}, 0
    for plan in ("dp=1", "dp=1 zero=3 offload=auto device_mem=14MiB"):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(config)
        model, opt = parallelize(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                 ctx=ctx.with_plan(plan), verbose=False)
        losses[plan] = [train_step(model, opt, [(ids, ids)]).loss for _ in range(4)]
        uploads = getattr(getattr(opt.sync, "store", None), "uploads", uploads)
    plain, offloaded = losses.values()
    rel = max(abs(a - b) / abs(b) for a, b in zip(offloaded, plain))
    return {"offload_loss_rel": rel, "offload_same_losses": rel <= 1e-5,
            "offload_uploads": uploads, "offload_prefetched": uploads > 0}


def _inference(comm, config, device: str) -> dict:
    """The engine on the GPU: greedy tokens equal HF ``generate`` on the same device (fp32),
    with a roomy cache and with one so small that requests swap to pinned host memory."""
    import torch
    from transformers import GPT2LMHeadModel

    from kernels_runtime.inference import Engine, SamplingParams

    torch.manual_seed(0)
    reference = GPT2LMHeadModel(config).to(device).eval()
    prompts = [torch.randint(1, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (5, 30, 17, 40)]
    expected = [reference.generate(torch.tensor([p], device=device), max_new_tokens=16,
                                   do_sample=False, pad_token_id=0, eos_token_id=None)
                [0, len(p):].tolist() for p in prompts]
    out = {}
    for name, kwargs in (("tokens", {}), ("swapped", {"kv_mem": "128KiB",
                                                      "preemption": "swap"})):
        torch.manual_seed(0)
        engine = Engine(GPT2LMHeadModel(config), "dp=1", comm=comm, verbose=False,
                        max_batch_tokens=32, **kwargs)
        got = engine.generate(prompts, SamplingParams(max_new_tokens=16, ignore_eos=True))
        out[f"inference_{name}_equal"] = [o.token_ids for o in got] == expected
        out[f"inference_{name}_preemptions"] = engine.stats()["preemptions"]
    out["inference_device"] = str(engine.cache.device)
    return out


def _experts(device, rounds: int = 20) -> dict:
    """One rank's local experts at Mixtral-like sizes in bf16 (8 experts, h 2048, I 1408, 8192
    rows, one expert without rows): the grouped path against the loop (1e-2 relative L2: bf16
    outputs, other accumulation orders; the idle expert's gradients exactly zero), the path
    "auto" picks, and each path's forward + backward time, median and spread of interleaved
    rounds timed by CUDA events."""
    import torch
    from torch.nn.functional import silu

    from kernels_runtime.parallel.expert.expert_compute import (
        choose_path,
        expert_mlp,
        grouped_unavailable,
    )

    gen = torch.Generator().manual_seed(0)
    sizes = [1536, 0, 1024, 2048, 512, 1280, 768, 1024]  # rows per local expert
    h, inter = 2048, 1408
    leaves = [torch.randn(sum(sizes), h, generator=gen),  # (n, h)
              torch.randn(len(sizes), 2 * inter, h, generator=gen) * h ** -0.5,  # (E_l, 2I, h)
              torch.randn(len(sizes), h, inter, generator=gen) * inter ** -0.5]  # (E_l, h, I)
    leaves = [t.to(device, torch.bfloat16).requires_grad_() for t in leaves]
    grad_out = torch.randn(sum(sizes), h, generator=gen).to(device, torch.bfloat16)

    def step(path: str) -> list:
        for leaf in leaves:
            leaf.grad = None
        out = expert_mlp(*leaves[:1], sizes, *leaves[1:], silu, path)  # (n, h)
        out.backward(grad_out)
        return [out.detach()] + [leaf.grad.clone() for leaf in leaves]

    result = {"experts_path": choose_path(*leaves),
              "experts_grouped_unavailable": grouped_unavailable(*leaves)}
    try:
        loop, grouped = step("loop"), step("grouped")
    except RuntimeError as error:  # a torch without a grouped kernel for this device
        return {**result, "experts_grouped_equal": False, "experts_error": str(error)[:300]}
    rel = [float((g.float() - ref.float()).norm() / ref.float().norm())
           for g, ref in zip(grouped, loop)]
    idle = all(float(grad[1].abs().max()) == 0 for grad in grouped[2:])
    result["experts_rel"] = [round(r, 6) for r in rel]
    result["experts_grouped_equal"] = max(rel) <= 1e-2 and idle
    times: dict[str, list[float]] = {"loop": [], "grouped": []}
    for index in range(rounds + 3):  # 3 warm-up rounds, then interleaved
        for path in times:
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            step(path)
            end.record()
            end.synchronize()
            if index >= 3:
                times[path].append(start.elapsed_time(end))
    for path, ms in times.items():
        ms.sort()
        result[f"experts_{path}_ms"] = {"median": round(ms[len(ms) // 2], 3),
                                        "min": round(ms[0], 3), "max": round(ms[-1], 3)}
    result["experts_loop_over_grouped"] = round(
        result["experts_loop_ms"]["median"] / result["experts_grouped_ms"]["median"], 2)
    return result


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
