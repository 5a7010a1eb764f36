"""What a swapped module must keep: every attribute that changes its behaviour is carried over
by the tensor-parallel module replacing it, or the plan is refused before anything is swapped.

Why this file exists: a swap builds a new module from the old one's tensors, so whatever else
the old module held is silently lost unless the swap passes it on. Issue 24 was one such loss:
the 1D vocabulary-parallel embedding dropped ``nn.Embedding.padding_idx``, BERT's [PAD] row
learned, and the loss left the unsplit model's after one step while outputs still matched. The
tensor applier's ``check`` calls ``refusals`` for every module 1D (``tensor_parallel.py``) or
the grid (``grid_parallel.py``) will replace; the sequence-parallel appliers swap no module
(``PartialGradModule`` runs the module itself, ring/Ulysses swap attention functions).

Carried: an embedding's ``padding_idx`` (its row gets no gradient on the rank holding it), a
linear layer's bias, a LayerNorm's ``eps`` and bias, an RMSNorm's epsilon, a Conv2d's
constructor arguments. Refused, naming the module, attribute, value and a way out: an
embedding's ``max_norm`` (with its ``norm_type``), ``scale_grad_by_freq`` and ``sparse``; a
forward of its own (a subclass, a class neither ``nn.Linear`` nor transformers' ``Conv1D``, an
RMSNorm not computing LlamaRMSNorm's formula); hooks and parametrizations, which the new
module would not run; on the grid, norms over several dims or without ``eps``, and norms
without parameters (never rebuilt, they would normalize a hidden chunk).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn.utils import parametrize

from kernels_runtime.parallel.tensor.grid_parallel import rebuilt_kind, rms_norm_eps
from kernels_runtime.policies import ParamSpec

TP1 = "use tp=1 for this model"
GRID_1D = "use tp_mode=1d for this model"
HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def _name(path: str, module: nn.Module) -> str:
    return f"{path} ({type(module).__name__})"


def _carried_whole(path: str, module: nn.Module, base: type | None) -> list[str]:
    """What no replacement carries: hooks, parametrizations, and a forward other than
    ``base``'s (None: the caller vouches for the class)."""
    out = []
    hooks = [h.strip("_") for h in HOOKS if getattr(module, h, None)]
    if hooks:
        out.append(f"{_name(path, module)} has {', '.join(hooks)}: the tensor-parallel module "
                   f"replacing it would not run them; remove them before parallelize or {TP1}")
    if parametrize.is_parametrized(module):
        names = ", ".join(module.parametrizations.keys())
        out.append(f"{_name(path, module)} has parametrized {names}: the replacement would "
                   "train the computed tensor as a plain parameter; remove it with torch.nn."
                   f"utils.parametrize.remove_parametrizations or {TP1}")
    if base is not None and type(module).forward is not base.forward:
        out.append(f"{_name(path, module)} overrides {base.__name__}.forward: the "
                   f"tensor-parallel module replacing it would not run it; {TP1}")
    return out


def _embedding(path: str, module: nn.Embedding) -> list[str]:
    """``padding_idx`` is carried; these three are not."""
    out, name = [], _name(path, module)
    if module.max_norm is not None:
        out.append(f"{name} has max_norm={module.max_norm} (norm_type={module.norm_type}): "
                   "the split embedding does not renormalize the rows it looks up; "
                   f"{TP1} or set the embedding's max_norm to None")
    if module.scale_grad_by_freq:
        out.append(f"{name} has scale_grad_by_freq=True: the split embedding does not scale "
                   f"gradients by token frequency; {TP1} or set the embedding's "
                   "scale_grad_by_freq to False")
    if module.sparse:
        out.append(f"{name} has sparse=True: split parameters and their gradient sync need "
                   f"dense gradients; {TP1} or set the embedding's sparse to False")
    return out + _carried_whole(path, module, nn.Embedding)


def _is_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2): x W + b with W stored (in, out)."""
    cls = type(module)
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers.")


def _split(path: str, module: nn.Module, spec: ParamSpec) -> list[str]:
    """A module split over tp: a vocabulary-parallel embedding, else a linear layer."""
    if isinstance(module, nn.Embedding):
        if spec.style != "vocab":
            return [f"{_name(path, module)} has the policy style {spec.style!r}: an embedding "
                    "splits over its vocabulary only; give it Rule style 'vocab' or "
                    f"'replicated' in its policy, or {TP1}"]
        return _embedding(path, module)
    if _is_conv1d(module):
        return _carried_whole(path, module, None)
    if not isinstance(module, nn.Linear):
        return [f"{_name(path, module)} is neither nn.Linear nor transformers' Conv1D: the "
                "tensor-parallel layer computes x W^T + b instead of its forward; make its "
                f"policy leave it replicated, or {TP1}"]
    return _carried_whole(path, module, nn.Linear)  # bias: carried, present or not


def _rms_norm_formula(module: nn.Module, eps: float) -> bool:
    """Whether ``module`` computes LlamaRMSNorm's weight * x / rms(x), the grid's RMSNorm,
    probed on two rows (a norm of another formula, e.g. Gemma's (1 + weight) * x / rms(x),
    shares its class-name suffix). Deferred (meta) parameters cannot be probed: trusted."""
    weight = module.weight
    if weight.is_meta:
        return True
    x = torch.randn((2, weight.shape[-1]), generator=torch.Generator().manual_seed(0))
    x = x.to(weight)  # (2, h), the norm's device and dtype
    with torch.no_grad():
        xf = x.float()
        want = weight * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)
        try:
            got = module(x)
        except Exception:  # a forward that cannot take (2, h) rows is not this formula
            return False
    tol = 1e-5 if weight.element_size() >= 4 else 2e-2
    return isinstance(got, torch.Tensor) and torch.allclose(got.float(), want.float(),
                                                            rtol=tol, atol=tol)


def _grid_norm(path: str, module: nn.Module, kind: str) -> list[str]:
    name, out = _name(path, module), []
    shape = getattr(module, "normalized_shape", None)
    if shape is not None and len(tuple(shape)) != 1:
        out.append(f"{name} normalizes over normalized_shape={tuple(shape)}: the grid's norm "
                   f"covers the last dim only; {GRID_1D}")
    if kind == "layer_norm":
        return out + _carried_whole(path, module, nn.LayerNorm)
    eps = rms_norm_eps(module)
    if eps is None:
        out.append(f"{name} has eps=None (the input dtype's epsilon): the grid's RMSNorm "
                   f"needs a number; set its eps (e.g. 1e-6) or {GRID_1D}")
    elif not out and not _rms_norm_formula(module, eps):
        out.append(f"{name} does not compute LlamaRMSNorm's weight * x / rms(x) (e.g. "
                   f"Gemma's 1 + weight): the grid's RMSNorm would change it; {GRID_1D}")
    return out + _carried_whole(path, module, None)  # its forward: probed above


def _grid_rebuilt(path: str, module: nn.Module, kind: str) -> list[str]:
    """A replicated module the grid rebuilds on its hidden chunk (``rebuilt_kind``)."""
    if kind in ("layer_norm", "rms_norm"):
        return _grid_norm(path, module, kind)
    if kind == "embedding":
        return _embedding(path, module)
    if kind == "conv":
        return _carried_whole(path, module, nn.Conv2d)
    return []  # "own": the module itself runs, on its parameters cut in place


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or \
        type(module).__name__.endswith(("LayerNorm", "RMSNorm"))


def refusals(model: nn.Module, split: dict[str, dict[str, ParamSpec]],
             grid: tuple[list[str], Callable[[str], bool], int | None] | None = None,
             ) -> list[str]:
    """One message per attribute the planned swaps would drop (module docstring). ``split``:
    ``modules_to_split``; ``grid``: under 2D / 2.5D, the replicated paths it rebuilds, whether
    a path runs on hidden chunks, and the hidden size."""
    out = []
    for path, specs in sorted(split.items()):
        if "weight" in specs:
            out += _split(path, model.get_submodule(path), specs["weight"])
    if grid is None:
        return out
    rebuilt, on_chunks, hidden = grid
    for path in rebuilt:
        module = model.get_submodule(path)
        out += _grid_rebuilt(path, module, rebuilt_kind(module, hidden) or "")
    for path, module in model.named_modules():
        if _is_norm(module) and not any(True for _ in module.parameters()) and on_chunks(path):
            out.append(f"{_name(path, module)} has elementwise_affine=False: without "
                       "parameters the grid does not rebuild it, so it would normalize a "
                       f"hidden chunk; {GRID_1D}")
    return out
