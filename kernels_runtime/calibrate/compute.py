"""Compute-side micro-benchmarks: matmuls, attention, memory-bound work, the optimizer.

Rates are per dtype because they differ wildly by dtype on some hardware (bf16 products on a
CPU without bf16 instructions run at a few percent of fp32), and forward and backward are timed
apart because autograd's products (``g @ w.T``, ``x.T @ g``) take other kernels than ``x @ w``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kernels_runtime.calibrate.proxy import ProxyBlock
from kernels_runtime.calibrate.timing import timed
from kernels_runtime.memory.saved_activations import SavedActivations

Sync = Callable[[], None]


def matmul_rates(dtype: torch.dtype, shapes: list[tuple[int, int, int]], device: torch.device,
                 sync: Sync, window_s: float) -> dict[str, float]:
    """FLOP/s of products ``addmm(b, x, w)`` at (tokens, in, out) shapes and of their two
    backward products, over all shapes together (total FLOPs / total seconds)."""
    flops, fwd, bwd = 0.0, 0.0, 0.0
    for m, k, n in shapes:
        x = torch.randn(m, k, dtype=dtype, device=device)
        w = torch.randn(k, n, dtype=dtype, device=device)
        b = torch.randn(n, dtype=dtype, device=device)
        g = torch.randn(m, n, dtype=dtype, device=device)
        flops += 2 * m * k * n
        fwd += timed(lambda x=x, w=w, b=b: torch.addmm(b, x, w), sync, window_s)
        bwd += timed(lambda x=x, w=w, g=g: (g @ w.t(), x.t() @ g), sync, window_s)
    return {"forward": flops / fwd, "backward": 2 * flops / bwd}


def attention_rates(dtype: torch.dtype, shape: tuple[int, int, int, int], device: torch.device,
                    sync: Sync, window_s: float) -> dict[str, float]:
    """FLOP/s of causal ``scaled_dot_product_attention`` at (batch, heads, seq, head_dim),
    counting 4*b*s*s*h forward and twice that backward whatever the kernel skips (the count the
    cost model uses), so the rate absorbs what the fused kernel saves or wastes."""
    b, a, s, d = shape
    q, k, v = (torch.randn(b, a, s, d, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    g = torch.randn(b, a, s, d, device=device, dtype=dtype)
    sdpa = nn.functional.scaled_dot_product_attention
    fwd = timed(lambda: sdpa(q, k, v, is_causal=True), sync, window_s)
    both = timed(lambda: sdpa(q, k, v, is_causal=True).backward(g), sync, window_s)
    bwd = max(both - fwd, 1e-3 * fwd)
    flops = 4 * b * s * s * a * d
    return {"forward": flops / fwd, "backward": 2 * flops / bwd}


def activation_rate(dtype: torch.dtype, block: tuple[int, int, int, int, int], activation: str,
                    device: torch.device, sync: Sync, window_s: float) -> float:
    """Bytes kept for backward per second of a block's memory-bound work.

    Beyond its products and attention, a block spends time on norms, activation functions,
    residual adds, copies and writes into freshly allocated memory (page faults on a CPU, where
    freed memory goes back to the system between steps), all roughly proportional to what it
    keeps for backward. The proxy block's memory-bound twin (``matmul=False``) does that work
    without the FLOPs; its forward+backward time divides the real block's saved bytes. (Timing
    the real block and subtracting its products fails where products dominate and are noisy.)
    """
    b, s, h, heads, ffn = block
    x = torch.randn(b, s, h, device=device, dtype=dtype, requires_grad=True)
    with SavedActivations() as saved:
        ProxyBlock(h, heads, ffn, activation).to(device=device, dtype=dtype)(x)
    twin = ProxyBlock(h, heads, ffn, activation, matmul=False).to(device=device, dtype=dtype)
    return saved.total / timed(lambda: twin(x).sum().backward(), sync, window_s)


def elementwise_rate(dtype: torch.dtype, numel: int, device: torch.device, sync: Sync,
                     window_s: float) -> float:
    """Bytes per second moved by ``torch.add(x, y, out=z)`` (two reads, one write): the rate
    of casts and buffer zeroing in the optimizer step."""
    x = torch.randn(numel, device=device).to(dtype)
    y, z = torch.randn_like(x), torch.empty_like(x)
    seconds = timed(lambda: torch.add(x, y, out=z), sync, window_s)
    return 3 * numel * x.element_size() / seconds


def adam_rate(numel: int, device: torch.device, sync: Sync, window_s: float) -> float:
    """Elements per second of an AdamW step on one flat fp32 tensor, as ZeRO's buckets are."""
    p = torch.zeros(numel, device=device, requires_grad=True)
    p.grad = torch.randn(numel, device=device)
    opt = torch.optim.AdamW([p], lr=1e-3)
    return numel / timed(opt.step, sync, window_s)
