"""The largest model LoRA fine-tunes under a device budget, against plain full fine-tuning.

Both sides are LLaMA-shaped (byte vocabulary, ``hidden // 64`` heads, ffn 8/3 hidden rounded
to 64), one sequence of ``seq`` tokens per step, counted the way a GPU's allocator would count
them on this CPU-only machine (``bench/common/live_bytes.py``):

- plain PyTorch full fine-tuning, fp32 AdamW: the peak bytes of live tensors over a
  steady-state step (16 bytes per parameter plus activations and temporaries; the textbook
  16 B/param is printed beside it as a check). The largest model of a ladder of widths and
  depths whose peak fits the budget is plain PyTorch's largest.
- LoRA: a much larger model, frozen base in bf16, peft rank-8 adapters on the seven
  projections, ``dp=1 zero=3 offload=auto device_mem=<budget> bf16 host_mem=<small> ckpt`` with
  the spill folder on a real disk, two ``train_step``s. ``host_mem=0`` is refused under
  ``auto`` (a disk chunk is stepped on the host: its gradient, master and states must fit
  there at once), so the host gets a few MiB and everything else spills to disk. The plan is
  bf16: under offload the runtime holds frozen weights in the compute dtype, so an fp32
  plan would hold this bf16 base in fp32, twice its bytes (measured); the adapters compute
  in bf16 over fp32 masters and AdamW states.

Reported honestly: the runtime's own device peak (``last_step["device_total_peak"]``: the
chunks' model state, gathered working buffers and measured activations); where the frozen
weights are after the step (the placement's frozen chunks per tier, and any bytes still held
by the frozen parameters themselves, outside the placement's account: the whole base, where
the runtime does not chunk frozen weights); and the peak of all live tensor storages over the
second step (``LiveBytes``; on this CPU machine device and host tiers are one memory, so it
is compared with device_mem + host_mem). The LoRA model "fits" only if the runtime's peak
plus the frozen bytes outside its account do.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

VOCAB = 256


def shape(hidden: int, layers: int, seq: int) -> dict[str, Any]:
    ffn = (8 * hidden // 3 + 63) // 64 * 64
    return {"model_type": "llama", "vocab": VOCAB, "seq": seq, "hidden": hidden,
            "layers": layers, "heads": max(1, hidden // 64), "ffn": ffn, "attention": "sdpa"}


def plain_peak(hidden: int, layers: int, seq: int) -> dict[str, Any]:
    """Peak live bytes of a steady-state full fine-tuning step (fp32 AdamW, second step)."""
    from bench.common.live_bytes import plain_step_peak

    return {"hidden": hidden, "layers": layers,
            **plain_step_peak(shape(hidden, layers, seq), fused=False)}


def largest_plain(budget: int, widths: list[int], seq: int) -> tuple[dict, list[dict]]:
    """Per width, the deepest model whose measured step peak fits ``budget``: the peaks of one
    and two layers give the bytes per layer (a line: every layer adds the same), the line's
    deepest fit is then measured, with its neighbours until one fits and the next does not."""
    tried, fits = [], []
    for hidden in widths:
        one, two = plain_peak(hidden, 1, seq), plain_peak(hidden, 2, seq)
        tried += [one, two]
        per_layer = max(1, two["peak"] - one["peak"])
        layers = max(1, 1 + (budget - one["peak"]) // per_layer)
        rows = {1: one, 2: two}
        while True:
            for n in (layers, layers + 1):
                if n not in rows:
                    rows[n] = plain_peak(hidden, n, seq)
                    tried.append(rows[n])
            if rows[layers]["peak"] > budget and layers > 1:
                layers -= 1  # the line was optimistic: one shallower
            elif rows[layers + 1]["peak"] <= budget:
                layers += 1  # pessimistic: one deeper
            else:
                break
        if rows[layers]["peak"] <= budget:
            fits.append(rows[layers])
    if not fits:
        raise ValueError(f"no LLaMA of widths {widths} trains a plain step in {budget} bytes; "
                         "give smaller --widths or a larger --budget")
    tried.sort(key=lambda r: (r["hidden"], r["layers"]))
    return max(fits, key=lambda r: r["numel"]), tried


def _frozen_where(model) -> dict[str, Any]:
    """Where the frozen weights are now: bytes held by their storages in this process (on
    the device tier, for a CPU-only machine) and the devices they are on."""
    seen: dict[int, int] = {}
    devices = set()
    for p in model.parameters():
        if p.requires_grad:
            continue
        devices.add(p.device.type)
        s = p.untyped_storage()
        if s.nbytes():
            seen[s.data_ptr()] = s.nbytes()
    return {"resident": sum(seen.values()), "devices": sorted(devices)}


def _frozen_tiers(sync) -> dict[str, int]:
    """Bytes of frozen-weight chunks per tier, where the runtime packs frozen weights into
    chunks of their own (``memory/frozen_chunks.py``); empty where it does not."""
    out: dict[str, int] = {}
    for c in getattr(sync, "chunks", []):
        if getattr(c, "frozen", False):
            payload = sync.param[c.index]
            out[payload.tier.label] = out.get(payload.tier.label, 0) + payload.nbytes
    return out


def lora_step(hidden: int, layers: int, seq: int, budget: int, host: int,
              spill: str) -> dict[str, Any]:
    """Two LoRA steps of a bf16 LLaMA under ``offload=auto`` with ``budget`` on the device and
    ``host`` bytes of host memory (everything beyond on disk, in ``spill``)."""
    import torch

    from bench.common.live_bytes import LiveBytes
    from bench.finetune.memory import with_lora
    from kernels_runtime import ParallelContext, parallelize, train_step
    from kernels_runtime.byte_sizes import format_bytes
    from kernels_runtime.calibrate.trial import build_model, next_token_loss, token_batch

    t0 = time.perf_counter()
    torch.set_default_dtype(torch.bfloat16)  # the frozen base is built in bf16 (half the RAM)
    try:
        base = build_model(shape(hidden, layers, seq))
    finally:
        torch.set_default_dtype(torch.float32)
    base.config.use_cache = False  # training: no KV cache (checkpointed blocks drop it anyway)
    model = with_lora(base)
    numel = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen_bytes = sum(p.numel() * p.element_size() for p in model.parameters()
                       if not p.requires_grad)
    dtypes = {("adapter" if p.requires_grad else "frozen"): str(p.dtype)
              for p in model.parameters()}
    plan = (f"dp=1 zero=3 offload=auto device_mem={format_bytes(budget)} bf16 "
            f"host_mem={format_bytes(host)} ckpt")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    model, opt = parallelize(model, opt, ctx=ParallelContext.build(plan), verbose=False,
                             spill_dir=spill)
    built = time.perf_counter() - t0
    losses, live_peak, step_s = [], 0, 0.0
    for step in range(2):  # the first measures the activations, the second runs under them
        s0 = time.perf_counter()
        with LiveBytes(model.parameters() if step else ()) as live:
            result = train_step(model, opt, [token_batch(step, 0, 1, seq)],
                                loss_fn=next_token_loss)
        step_s = time.perf_counter() - s0
        losses.append(float(result.loss))
        live_peak = live.peak
    last = opt.sync.last_step
    frozen = _frozen_where(model)
    return {"hidden": hidden, "layers": layers, "numel": numel, "trainable": trainable,
            "frozen_bytes": frozen_bytes, "dtypes": dtypes, "plan": plan,
            "runtime_peak": last["device_total_peak"], "activations": last["activations"],
            "frozen": frozen, "frozen_tiers": _frozen_tiers(opt.sync),
            "tiers": opt.sync.tier_bytes(), "live_peak": live_peak,
            "spill_bytes": _folder_bytes(spill), "losses": losses, "step_s": step_s,
            "build_s": built}


def _folder_bytes(folder: str) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for f in files:
            with contextlib.suppress(OSError):  # a write-behind file renamed meanwhile
                total += os.path.getsize(os.path.join(root, f))
    return total


def run_on_rank(rank: int, world: int, budget: int, host: int, widths: list[int], seq: int,
                hidden: int, layers: int, spill: str) -> dict[str, Any]:
    best, tried = largest_plain(budget, widths, seq)
    lora = lora_step(hidden, layers, seq, budget, host, spill)
    return {"budget": budget, "host": host, "seq": seq, "plain": best, "tried": tried,
            "lora": lora}


def report(out: dict[str, Any]) -> dict[str, float]:
    """Print the ladder and the LoRA row; return the parameter ratio and whether it fit."""
    from bench.common.table import print_table
    from kernels_runtime.byte_sizes import human_bytes

    budget, best, lo = out["budget"], out["plain"], out["lora"]
    unaccounted = lo["frozen"]["resident"]
    honest = lo["runtime_peak"] + unaccounted
    fits = honest <= budget
    print(f"device budget {human_bytes(budget)}, LLaMA-shaped, one sequence of {out['seq']} "
          "tokens per step")
    rows = [[f"plain fp32 AdamW h={r['hidden']} L={r['layers']}", f"{r['numel'] / 1e6:.2f}M",
             human_bytes(r["peak"]), human_bytes(r["textbook"]),
             "fits" if r["peak"] <= budget else "over"] for r in out["tried"]]
    rows.append([f"LoRA h={lo['hidden']} L={lo['layers']}", f"{lo['numel'] / 1e6:.1f}M",
                 human_bytes(honest), f"runtime {human_bytes(lo['runtime_peak'])} + frozen "
                 f"outside it {human_bytes(unaccounted)}", "fits" if fits else "over"])
    print_table(["model", "parameters", "device peak", "16 B/param | account", "budget"], rows)
    tiers = ", ".join(f"{k} {human_bytes(v)}" for k, v in lo["tiers"].items())
    chunked = ", ".join(f"{k} {human_bytes(v)}" for k, v in lo["frozen_tiers"].items()) or \
        "none (frozen weights are not chunked)"
    print(f"LoRA: plan '{lo['plan']}'; frozen base {human_bytes(lo['frozen_bytes'])} "
          f"({lo['dtypes']['frozen']}), adapters {lo['trainable'] / 1e6:.2f}M "
          f"({lo['dtypes']['adapter']}); losses {', '.join(f'{x:.4f}' for x in lo['losses'])}; "
          f"{lo['step_s']:.1f} s/step (built in {lo['build_s']:.1f} s)")
    print(f"LoRA: where the frozen weights are after the step: in the placement's chunks "
          f"{chunked}; outside them, held by the parameters themselves "
          f"{human_bytes(unaccounted)} (on {'/'.join(lo['frozen']['devices'])}); model state "
          f"by tier: {tiers}; spill folder {human_bytes(lo['spill_bytes'])} on disk")
    print(f"LoRA: live tensor storages (device and host tiers are one memory here, and disk "
          f"I/O buffers count) peaked at {human_bytes(lo['live_peak'])} over the second step, "
          f"against device_mem + host_mem = {human_bytes(out['budget'] + out['host'])}")
    ratio = lo["numel"] / best["numel"]
    verdict = ("within the budget" if fits else
               "NOT within the budget: the frozen base stays in the rank's memory, so this "
               "shows a step runs, not that the budget holds it")
    print(f"largest plain full fine-tune in {human_bytes(budget)}: {best['numel'] / 1e6:.2f}M "
          f"parameters; LoRA step ran on {lo['numel'] / 1e6:.1f}M -> {ratio:.0f}x (aim >= 100x), "
          f"{verdict}")
    return {"ratio": ratio, "fits": float(fits), "device_peak": float(honest)}
