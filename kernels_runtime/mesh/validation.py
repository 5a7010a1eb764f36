"""Every rule a plan must satisfy, each failing with the field name and a fix.

Kept apart from ``plan.py`` so the rules read as one list. Checks that need the model (heads
divisible by tp, layers by pp) run only when a model config is given; the config may be an HF
config object or a dict with the usual names.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from kernels_runtime.byte_sizes import format_bytes
from kernels_runtime.mesh.plan_fields import (
    FRACTION_FIELDS,
    OFFLOADS,
    PP_SCHEDULES,
    PRECISIONS,
    SIZE_FIELDS,
    SP_MODES,
    TP_MODES,
    PlanError,
)

if TYPE_CHECKING:  # annotations only: plan.py calls into this module
    from kernels_runtime.mesh.plan import Plan


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise PlanError(f"{name}={value!r} is not supported; choose one of: {', '.join(allowed)}")


def _positive(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise PlanError(f"{name}={value} must be at least 1")


def _config_value(config: Any, *names: str) -> int | None:
    for n in names:
        v = config.get(n) if isinstance(config, dict) else getattr(config, n, None)
        if v is not None:
            return int(v)
    return None


def _check_offload(plan: Plan) -> None:
    """Budgets and fractions belong to an offloading plan, which keeps gradient and optimizer
    shards in chunks (zero 2 or 3; at dp=1 too: one rank offloading to its host)."""
    fractions = {n: getattr(plan, n) for n in FRACTION_FIELDS}
    for name, value in fractions.items():
        if not 0.0 <= value <= 1.0:
            raise PlanError(f"{name}={value:g} is the share of that state kept off the device: "
                            f"give a number from 0 to 1 (e.g. {name}=0.5)")
        if value > 0 and plan.offload != "static":
            raise PlanError(f"{name}={value:g} needs offload=static (or leave the placement to "
                            "offload=auto with device_mem=...)")
    if plan.offload == "static" and not any(fractions.values()):
        raise PlanError("offload=static with nothing to offload: set offload_params, "
                        "offload_grads and/or offload_optim (0 to 1)")
    for name in SIZE_FIELDS:
        value = getattr(plan, name)
        if value is not None and plan.offload == "none":
            raise PlanError(f"{name}={format_bytes(value)} is a budget for offload=auto or "
                            "static; add offload=auto")
    if plan.device_mem is not None and plan.device_mem <= 0:
        raise PlanError(f"device_mem={plan.device_mem}: the device must hold at least the chunk "
                        "being computed; give a size such as device_mem=256MiB")
    if plan.host_mem is not None and plan.host_mem < 0:
        raise PlanError(f"host_mem={plan.host_mem} is negative: give a size such as "
                        "host_mem=1GiB, or host_mem=0 to send everything off the device to disk")
    if plan.offload == "none":
        return
    # pp first: a pipeline refuses zero=2/3 too, so "use zero=2" would only lead to another error
    if plan.pp > 1:
        raise PlanError(f"offload with pipeline parallelism (pp={plan.pp}) is not available "
                        "yet: use pp=1 or offload=none")
    if plan.zero_stage not in (2, 3):
        raise PlanError(f"offload={plan.offload} with zero={plan.zero_stage}: offload keeps each "
                        "rank's gradient and optimizer shards in chunks: use zero=2 or zero=3")


def check_plan(plan: Plan, world_size: int, model_config: Any = None) -> Plan:
    if world_size < 1:
        raise PlanError(f"world_size={world_size}: start a pool with at least one rank")
    for name in ("dp", "tp", "pp", "sp", "ep", "tp_depth", "microbatches", "pp_chunks"):
        _positive(name, getattr(plan, name))
    _choice("tp_mode", plan.tp_mode, TP_MODES)
    _choice("sp_mode", plan.sp_mode, SP_MODES)
    _choice("precision", plan.precision, PRECISIONS)
    _choice("pp_schedule", plan.pp_schedule, PP_SCHEDULES)
    _choice("offload", plan.offload, OFFLOADS)
    if plan.zero_stage not in (0, 1, 2, 3):
        raise PlanError(f"zero={plan.zero_stage}: ZeRO stages are 0 (DDP), 1, 2 or 3")

    model_ranks = plan.tp * plan.pp * plan.sp
    auto_dp = plan.dp is None  # the pool's size is given and dp takes what is left
    if auto_dp:
        if world_size % model_ranks:
            raise PlanError(
                f"tp*pp*sp = {model_ranks} does not divide the {world_size} ranks of the pool; "
                f"choose degrees whose product divides {world_size}"
            )
        plan = replace(plan, dp=world_size // model_ranks)
    assert plan.dp is not None
    if plan.dp * model_ranks != world_size:
        raise PlanError(
            f"dp*tp*pp*sp = {plan.dp}*{plan.tp}*{plan.pp}*{plan.sp} = {plan.dp * model_ranks} but "
            f"the pool has {world_size} ranks; make the product {world_size}, or write dp=auto"
        )
    _check_tensor_mode(plan)
    _check_experts(plan)
    _check_offload(plan)
    if plan.zero_stage and plan.dp * plan.sp == 1 and plan.offload == "none":
        raise PlanError(
            f"zero={plan.zero_stage} shards model states over data-parallel ranks, but dp=1; "
            "use zero=0 or raise dp"
        )
    if plan.zero_stage >= 2 and plan.pp > 1:
        raise PlanError(
            f"zero={plan.zero_stage} with pp={plan.pp}: a pipeline keeps every micro-batch's "
            "gradients until the stage's last backward, so ZeRO-2 would reduce-scatter once per "
            "micro-batch and ZeRO-3 gather every weight once per micro-batch forward and "
            "backward, m times the traffic of zero=1 for no memory a stage needs; use zero=0 "
            "or zero=1 with pipeline parallelism"
        )
    if plan.pp > 1:
        _check_pipeline(plan)
    _check_sequence_mode(plan)
    if model_config is not None:
        _check_model(plan, model_config, world_size if auto_dp else None)
    return plan


def _check_experts(plan: Plan) -> None:
    """ep groups are carved out of the data-parallel ranks (as Megatron's and ColossalAI's
    expert parallelism): the dp ranks of one (pp, sp, tp) position form dp/ep groups of ep
    adjacent ranks, each splitting the experts; ranks holding the same experts form the
    expert-data-parallel group (dp/ep ranks) over which those experts' gradients are reduced."""
    if plan.ep == 1:
        return
    assert plan.dp is not None
    if plan.dp % plan.ep:
        fits = [e for e in range(1, plan.dp + 1) if plan.dp % e == 0]
        raise PlanError(
            f"ep={plan.ep} does not divide dp={plan.dp}: expert-parallel groups are made of "
            f"data-parallel ranks (world = dp*pp*sp*tp, ep dividing dp); choose ep in {fits}, "
            f"or make dp a multiple of {plan.ep} (e.g. dp={(plan.dp // plan.ep + 1) * plan.ep})")
    if plan.sp > 1:
        raise PlanError(f"ep={plan.ep} with sp={plan.sp} is not available yet: expert groups "
                        "are carved out of dp alone; use sp=1 (or ep=1)")
    works = (f"ep={plan.ep} composes with dp, zero 0-3, tp (1d), pp (any schedule), ckpt and "
             "offload (static or auto)")
    if plan.sp_mode != "none":
        raise PlanError(f"ep={plan.ep} with sp_mode={plan.sp_mode} is not available yet: the "
                        "experts of a tp group expect the same tokens on every tp rank, and "
                        f"sequence parallelism splits them; {works}: remove sp_mode (e.g. "
                        f"'ep={plan.ep} tp={plan.tp}')")
    if plan.tp_mode != "1d":
        raise PlanError(f"ep={plan.ep} with tp_mode={plan.tp_mode} is not available yet: the "
                        f"experts split over a 1D tp group only; {works}: use tp_mode=1d "
                        f"(e.g. 'ep={plan.ep} tp={plan.tp}')")


def pipeline_chunks(plan: Plan) -> int:
    """Model chunks per pipeline rank: V under interleaved, 2 under zbv (its V shape), else 1."""
    if plan.pp_schedule == "zbv":
        return 2
    return plan.pp_chunks if plan.pp_schedule == "interleaved" else 1


def _check_pipeline(plan: Plan) -> None:
    schedule, chunks, m, p = plan.pp_schedule, plan.pp_chunks, plan.microbatches, plan.pp
    if schedule == "interleaved" and chunks < 2:
        raise PlanError(f"pp_schedule=interleaved runs V >= 2 model chunks per rank; add "
                        f"pp_chunks=2 (got pp_chunks={chunks})")
    if schedule == "zbv" and chunks not in (1, 2):
        raise PlanError(f"pp_schedule=zbv places exactly 2 chunks per rank (its V shape); "
                        f"remove pp_chunks={chunks}")
    if schedule in ("gpipe", "1f1b") and chunks != 1:
        raise PlanError(f"pp_chunks={chunks} is for pp_schedule=interleaved; add it or "
                        "remove pp_chunks")
    if m < p:
        raise PlanError(f"microbatches={m} with pp={p}: the pipeline would idle; use at least "
                        f"microbatches={p} (4*pp keeps the 1F1B bubble under 20%)")
    if schedule == "interleaved" and m % p:
        raise PlanError(f"pp_schedule=interleaved runs micro-batches in rounds of pp={p}; "
                        f"use microbatches a multiple of {p} (got {m}), e.g. "
                        f"microbatches={(m // p + 1) * p}")


def _check_sequence_mode(plan: Plan) -> None:
    """split_gather lives inside the tp group (sp stays 1); all_to_all and ring use sp."""
    mode = plan.sp_mode
    if mode == "split_gather":
        if plan.tp == 1:
            raise PlanError("sp_mode=split_gather shards activations along the tensor-parallel "
                            "axis; set tp>1 (e.g. tp=2 sp_mode=split_gather), or split the "
                            "sequence over sp with sp_mode=all_to_all or ring")
        if plan.sp > 1:
            raise PlanError(f"sp_mode=split_gather runs inside the tp group, so sp stays 1 (got "
                            f"sp={plan.sp}); remove sp, or choose sp_mode=all_to_all or ring")
        if plan.tp_mode != "1d":
            raise PlanError(f"sp_mode=split_gather is Megatron sequence parallelism for "
                            f"tp_mode=1d (got tp_mode={plan.tp_mode})")
    elif mode in ("all_to_all", "ring") and plan.sp == 1:
        raise PlanError(f"sp_mode={mode} splits the sequence over the sp axis, but sp=1; set "
                        f"sp>1 (e.g. sp=2 sp_mode={mode}) or remove sp_mode")
    elif mode == "none" and plan.sp > 1:
        raise PlanError(f"sp={plan.sp} splits the sequence, so attention must see the other "
                        "ranks' tokens: add sp_mode=all_to_all (Ulysses, heads divided by sp) "
                        "or sp_mode=ring (ring attention, K/V passed around the sp ranks)")


def _check_tensor_mode(plan: Plan) -> None:
    if plan.tp_mode == "1d":
        if plan.tp_depth != 1:
            raise PlanError("tp_depth is only for tp_mode=2.5d; remove it or set tp_mode=2.5d")
        return
    depth = plan.tp_depth if plan.tp_mode == "2.5d" else 1
    if plan.tp_mode == "2d" and plan.tp_depth != 1:
        raise PlanError("tp_depth is only for tp_mode=2.5d; remove it or set tp_mode=2.5d")
    if plan.tp % depth:
        raise PlanError(f"tp={plan.tp} is not divisible by tp_depth={depth} for tp_mode=2.5d")
    q = round((plan.tp // depth) ** 0.5)
    if q * q * depth != plan.tp or q < 2:
        shape = "q*q" if depth == 1 else f"q*q*{depth}"
        raise PlanError(
            f"tp_mode={plan.tp_mode} needs tp = {shape} with q >= 2 (e.g. tp={4 * depth}); "
            f"got tp={plan.tp}"
        )


def _check_grid_model(plan: Plan, heads: int | None, kv_heads: int | None,
                      hidden: int | None) -> None:
    """2D/2.5D split the hidden size and the heads over the q columns of the grid."""
    depth = plan.tp_depth if plan.tp_mode == "2.5d" else 1
    q = round((plan.tp // depth) ** 0.5)
    for what, value in (("hidden size", hidden), ("attention heads", heads),
                        ("key/value heads", kv_heads)):
        if value is not None and value % q:
            raise PlanError(
                f"tp_mode={plan.tp_mode} with tp={plan.tp} splits the model's {value} {what} "
                f"over the q={q} columns of its grid, but {value} is not divisible by {q}; "
                f"choose a grid whose side divides {value}, or tp_mode=1d")


def tp_values(heads: int | None, kv_heads: int | None) -> list[int]:
    """The 1D tp degrees a model with these head counts splits into: tp divides the query heads,
    and it divides the key/value heads (each rank keeps its own) or is a multiple of them (each
    rank keeps the one it needs, whole: grouped heads are replicated when tp exceeds them)."""
    top = heads or kv_heads or 1
    return [t for t in range(1, top + 1)
            if (heads is None or heads % t == 0)
            and (kv_heads is None or kv_heads % t == 0 or t % kv_heads == 0)]


def _tp_refusal(plan: Plan, heads: int | None, kv_heads: int | None, works: list[int],
                pool: int | None) -> str:
    """Why ``plan.tp`` cannot split the model, and the tp values that can: those that fit the
    pool when its size is fixed (``pool``: dp=auto takes what tp leaves), the others apart."""
    if heads is not None and heads % plan.tp:
        grouped = f" ({kv_heads} key/value heads)" if kv_heads not in (None, heads) else ""
        what = f"tp={plan.tp} does not divide the model's {heads} attention heads{grouped}"
    else:
        what = (f"tp={plan.tp} neither divides the model's {kv_heads} key/value heads nor is a "
                "multiple of them (each rank would need parts of two key/value heads)")
    fit = works if pool is None else [t for t in works if pool % (t * plan.pp * plan.sp) == 0]
    rest = [t for t in works if t not in fit]
    listed = f"tp values that work: {', '.join(map(str, fit))}"
    if rest:
        they = "they divide" if len(rest) > 1 else "it divides"
        listed += (f" on this pool of {pool} ranks; {', '.join(map(str, rest))} on a pool "
                   f"whose size {they}")
    return f"{what}; {listed}"


def _check_model(plan: Plan, config: Any, pool: int | None = None) -> None:
    heads = _config_value(config, "num_attention_heads", "n_head", "num_heads")
    layers = _config_value(config, "num_hidden_layers", "n_layer", "num_layers")
    kv_heads = _config_value(config, "num_key_value_heads")
    if plan.tp_mode != "1d":
        _check_grid_model(plan, heads, kv_heads, _config_value(config, "hidden_size", "n_embd"))
    elif plan.tp > 1 and (heads is not None or kv_heads is not None):
        works = tp_values(heads, kv_heads)
        if plan.tp not in works:
            raise PlanError(_tp_refusal(plan, heads, kv_heads, works, pool))
    if heads is not None and plan.sp > 1 and plan.sp_mode == "all_to_all" and heads % plan.sp:
        raise PlanError(
            f"sp_mode=all_to_all splits the {heads} heads over sp={plan.sp}; "
            "choose sp dividing the head count or sp_mode=ring"
        )
    if plan.ep > 1:
        _check_expert_count(plan, config)
    stages = plan.pp * pipeline_chunks(plan)
    if layers is not None and plan.pp > 1 and stages > layers:
        what = f"pp={plan.pp}" if stages == plan.pp else \
            f"pp={plan.pp} x {pipeline_chunks(plan)} chunks per rank"
        raise PlanError(f"{what} needs at least {stages} blocks but the model has {layers}; "
                        f"use fewer stages or chunks (pp*chunks <= {layers})")


def _check_expert_count(plan: Plan, config: Any) -> None:
    """Each rank of an ep group holds experts/ep experts of every block. A config that names
    no expert count is not refused here: ``parallelize`` reads the blocks themselves and
    refuses a model without mixture-of-experts blocks."""
    experts = _config_value(config, "num_local_experts", "num_experts", "n_routed_experts")
    if experts is not None and experts % plan.ep:
        fits = [e for e in range(1, experts + 1) if experts % e == 0]
        raise PlanError(f"ep={plan.ep} does not divide the model's {experts} experts per block: "
                        f"each rank of an ep group holds experts/ep of them; choose ep in {fits}")
