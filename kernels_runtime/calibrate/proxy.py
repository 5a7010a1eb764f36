"""A proxy transformer block and language model, built from torch alone.

Calibration must not depend on transformers, yet it needs work shaped like a real model: the
block has GPT-2's layout (pre-LayerNorm, fused QKV, causal attention, 4h MLP with tanh GELU)
and computes its products as ``addmm(bias, x, w)`` with ``w`` stored (in, out), as GPT-2's
``Conv1D`` does, because on some hardware (bf16 on CPUs) that form is several times slower
than ``nn.Linear``'s and the benchmark must time what the model runs.
"""

from __future__ import annotations

import math

import torch
from torch import nn

COMPOSITE_GELU = ("gelu_new", "gelu_fast")  # written out op by op, as GPT-2 computes it


def gelu_tanh_composite(x: torch.Tensor) -> torch.Tensor:
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) as separate ops: each one allocates and
    autograd keeps several of the wide intermediates, which is what costs memory and time."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def copy_product(x: torch.Tensor, fan_out: int) -> torch.Tensor:
    """A tensor shaped like ``x @ w`` (last dim ``fan_out``) made without FLOPs: ``x`` repeated
    or folded. It writes a product's output into fresh memory, which is memory-bound work."""
    n = x.shape[-1]
    if fan_out >= n:
        return x.repeat(*([1] * (x.dim() - 1)), -(-fan_out // n))[..., :fan_out]
    return x.reshape(*x.shape[:-1], n // fan_out, fan_out).sum(-2)


class Proj(nn.Module):
    """``x @ w + b`` with ``w`` of shape (in, out); with ``matmul=False``, ``copy_product``."""

    def __init__(self, fan_in: int, fan_out: int, matmul: bool = True) -> None:
        super().__init__()
        self.matmul = matmul
        self.weight = nn.Parameter(torch.randn(fan_in, fan_out) * fan_in**-0.5)
        self.bias = nn.Parameter(torch.zeros(fan_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.matmul:
            return copy_product(x, self.bias.shape[0]) + self.bias
        out = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight)  # (b*s, out)
        return out.view(*x.shape[:-1], -1)


class ProxyBlock(nn.Module):
    """``activation`` names the model's MLP activation: GPT-2's composite tanh GELU is mirrored
    op by op, anything else runs as PyTorch's fused tanh GELU. ``matmul=False`` makes the
    block's memory-bound twin: products become ``copy_product`` and attention a sum of q, k, v.
    """

    def __init__(self, h: int, heads: int, ffn: int | None = None, activation: str = "gelu",
                 matmul: bool = True) -> None:
        super().__init__()
        self.heads, self.matmul = heads, matmul
        self.composite = activation in COMPOSITE_GELU
        ffn = ffn or 4 * h
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = Proj(h, 3 * h, matmul), Proj(h, h, matmul)
        self.fc, self.out = Proj(h, ffn, matmul), Proj(ffn, h, matmul)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = (t.transpose(1, 2) for t in  # (b, a, s, d) each
                   self.qkv(self.ln1(x)).view(b, s, 3, self.heads, -1).unbind(2))
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True) \
            if self.matmul else q + k + v
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, h))  # (b, s, h)
        inner = self.fc(self.ln2(x))  # (b, s, ffn)
        act = gelu_tanh_composite(inner) if self.composite else \
            nn.functional.gelu(inner, approximate="tanh")
        return x + self.out(act)

    @staticmethod
    def products(b: int, s: int, h: int, ffn: int) -> list[tuple[int, int, int]]:
        """(tokens, in, out) of the block's four products."""
        t = b * s
        return [(t, h, 3 * h), (t, h, h), (t, h, ffn), (t, ffn, h)]


class ProxyLM(nn.Module):
    """Embedding, ``layers`` proxy blocks, final norm and output head."""

    def __init__(self, layers: int, h: int = 16, vocab: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, h)
        self.blocks = nn.ModuleList(ProxyBlock(h, 2) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(h), nn.Linear(h, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(x)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(self.norm(hidden))
