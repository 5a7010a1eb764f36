"""``load_pretrained``: a Hugging Face ``save_pretrained`` folder straight into a parallel
model, each rank reading and holding only the pieces its plan gives it.

Why not ``from_pretrained`` and then ``parallelize``: that holds a whole copy of the weights on
every rank before the plan cuts it, 4 copies on a 4-rank host. Here the model is built from its
config under ``deferred_parameters`` (parameters on the meta device; buffers such as rotary
frequencies real, computed as the model computes them), marked ``to_be_loaded``, and the
plan's appliers lay it out on meta: tensor-parallel shards, pipeline stages, FSDP shards. They
give storage (zeros, no initialization, no broadcast) only to what this rank holds, and every
box the rank holds (``StatePiece``) is then read from the safetensors files, sliced, so the
rank reads only its bytes. A file is opened (memory-mapped) for one tensor at a time: its pages
stay in the host's page cache, shared by all ranks, but are mapped into a rank only while
that tensor is read, so a rank's resident memory is its share plus one box.

Names are the model's; a tied alias the file lacks (``lm_head.weight`` under
``tie_word_embeddings``) is read under the name the file has, and fused experts the files hold
one tensor per expert (what ``save_pretrained`` writes for Mixtral and Qwen-MoE) are read box
by box from those (``hf_experts.py``): under ep a rank reads its own experts' tensors.
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from kernels_runtime.api import parallelize, parallelize_model
from kernels_runtime.checkpoint.agreement import agree, attempt
from kernels_runtime.checkpoint.format import CheckpointError
from kernels_runtime.checkpoint.hf_experts import FusedExperts, per_expert_sources
from kernels_runtime.comm import Collectives
from kernels_runtime.deferred_params import deferred_parameters, mark_to_be_loaded
from kernels_runtime.mesh.context import ParallelContext
from kernels_runtime.mesh.plan import Plan
from kernels_runtime.optim import PARAM, BoostedOptimizer, StatePiece
from kernels_runtime.parallel.state import parallel_state

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
SLAB_BYTES = 16 * 2**20  # the most of a file mapped into a rank at once


def load_pretrained(
    folder: str | os.PathLike,
    plan: Plan | str | None = None,
    *,
    ctx: ParallelContext | None = None,
    comm: Collectives | None = None,
    dtype: torch.dtype | str | None = None,
    model_class: type | None = None,
    **parallelize_args: Any,
) -> nn.Module:
    """The model of ``folder`` parallelized under ``plan`` (as ``parallelize_model``), each
    rank holding and reading only its pieces; in eval mode, as ``from_pretrained`` returns it.
    Collective. ``dtype``: the parameters' dtype before the plan's precision applies (default
    ``"auto"``: the config's ``dtype``, else the files'); ``model_class``: a
    ``PreTrainedModel`` class for a config ``AutoModelForCausalLM`` does not know."""
    files = weight_files(folder)
    model, aliases = _build_on_meta(Path(folder), files, dtype, model_class)
    model = parallelize_model(model, plan, ctx=ctx, comm=comm, **parallelize_args)
    fill(model, files, aliases)
    return model.eval()


def load_pretrained_for_training(
    folder: str | os.PathLike,
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    plan: Plan | str | None = None,
    *,
    ctx: ParallelContext | None = None,
    comm: Collectives | None = None,
    dtype: torch.dtype | str | None = None,
    model_class: type | None = None,
    **parallelize_args: Any,
) -> tuple[nn.Module, BoostedOptimizer]:
    """``load_pretrained`` for training, as ``parallelize``: ``make_optimizer(params)`` builds
    the optimizer over the (still meta) parameters, e.g. ``lambda ps: AdamW(ps, lr=1e-4)``."""
    files = weight_files(folder)
    model, aliases = _build_on_meta(Path(folder), files, dtype, model_class)
    model, optimizer = parallelize(model, make_optimizer(model.parameters()), plan, ctx=ctx,
                                   comm=comm, **parallelize_args)
    fill(model, files, aliases)
    return model.train(), optimizer


def weight_files(folder: str | os.PathLike) -> dict[str, Path]:
    """{tensor name: the safetensors file holding it} of a ``save_pretrained`` folder."""
    root = Path(folder)
    if not (root / "config.json").is_file():
        raise CheckpointError(f"{root} has no config.json: give the folder written by "
                              "save_pretrained")
    if (root / INDEX).is_file():
        index = json.loads((root / INDEX).read_text())["weight_map"]
        return {name: root / file for name, file in index.items()}
    if (root / SINGLE).is_file():
        with safe_open(str(root / SINGLE), "pt") as f:
            return {name: root / SINGLE for name in f.keys()}  # noqa: SIM118
    others = sorted(p.name for p in root.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
    raise CheckpointError(
        f"{root} has no {SINGLE} or {INDEX}" + (f" (it has {', '.join(others)})" if others
                                                else "") + ": only safetensors can be read "
        "piece by piece; re-save it once with model.save_pretrained(folder, "
        "safe_serialization=True)")


def _build_on_meta(root: Path, files: dict[str, Path], dtype: torch.dtype | str | None,
                   model_class: type | None) -> tuple[nn.Module, dict[str, str]]:
    """The model from its config, parameters on meta; and {model name: file name} of every
    tied alias whose tensor the file holds under another name."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(root)
    dtype = _dtype(dtype, config, files)
    with deferred_parameters():
        if model_class is not None:
            model = model_class._from_config(config, dtype=dtype)
        else:
            try:
                model = AutoModelForCausalLM.from_config(config, dtype=dtype)
            except ValueError as err:
                raise CheckpointError(
                    f"{root}: AutoModelForCausalLM does not know the config "
                    f"{type(config).__name__} (model_type {config.model_type!r}): pass "
                    f"model_class= (the PreTrainedModel class to build) ({err})") from err
    mark_to_be_loaded(model)
    by_tensor: dict[int, list[str]] = defaultdict(list)
    for name, p in model.named_parameters(remove_duplicate=False):
        by_tensor[id(p)].append(name)
    aliases = {}
    for names in by_tensor.values():
        stored = [n for n in names if n in files]
        for n in names:
            if n not in files and stored:
                aliases[n] = stored[0]
    return model, aliases


def _dtype(dtype: torch.dtype | str | None, config: Any,
           files: dict[str, Path]) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in (None, "auto"):
        return getattr(torch, str(dtype))
    found = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if found is not None:
        return found if isinstance(found, torch.dtype) else getattr(torch, str(found))
    floats = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
              "BF16": torch.bfloat16}
    with safe_open(str(min(set(files.values()))), "pt") as f:
        for name in f.keys():  # noqa: SIM118  the first floating tensor's, as HF does
            found = floats.get(f.get_slice(name).get_dtype())
            if found is not None:
                return found
    return torch.float32


def fill(model: nn.Module, files: dict[str, Path], aliases: dict[str, str]) -> None:
    """Fill every piece this rank holds from ``files`` (collective: names and shapes are
    checked on every rank and agreed first), then let the layout propagate them."""
    state = parallel_state(model)
    assert state is not None and state.model_state is not None
    layout, ctx = state.model_state, state.ctx
    pieces = layout.pieces(saving=False, optimizer=None)
    fused, renamed = per_expert_sources({p.shard.name for p in pieces}, files)
    aliases = {**renamed, **aliases}
    by_tensor: dict[str, list[StatePiece]] = defaultdict(list)
    for piece in pieces:
        by_tensor[aliases.get(piece.shard.name, piece.shard.name)].append(piece)
    agree(ctx.comm, ctx.device, attempt(lambda: _check(by_tensor, files, fused)),
          f"checking {next(iter(files.values())).parent} against the model")
    with torch.no_grad():
        for name, held in by_tensor.items():
            for piece in held:
                if name in fused:  # experts fused in the model, one tensor each in the files
                    fused[name].read(piece.shard.offsets, piece.shard.sizes,
                                     piece.values[PARAM], _read)
                    continue
                _read(files[name], name, piece.shard.offsets, piece.shard.sizes,
                      piece.values[PARAM])
        _fill_buffers(model, files)
    layout.after_load()


def _read(file: Path, name: str, offsets: tuple[int, ...], sizes: tuple[int, ...],
          out: torch.Tensor) -> None:
    """``out[...] = file[name][box]`` for the box at ``offsets`` of ``sizes``, in slabs of
    rows of at most ``SLAB_BYTES``, each read through a mapping of its own: safetensors hands
    out views of the mapped file, whose touched pages count in this process until unmapped."""
    if not sizes:
        with safe_open(str(file), "pt") as f:
            out.copy_(f.get_slice(name)[()])
        return
    row = math.prod(sizes[1:]) * out.element_size()
    step = max(1, SLAB_BYTES // max(1, row))
    rest = tuple(slice(o, o + s) for o, s in zip(offsets[1:], sizes[1:]))
    for start in range(0, sizes[0], step):
        rows = slice(start, min(sizes[0], start + step))  # of the box; in the file: + offset
        with safe_open(str(file), "pt") as f:
            stored = f.get_slice(name)
            out[rows].copy_(stored[(slice(offsets[0] + rows.start, offsets[0] + rows.stop),
                                    *rest)])
            del stored


def _check(by_tensor: dict[str, list[StatePiece]], files: dict[str, Path],
           fused: dict[str, FusedExperts]) -> None:
    missing = sorted(n for n in by_tensor if n not in files and n not in fused)
    if missing:
        raise CheckpointError(f"the model has parameters the files lack: {', '.join(missing)}")
    wrong = []
    for name, held in by_tensor.items():
        if name in fused:
            shape = fused[name].shape
        else:
            with safe_open(str(files[name]), "pt") as f:
                shape = tuple(f.get_slice(name).get_shape())
        if shape != tuple(held[0].shard.shape):
            wrong.append(f"{name}: file {shape}, model {tuple(held[0].shard.shape)}")
    if wrong:
        raise CheckpointError("shape mismatch: " + "; ".join(wrong))


def _fill_buffers(model: nn.Module, files: dict[str, Path]) -> None:
    """Persistent buffers the files hold (rare: most are computed at construction)."""
    for name, buffer in model.named_buffers():
        if name in files:
            with safe_open(str(files[name]), "pt") as f:
                buffer.copy_(f.get_tensor(name))
