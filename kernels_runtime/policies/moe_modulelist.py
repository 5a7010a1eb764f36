"""Mixture-of-experts blocks built the older way: a router ``nn.Linear`` beside a list of experts.

Why a second reader: ``policies.moe`` reads transformers 5's blocks, whose experts are fused 3-D
tensors. Blocks written by hand, or by transformers 4 (Mixtral's ``gate`` and ``experts =
ModuleList([w1/w3/w2 MLP])``; Qwen2-MoE's ``gate_proj/up_proj/down_proj`` experts beside a gated
shared expert), keep one module per expert. The expert applier keeps those modules as they are,
each rank its E/ep of them (``parallel/expert/modulelist_layer.py``), so the parameters keep
their objects and names (the user's optimizer and ``state_dict`` / checkpoint names work).

What is read (``ModuleListReading``), else ``ModuleListError`` says what was expected:

- a router: a child ``nn.Linear(h, E)`` (its logits (t, E) are the block's router logits);
- the experts: a child ``nn.ModuleList`` of E modules of one class, each a gated MLP of exactly
  three bias-free ``nn.Linear``, two h -> I (gate, up) and one I -> h (down), named
  gate_proj/up_proj/down_proj, w1/w3/w2 or told apart by shape;
- optionally a shared expert (``shared_expert``, any module) scaled by the sigmoid of
  ``shared_expert_gate`` (h -> 1), added to every token as Qwen2-MoE does;
- the top-k from the block's (or router's) ``top_k`` / ``num_experts_per_tok`` attribute, and
  routing as Mixtral and Qwen-MoE route: softmax over the E logits in float32, the top k,
  renormalized to sum to 1 unless ``norm_topk_prob`` is False.

The reading is confirmed, not assumed: the block runs once on a small probe (eval mode, no
grad, its own generator, so the global RNG is untouched) and must give what ``read_forward``
(the reading, in one process) gives; the probe also tells whether the block returns its router
logits beside the hidden states (transformers 4's blocks do) and, where no ``norm_topk_prob``
says, whether the top-k weights are renormalized. ``MODULE_LIST_BLOCKS`` names parts by class
for a block whose names differ; the readings apply to any class not listed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

EXPECTS = ("a router nn.Linear(h, E) and an nn.ModuleList of E experts of one class, each a "
           "gated MLP of exactly three bias-free nn.Linear (two h -> I: gate and up, one "
           "I -> h: down; e.g. gate_proj/up_proj/down_proj or w1/w3/w2), optionally a "
           "shared_expert scaled by sigmoid(shared_expert_gate); the top-k in an attribute "
           "top_k or num_experts_per_tok; routing by softmax then top-k (renormalized unless "
           "norm_topk_prob=False); the block returning its hidden states, or (hidden states, "
           "router logits)")
LINEAR_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))  # gate, up, down
TOP_K_ATTRS = ("top_k", "num_experts_per_tok")


class ModuleListError(ValueError):
    """A block that looks like a module-list MoE block but cannot be read as one."""


@dataclass(frozen=True)
class ModuleListSpec:
    """Where a block class keeps its parts, when the generic names do not fit."""

    router: str = "gate"
    experts: str = "experts"
    shared_expert: str = "shared_expert"
    shared_gate: str = "shared_expert_gate"
    top_k: int | None = None  # None: the block's top_k / num_experts_per_tok attribute


# transformers 4's classes: the generic names (listed as the families this reader is for)
MODULE_LIST_BLOCKS: dict[str, ModuleListSpec] = {
    "MixtralSparseMoeBlock": ModuleListSpec(),
    "Qwen2MoeSparseMoeBlock": ModuleListSpec(),
}


@dataclass(frozen=True)
class ModuleListReading:
    """One module-list MoE block as the expert layer uses it."""

    router: str  # attribute names in the block
    experts: str
    num_experts: int  # E
    hidden: int  # h
    inter: int  # I
    top_k: int
    normalize: bool  # top-k weights renormalized to sum to 1
    linears: tuple[str, str, str]  # gate, up, down: names inside each expert
    shared_expert: str | None
    shared_gate: str | None
    returns_logits: bool  # the block returns (hidden states, router logits (t, E))


def route_topk(logits: Tensor, top_k: int, normalize: bool) -> tuple[Tensor, Tensor]:
    """Routing weights (t, k) float32 and expert ids (t, k) from router logits (t, E)."""
    probs = torch.softmax(logits.float(), dim=-1)  # (t, E)
    weights, experts = torch.topk(probs, top_k, dim=-1)  # (t, k)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def read_forward(block: nn.Module, reading: ModuleListReading,
                 hidden_states: Tensor) -> tuple[Tensor, Tensor]:
    """What the reading says ``block`` computes, in one process: (output (.., h), logits (t, E))."""
    flat = hidden_states.reshape(-1, reading.hidden)  # (t, h)
    logits = getattr(block, reading.router)(flat)  # (t, E)
    weights, chosen = route_topk(logits, reading.top_k, reading.normalize)  # (t, k) each
    out = torch.zeros_like(flat)  # (t, h)
    for index, expert in enumerate(getattr(block, reading.experts)):
        token, slot = torch.where(chosen == index)  # (m,), (m,)
        y = expert(flat[token]) * weights[token, slot, None]  # (m, h)
        out = out.index_add(0, token, y.to(out.dtype))
    if reading.shared_expert is not None:
        shared = getattr(block, reading.shared_expert)(flat)  # (t, h)
        if reading.shared_gate is not None:
            shared = torch.sigmoid(getattr(block, reading.shared_gate)(flat)) * shared
        out = out + shared
    return out.reshape(hidden_states.shape), logits


def _candidate(module: nn.Module, spec: ModuleListSpec | None) -> tuple[str, str] | None:
    """(router, experts) attribute names of a block that looks like a module-list MoE block: a
    child ModuleList of at least two modules beside a child Linear with one output per module."""
    children = dict(module.named_children())
    if spec is not None:
        names = [(spec.router, spec.experts)]
    else:
        names = [(r, e) for e, lst in children.items() if isinstance(lst, nn.ModuleList)
                 and len(lst) >= 2 for r, lin in children.items()
                 if isinstance(lin, nn.Linear) and lin.out_features == len(lst)]
    for router, experts in names:
        lst, lin = children.get(experts), children.get(router)
        if isinstance(lst, nn.ModuleList) and isinstance(lin, nn.Linear) \
                and lin.out_features == len(lst) >= 2:
            return router, experts
    return None


def _expert_linears(expert: nn.Module, hidden: int) -> tuple[tuple[str, str, str], int] | str:
    """(gate, up, down) names and I of one expert, or what is wrong with it."""
    linears = {n: m for n, m in expert.named_modules() if isinstance(m, nn.Linear)}
    weights = {f"{n}.weight" for n in linears}
    params = {n for n, _ in expert.named_parameters()}
    if len(linears) != 3 or params != weights:
        extra = sorted(params - weights)
        return (f"its experts hold {len(linears)} nn.Linear and parameters {extra or 'none'} "
                "besides their weights (biases or other parts)")
    for names in LINEAR_NAMES:
        if set(names) == set(linears):
            order = names
            break
    else:  # told apart by shape: the one I -> h is down, the others in registration order
        down = [n for n, m in linears.items() if m.out_features == hidden != m.in_features]
        if len(down) != 1:
            return (f"its experts' linears {sorted(linears)} have no single I -> h down "
                    "projection (name them gate_proj/up_proj/down_proj or w1/w3/w2)")
        gate, up = (n for n in linears if n != down[0])
        order = (gate, up, down[0])
    gate, up, down = (linears[n] for n in order)
    inter = down.in_features
    if not (gate.in_features == up.in_features == down.out_features == hidden
            and gate.out_features == up.out_features == inter):
        shapes = {n: (m.in_features, m.out_features) for n, m in linears.items()}
        return f"its experts' linears (in, out) {shapes} are not h -> I, h -> I, I -> h"
    return order, inter


def _top_k(block: nn.Module, router: nn.Module, spec: ModuleListSpec | None) -> int | None:
    if spec is not None and spec.top_k is not None:
        return spec.top_k
    for owner in (block, router):
        for attr in TOP_K_ATTRS:
            value = getattr(owner, attr, None)
            if isinstance(value, int):
                return value
    return None


def read_modulelist_block(block: nn.Module) -> ModuleListReading | None:
    """The reading of ``block``, None when it is no module-list MoE block at all; raises
    ``ModuleListError`` (saying what the reader expects) when it looks like one but is not."""
    spec = MODULE_LIST_BLOCKS.get(type(block).__name__)
    names = _candidate(block, spec)
    if names is None:
        return None
    router_name, experts_name = names
    router, experts = getattr(block, router_name), getattr(block, experts_name)
    hidden, count = router.in_features, router.out_features

    def refuse(problem: str) -> ModuleListError:
        return ModuleListError(
            f"{type(block).__name__} looks like a mixture-of-experts block (router "
            f"{router_name}: nn.Linear({hidden}, {count}), {count} experts in {experts_name}) "
            f"but {problem}. The module-list expert reader expects {EXPECTS}")

    if len({type(e) for e in experts}) != 1:
        raise refuse(f"its experts are of classes {sorted({type(e).__name__ for e in experts})}")
    found = [_expert_linears(e, hidden) for e in experts]
    problem = next((f for f in found if isinstance(f, str)), None)
    if problem is not None:
        raise refuse(problem)
    if len(set(found)) != 1:
        raise refuse(f"its experts differ in shapes or linear names: {sorted(set(found))}")
    linears, inter = found[0]
    top_k = _top_k(block, router, spec)
    if top_k is None or not 0 < top_k <= count:
        raise refuse(f"its top-k ({top_k}) is not an int in [1, {count}] read from an attribute "
                     f"{' or '.join(TOP_K_ATTRS)}")
    spec = spec or ModuleListSpec(router=router_name, experts=experts_name)
    shared = spec.shared_expert if isinstance(getattr(block, spec.shared_expert, None),
                                              nn.Module) else None
    gate = spec.shared_gate if shared and isinstance(getattr(block, spec.shared_gate, None),
                                                     nn.Linear) else None
    known = {router_name, experts_name, shared, gate}
    other = [n for n, m in block.named_children() if n not in known
             and any(True for _ in m.parameters())]
    if other or any(True for _ in block.parameters(recurse=False)):
        raise refuse(f"it holds other parameterized parts ({other or 'its own parameters'}) "
                     "the reader does not know")
    norm = getattr(block, "norm_topk_prob", None)
    reading = ModuleListReading(router_name, experts_name, count, hidden, inter, top_k,
                                bool(norm) if norm is not None else True, linears, shared,
                                gate, returns_logits=False)
    return _confirm(block, reading, [reading.normalize] if norm is not None else [True, False],
                    refuse)


def _confirm(block: nn.Module, reading: ModuleListReading, normalizations: list[bool],
             refuse: Callable[[str], ModuleListError]) -> ModuleListReading:
    """The reading once the block's own output on a probe agrees with it (see module doc)."""
    weight = getattr(block, reading.router).weight
    probe = torch.randn(2, 4, reading.hidden, generator=torch.Generator().manual_seed(0),
                        dtype=torch.float64).to(weight.device, weight.dtype)  # (b, s, h)
    tol = 1e-4 if weight.dtype in (torch.float32, torch.float64) else 3e-2
    was_training = block.training
    block.eval()
    try:
        with torch.no_grad():
            try:
                got = block(probe)
            except Exception as error:  # noqa: BLE001 - reported as what the reader expects
                raise refuse(f"it fails on a (2, 4, {reading.hidden}) probe ({error!r})") \
                    from error
            returns_logits = isinstance(got, (tuple, list))
            out = got[0] if returns_logits else got
            if not isinstance(out, Tensor) or out.shape != probe.shape or (returns_logits and (
                    len(got) != 2 or tuple(got[1].shape) != (8, reading.num_experts))):
                raise refuse(f"it returns {type(got).__name__} of an unexpected shape")
            if returns_logits:  # what it returns beside the hidden states: the router's logits
                logits = getattr(block, reading.router)(probe.reshape(-1, reading.hidden))
                if not torch.allclose(got[1].to(logits.dtype), logits, rtol=tol, atol=tol):
                    raise refuse("the second value it returns is not its router's logits")
            errors = {}
            for normalize in normalizations:
                mine, _ = read_forward(block, _with(reading, normalize, returns_logits), probe)
                errors[normalize] = float((mine - out).norm() / max(float(out.norm()), 1e-12))
                if errors[normalize] <= tol:
                    return _with(reading, normalize, returns_logits)
    finally:
        block.train(was_training)
    tried = ", ".join(f"{'renormalized' if n else 'not renormalized'}: {e:.2g}"
                      for n, e in errors.items())
    raise refuse(f"its output on a probe differs from softmax/top-{reading.top_k} routing over "
                 f"its experts (relative error {tried})")


def _with(reading: ModuleListReading, normalize: bool, returns_logits: bool) -> ModuleListReading:
    return replace(reading, normalize=normalize, returns_logits=returns_logits)


def modulelist_blocks(model: nn.Module) -> list[tuple[str, nn.Module, ModuleListReading]]:
    """(path, block, reading) of every module-list MoE block of ``model``, outermost first."""
    found: list[tuple[str, nn.Module, ModuleListReading]] = []
    for path, module in model.named_modules():
        if any(path.startswith(f"{outer}.") for outer, _, _ in found):
            continue
        reading = read_modulelist_block(module)
        if reading is not None:
            found.append((path, module, reading))
    return found
