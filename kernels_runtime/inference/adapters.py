"""Serving LoRA adapters: several peft adapters over one base model, mixed in one batch.

Why not peft's own layers: peft applies one active adapter to a whole forward, while a step of
the engine is one flat row of tokens from many requests (``batch.py``), each naming its own
adapter (or none). So the engine leaves the base weights alone and gives every targeted linear
of the parallelized model a forward of its own (``AdapterForward``, set on the instance, as
``parallel/tensor/lora.py`` does for training, so parameter names stay the model's). It adds
``s_a (x A_a^T) B_a^T`` to the rows of the tokens whose request names adapter ``a``; which rows
those are is set once per step by the runner (``AdapterSet.routing``: the adapter slot of each
token of the flat row; base rows get nothing added).

Adapters are peft's folders as ``save_pretrained`` writes them (``adapter_config.json`` and
``adapter_model.safetensors``); scaling ``lora_alpha / r`` (``/ sqrt(r)`` with
``use_rslora``), per module by ``alpha_pattern`` and by each factor's own rank. ``fan_in_fan_out``
changes how peft merges into a transposed (Conv1D) weight, not the factors: A is (r, in) and B
(out, r) either way. DoRA, factor biases and adapters on embeddings or heads are refused.

Under 1D tensor parallelism the factors split with the weight they ride on, as in training:
a column-parallel layer keeps A whole and takes B's rows of its output columns (the weight's
own layout says how many fused parts they come in); a row-parallel layer takes A's columns of
its input rows and adds ``(x_i A_i) B``, a partial sum, before the layer's one all-reduce. No
collective is added.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from os import PathLike
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from kernels_runtime.inference.requests import RequestError
from kernels_runtime.parallel.tensor.layers import (
    ColumnParallelLinear,
    ReplicatedHeadsLinear,
    RowParallelLinear,
    VocabParallelHead,
)
from kernels_runtime.parallel.tensor.sharding import split_dim

PREFIX = "base_model.model."
BASE = -1  # the adapter slot of a request that names none


class AdapterError(ValueError):
    """An adapter folder the engine cannot serve; the message says why and what to do."""


def _config(folder: Path, name: str) -> dict[str, Any]:
    path = folder / "adapter_config.json"
    if not path.exists() or not (folder / "adapter_model.safetensors").exists():
        raise AdapterError(f"adapter {name!r}: {folder} is not a peft adapter folder (it needs "
                           "adapter_config.json and adapter_model.safetensors, as "
                           "PeftModel.save_pretrained writes them)")
    config = json.loads(path.read_text())
    if config.get("peft_type") != "LORA":
        raise AdapterError(f"adapter {name!r} is a {config.get('peft_type')} adapter; the "
                           "engine serves LoRA adapters only")
    for key, why in (("use_dora", "DoRA"), ("lora_bias", "factor biases (lora_bias)"),
                     ("modules_to_save", "modules_to_save (whole trained modules)")):
        if config.get(key):
            raise AdapterError(f"adapter {name!r} uses {why}, which the engine does not "
                               "serve; merge it into the model (merge_and_unload) and serve "
                               "the merged folder instead")
    return config


def _scaling(config: dict[str, Any], module: str, rank: int) -> float:
    """peft's scaling of ``module``: its alpha (``alpha_pattern`` first) over its rank."""
    alpha = config.get("lora_alpha", 8)
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            alpha = value
            break
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def read_adapter(folder: str | PathLike, name: str) -> dict[str, tuple[Tensor, Tensor, float]]:
    """{module path: (A (r, in), B (out, r), scaling)} of the peft adapter in ``folder``."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = _config(folder, name)
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    factors: dict[str, dict[str, Tensor]] = {}
    for key, tensor in tensors.items():
        match = re.fullmatch(r"(.+)\.lora_([AB])\.weight", key.removeprefix(PREFIX))
        if match is None:
            raise AdapterError(f"adapter {name!r} holds {key!r}, which is not a LoRA factor of "
                               "a linear layer (embedding adapters and extra weights are not "
                               "served); merge it into the model instead")
        factors.setdefault(match[1], {})[match[2]] = tensor
    out = {}
    for module, pair in factors.items():
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"adapter {name!r}: {module} has lora_{set(pair).pop()} only")
        a, b = pair["A"], pair["B"]  # (r, in), (out, r)
        out[module] = (a, b, _scaling(config, module, int(a.shape[0])))
    if not out:
        raise AdapterError(f"adapter {name!r} in {folder} holds no LoRA factors")
    return out


class AdapterForward:
    """A targeted linear's forward: the layer's own, plus each adapter's term on its rows. A
    class holding the layer (not a closure) as ``SplitLoraForward`` is."""

    def __init__(self, layer: nn.Module, router: AdapterSet) -> None:
        self.layer, self.router = layer, router
        self.factors: dict[int, tuple[Tensor, Tensor, float]] = {}  # slot -> local A, B, s

    def __call__(self, x: Tensor) -> Tensor:
        layer, groups = self.layer, self.router.groups
        if isinstance(layer, RowParallelLinear):
            partial = layer.project(x)  # (b, s, out), this rank's share; x is (b, s, in/tp)
            return layer.reduce(self._add(x, partial, groups))  # (b, s, out)
        return self._add(x, type(layer).forward(layer, x), groups)  # (b, s, out[/tp])

    def _add(self, x: Tensor, y: Tensor, groups: list[tuple[int, Tensor]]) -> Tensor:
        mine = [(self.factors[slot], rows) for slot, rows in groups if slot in self.factors]
        if not mine:
            return y
        flat_x = x.reshape(-1, x.shape[-1])  # (T, in[/tp])
        flat_y = y.reshape(-1, y.shape[-1])  # (T, out[/tp])
        for (a, b, s), rows in mine:
            h = flat_x.index_select(0, rows).to(a.dtype) @ a.t()  # (n, r), partial under row
            flat_y = flat_y.index_add(0, rows, ((h @ b.t()) * s).to(flat_y.dtype))
        return flat_y.view(y.shape)


class AdapterSet:
    """The adapters an engine serves, by name, and the routing of the current step."""

    def __init__(self, model: nn.Module, state: Any,
                 adapters: Mapping[str, str | PathLike] | None) -> None:
        if adapters is not None and not isinstance(adapters, Mapping):
            raise AdapterError(f"adapters is a dict {{name: peft adapter folder}}, got "
                               f"{type(adapters).__name__}")
        self.names: list[str] = list(adapters or {})
        self.groups: list[tuple[int, Tensor]] = []  # this step: (slot, its rows of the flat row)
        if not self.names:
            return
        _check_plan(state.ctx.plan)
        for name in self.names:
            if not isinstance(name, str) or not name:
                raise AdapterError(f"adapter names are non-empty strings, got {name!r}")
        ctx = state.ctx
        tp, rank = ctx.size("tp"), ctx.coord("tp")
        forwards: dict[str, AdapterForward] = {}
        for slot, name in enumerate(self.names):
            for path, (a, b, s) in read_adapter(adapters[name], name).items():
                layer = _find(model, path, name, state)
                if layer is None:  # on another pipeline stage
                    continue
                if path not in forwards:
                    forwards[path] = AdapterForward(layer, self)
                a, b = _split(layer, path, a, b, state, rank, tp, name)
                dtype, device = layer.weight.dtype, ctx.device
                forwards[path].factors[slot] = (a.to(device, dtype), b.to(device, dtype), s)
        for path, forward in forwards.items():
            model.get_submodule(path).forward = forward

    def slot(self, name: str | None) -> int:
        """The slot of adapter ``name`` (``BASE`` for None); an unknown name is the request's
        error, naming the known ones."""
        if name is None:
            return BASE
        if name not in self.names:
            known = ", ".join(repr(n) for n in self.names) or "none"
            raise RequestError(f"unknown adapter {name!r}: this engine serves {known} (and "
                               "the base model, adapter=None)")
        return self.names.index(name)

    @contextmanager
    def routing(self, token_slots: Tensor | None) -> Iterator[None]:
        """Within the block, layers add adapter ``a``'s term to the rows whose slot is ``a``
        (``token_slots``: (T,), one slot per token of the step's flat row)."""
        if token_slots is None or not self.names:
            yield
            return
        present = sorted(set(token_slots.tolist()) - {BASE})
        self.groups = [(a, (token_slots == a).nonzero().flatten()) for a in present]
        try:
            yield
        finally:
            self.groups = []


def _check_plan(plan: Any) -> None:
    if plan.offload != "none" or plan.zero_stage == 3:
        raise AdapterError("LoRA adapters are served from whole or tensor-parallel weights; "
                           "offload and zero=3 gather weights unit by unit, which the adapter "
                           "layers do not follow: use tp, pp or dp replicas")


def _find(model: nn.Module, path: str, name: str, state: Any) -> nn.Module | None:
    if f"{path}.weight" in state.elsewhere:
        return None
    try:
        layer = model.get_submodule(path)
    except AttributeError:
        raise AdapterError(f"adapter {name!r} targets {path}, which this model does not have "
                           "(an adapter trained for another model?)") from None
    if isinstance(layer, (ReplicatedHeadsLinear, VocabParallelHead)) or not isinstance(
            getattr(layer, "weight", None), Tensor):
        raise AdapterError(f"adapter {name!r} targets {path}, a {type(layer).__name__}, which "
                           "the engine does not serve adapters on (key/value heads replicated "
                           "over tp, vocabulary-parallel heads): choose a tp dividing the "
                           "key/value heads, or leave it out of target_modules")
    return layer


def _split(layer: nn.Module, path: str, a: Tensor, b: Tensor, state: Any, rank: int, tp: int,
           name: str) -> tuple[Tensor, Tensor]:
    """This rank's (A, B) for ``layer``: whole, or split as its weight is (module docstring)."""
    try:
        if isinstance(layer, ColumnParallelLinear):
            layout = state.layouts.get(f"{path}.weight")
            parts = len(layout.blocks) if layout is not None else 1
            return a, split_dim(b, 0, rank, tp, parts)[0]  # (r, in), (out/tp, r)
        if isinstance(layer, RowParallelLinear):
            return split_dim(a, 1, rank, tp)[0], b  # (r, in/tp), (out, r)
    except ValueError as err:
        raise AdapterError(f"adapter {name!r} on {path}: {err}") from None
    return a, b
