"""Every local expert's SwiGLU MLP on its rows: two grouped GEMMs on a GPU, a loop elsewhere.

Why grouped: the loop runs two matmuls (and an activation) per local expert, each on the few
rows routed to it, so a layer launches 2*E/ep small kernels that underfill a GPU.
``torch._grouped_mm`` (CUTLASS grouped GEMM) computes every expert's matmul in one kernel over
the rows sorted by expert, ``offs`` (int32, the cumulative row counts) marking where each
expert's rows end; an expert without rows is an empty group. The layout is the one transformers'
``grouped_mm`` experts and torchtitan use: rows (n, h) against the weights transposed to
(E/ep, h, 2I/tp), column-major views of the fused HF tensors, no copy.

When (``grouped_unavailable`` says why not): torch has ``_grouped_mm``; the rows and both weights
are bf16 on one GPU of compute capability 9.0 or more (torch's fast kernel is bf16 on
sm90/sm100; other dtypes and older GPUs fall back inside torch to a loop that reads the offsets
on the host, a sync, so nothing is gained); the kernel's 16-byte stride alignment holds (h, 2I/tp
and I/tp multiples of 8 elements); fewer than 1024 groups (the bf16 kernel's cap); at least one
row. Otherwise the loop, which is also the reference: on CPU this torch build runs
``_grouped_mm`` too (fp32 and bf16), so the tests compare the two paths there, forward and
backward, an expert without rows included.

``path`` forces one ("grouped" or "loop"; "auto" chooses): the tests and ``tools/gpu_check.py``
run both on the same rows. The grouped path's outputs' gradients are made contiguous before its
backward (``_ContiguousGrad``): the CPU kernel refuses the expanded gradient a ``sum()`` gives.

Shapes: n rows sorted by expert, h hidden, E_l = E/ep local experts, I' = I/tp features.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import Any

import torch
from torch import Tensor, nn

from kernels_runtime.comm.accelerator import grouped_gemm_capability

PATHS = ("auto", "grouped", "loop")
_GROUP_LIMIT = 1024  # torch's bf16 grouped kernel takes fewer groups than this
_ALIGN_BYTES = 16  # its operands' leading strides must be multiples of 16 bytes


def grouped_unavailable(rows: Tensor, gate_up: Tensor, down: Tensor) -> str | None:
    """Why the grouped GEMM cannot run these rows (n, h) through gate_up (E_l, 2I', h) and
    down (E_l, h, I'), or None when it can. Reads shapes and device properties only: no sync."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    dtypes = {rows.dtype, gate_up.dtype, down.dtype}
    if dtypes != {torch.bfloat16}:
        return f"dtypes {sorted(str(d) for d in dtypes)}: the grouped kernel is bf16"
    align = _ALIGN_BYTES // rows.element_size()
    sizes = {"h": rows.shape[-1], "2I/tp": gate_up.shape[1], "I/tp": down.shape[-1]}
    odd = [f"{name}={size}" for name, size in sizes.items() if size % align]
    if odd:
        return f"{', '.join(odd)} not a multiple of {align} (16-byte strides)"
    if gate_up.shape[0] >= _GROUP_LIMIT:
        return f"{gate_up.shape[0]} local experts: the grouped kernel takes < {_GROUP_LIMIT}"
    if rows.shape[0] == 0:
        return "no rows"
    devices = {rows.device, gate_up.device, down.device}
    capability = grouped_gemm_capability(rows.device) if len(devices) == 1 else None
    if capability is None:
        return f"on {sorted(str(d) for d in devices)}, not one GPU with a grouped-GEMM kernel"
    major, minor = capability
    if major < 9:
        return f"compute capability {major}.{minor}: the grouped bf16 kernel needs 9.0+"
    return None


def choose_path(rows: Tensor, gate_up: Tensor, down: Tensor, path: str = "auto") -> str:
    """"grouped" or "loop" for these operands: ``path`` itself unless it is "auto"."""
    if path not in PATHS:
        raise ValueError(f"expert compute path {path!r}: choose one of {PATHS}")
    if path != "auto":
        return path
    return "grouped" if grouped_unavailable(rows, gate_up, down) is None else "loop"


def expert_mlp(rows: Tensor, sizes: Sequence[int] | Tensor, gate_up: Tensor, down: Tensor,
               act_fn: Callable[[Tensor], Tensor], path: str = "auto") -> Tensor:
    """Mixtral's SwiGLU expert e on its rows: (n, h) -> (n, h). ``rows`` are sorted by local
    expert, ``sizes`` (E_l,) the rows of each (host ints or an integer tensor; the grouped path
    keeps a tensor on the device, no sync); ``gate_up`` (E_l, 2I', h) gate rows then up rows,
    ``down`` (E_l, h, I'), as HF fuses them. Every expert takes part, on zero rows if it got
    none, so its weights are in the graph (zero gradient, never missing)."""
    if len(sizes) != gate_up.shape[0] or down.shape[0] != gate_up.shape[0]:
        raise ValueError(f"{len(sizes)} row counts for {gate_up.shape[0]} gate_up and "
                         f"{down.shape[0]} down experts: give one count per local expert")
    if not isinstance(sizes, Tensor) and sum(sizes) != rows.shape[0]:
        raise ValueError(f"the row counts {list(sizes)} add up to {sum(sizes)}, not the "
                         f"{rows.shape[0]} rows given: sort the rows by expert, all of them")
    if choose_path(rows, gate_up, down, path) == "grouped":
        return _grouped(rows, sizes, gate_up, down, act_fn)
    return _loop(rows, sizes, gate_up, down, act_fn)


def _loop(rows: Tensor, sizes: Sequence[int] | Tensor, gate_up: Tensor, down: Tensor,
          act_fn: Callable[[Tensor], Tensor]) -> Tensor:
    counts = sizes.tolist() if isinstance(sizes, Tensor) else list(sizes)  # host read
    out = []
    for index, chunk in enumerate(rows.split(counts)):  # (m_e, h) each
        gate, up = nn.functional.linear(chunk, gate_up[index]).chunk(2, dim=-1)  # (m_e, I')
        out.append(nn.functional.linear(act_fn(gate) * up, down[index]))  # (m_e, h)
    return torch.cat(out)  # (n, h)


def _grouped(rows: Tensor, sizes: Sequence[int] | Tensor, gate_up: Tensor, down: Tensor,
             act_fn: Callable[[Tensor], Tensor]) -> Tensor:
    if not hasattr(torch, "_grouped_mm"):
        raise RuntimeError(f"the grouped expert path needs torch._grouped_mm, which torch "
                           f"{torch.__version__} lacks: use path='loop' or 'auto'")
    if isinstance(sizes, Tensor):
        offs = torch.cumsum(sizes.to(rows.device), 0, dtype=torch.int32)  # (E_l,)
    else:
        offs = torch.tensor(list(accumulate(sizes)), dtype=torch.int32, device=rows.device)
    both = torch._grouped_mm(rows, gate_up.transpose(-2, -1), offs=offs)  # (n, 2I')
    gate, up = _ContiguousGrad.apply(both).chunk(2, dim=-1)  # (n, I') each
    out = torch._grouped_mm(act_fn(gate) * up, down.transpose(-2, -1), offs=offs)  # (n, h)
    return _ContiguousGrad.apply(out)


class _ContiguousGrad(torch.autograd.Function):
    """Identity forward; the gradient made contiguous on the way back (the grouped kernel's
    backward takes no stride-0 gradient)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.contiguous()
