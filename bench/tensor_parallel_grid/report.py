"""The printed sections of ``python -m bench tensor_parallel_grid`` (its docstring says what
each one checks); the formulas are ``formulas.py``."""

from __future__ import annotations

import statistics
from dataclasses import replace

from bench.common.layer_meter import layer_delta
from bench.common.table import print_table
from bench.tensor_parallel.formulas import (
    layer_activation_bytes,
    layer_activation_terms,
    outside_collectives,
)
from bench.tensor_parallel_grid.formulas import (
    PASSES,
    GridShape,
    activation_bytes_grid,
    activation_bytes_unsplit,
    activation_terms_grid,
    break_even_tokens,
    grid_layer_ops,
    grid_outside_ops,
    group_sizes,
    layer_wire,
    one_d_layer_ops,
    param_bytes_1d,
    param_bytes_grid,
    param_bytes_unsplit,
    payload,
    wire,
)

GROUPS = ("tp", "tp_row", "tp_col", "tp_dep")
SHORT = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "broadcast": "BC",
         "send": "send", "recv": "recv"}
KIB = 1024
TOKENS = (1024, 4096, 16384, 65536, 262144)  # b*s of the table
HIDDEN = (1024, 2048, 4096, 8192)
SCHEMES = ((2, 1), (2, 2), (4, 1), (4, 4), (8, 1))  # (q, d)


# ---- formulas per variant -------------------------------------------------------------------
def formula_layer(name: str, shape: GridShape) -> dict[str, list]:
    return one_d_layer_ops(shape.one_d()) if name.startswith("1D") else grid_layer_ops(shape)


def sizes_of(name: str, shape: GridShape) -> dict[str, int]:
    return group_sizes(shape.one_d() if name.startswith("1D") else shape)


def as_ops(counted: dict) -> list[tuple[str, str, int, float]]:
    """{(op, group): (calls, bytes)} -> [(op, group, calls, mean bytes per call)]."""
    return [(op, g, c, b / c) for (op, g), (c, b) in sorted(counted.items())]


def _label(ops: list) -> str:
    calls: dict[str, int] = {}
    for op, _, c, _ in ops:
        calls[op] = calls.get(op, 0) + c
    return " + ".join(f"{c} {SHORT.get(op, op)}" for op, c in sorted(calls.items())) or "none"


def _ratio(a: float, b: float) -> float | str:
    return a / b if b else ("1.000" if not a else "inf")


# ---- 1. bytes per layer ---------------------------------------------------------------------
def print_layer_bytes(counted: dict, shape_of: dict) -> dict[str, dict]:
    """1a and 1b; returns per variant and pass the counted and formula totals and wchar."""
    print("\n1a. collective bytes per transformer layer per rank, one step: comm.stats deltas per "
          "group (payload handed to each op; a broadcast's whole block on root and receivers) "
          "against the per-op formulas; BC broadcast, RS reduce-scatter, AR all-reduce")
    rows, wire_rows, seen = [], [], {}
    for name, result in counted.items():
        if isinstance(result, str):
            rows.append((name, "-", "-", result, "", "", "", ""))
            continue
        shape = shape_of[name]
        for pass_ in PASSES:
            got = as_ops(layer_delta(result["blocks"], pass_)["ops"])
            want = formula_layer(name, shape)[pass_]
            for g in GROUPS:
                mine = [o for o in got if o[1] == g]
                theirs = [o for o in want if o[1] == g]
                if mine or theirs:
                    rows.append((name, pass_, g, _label(mine), payload(mine) / KIB,
                                 _label(theirs), payload(theirs) / KIB,
                                 _ratio(payload(mine), payload(theirs))))
            rows.append((name, pass_, "all", "", payload(got) / KIB, "", payload(want) / KIB,
                         _ratio(payload(got), payload(want))))
            sizes = sizes_of(name, shape)
            w = layer_delta(result["blocks"], pass_)["wchar"]
            calls = sum(c for op, _, c, _ in got if op != "recv")
            wire_rows.append((name, pass_, w / KIB, wire(got, sizes) / KIB,
                              _ratio(w, wire(got, sizes)), wire(want, sizes) / KIB,
                              _ratio(w, wire(want, sizes)),
                              round((w - wire(got, sizes)) / max(calls, 1))))
            seen[(name, pass_)] = {"counted": payload(got), "formula": payload(want),
                                   "wchar": w, "wire": wire(want, sizes)}
    print_table(("variant", "pass", "group", "counted ops", "KiB", "formula ops", "formula KiB",
                 "ratio"), rows)
    print("\n1b. bytes each rank wrote to its sockets per layer (/proc/self/io wchar) against "
          "gloo's wire bytes for the counted and the formula's ops (ring all-reduce 2(g-1)/g N; "
          "gloo's reduce-scatter all-reduces its input, 2(g-1)/g N_in; a broadcast's g-1 copies "
          "leave some rank, (g-1)/g B per rank over a SUMMA); the rest is gloo's 48-byte "
          "message headers (extra B/call: wchar - wire over the calls)")
    print_table(("variant", "pass", "wchar KiB", "wire(counted)", "ratio", "wire(formula)",
                 "ratio", "extra B/call"), wire_rows)
    return seen


def outside_ops(result: dict, pass_: str) -> list:
    """The pass's ops minus layers x one layer."""
    whole, layer, n = result["passes"][pass_], layer_delta(result["blocks"], pass_), \
        len(result["blocks"])
    ops = {}
    for key, (c, b) in whole["ops"].items():
        lc, lb = layer["ops"].get(key, (0, 0))
        if c - n * lc:
            ops[key] = (c - n * lc, b - n * lb)
    return as_ops(ops)


def on_diagonal(rank: int, shape: GridShape) -> bool:
    """Rank (k, i, j) at tp index k*q^2 + i*q + j (dp = 1): i = j."""
    q = shape.side
    return (rank // q) % q == rank % q


def print_outside(groups: list[list[dict]], shape_of: dict) -> None:
    """1c, for ranks 0 and 1 of each run (``groups``: the runs' per-rank results)."""
    print("\n1c. outside the layers, per rank (grid: embedding's ids gather, partial "
          "reduce-scatter and mirror swap, final norm, LM head SUMMA, loss; the diagonal rank "
          "(i = j) swaps nothing; 1D: the 1D bench's embedding, head and loss)")
    rows = []
    for per_rank in groups:
        for name, first in per_rank[0]["count"].items():
            if isinstance(first, str):
                continue
            shape = shape_of[name]
            for rank in (0, 1):
                result = per_rank[rank]["count"][name]
                for pass_ in PASSES:
                    got = outside_ops(result, pass_)
                    if name.startswith("1D"):
                        want = [(op, "tp", c, b) for op, c, b in
                                outside_collectives(shape.one_d(), sp=False)[pass_]]
                    else:
                        want = grid_outside_ops(shape, on_diagonal(rank, shape))[pass_]
                    rows.append((name, rank, pass_, _label(got), payload(got) / KIB,
                                 payload(want) / KIB, _ratio(payload(got), payload(want))))
    print_table(("variant", "rank", "pass", "counted ops", "KiB", "formula KiB", "ratio"), rows)


# ---- 2. where a grid sends less --------------------------------------------------------------
def print_where_grid_wins(model: GridShape, seen: dict, shape_of: dict) -> None:
    print(f"\n2. bytes a rank sends per layer, forward + backward, grid / 1D at the same tp, "
          f"from the formulas (ring algorithms: reduce-scatter (g-1)/g N_in; f/h = "
          f"{model.ffn / model.hidden:g}, kv/a = {model.kv_heads / model.heads:g}, head width "
          f"{model.head_dim} as measured); '<' marks the grid sending less")
    rows = []
    for q, d in SCHEMES:
        base = replace(model, side=q, depth=d)
        for tokens in TOKENS:
            cells = []
            for h in HIDDEN:
                s = base.sized(tokens, h)
                r = layer_wire(s) / layer_wire(s.one_d())
                cells.append(f"{r:.2f}{' <' if r < 1 else '  '}")
            rows.append((base.describe().split(" (")[0], base.tp, tokens, *cells))
    print_table(("grid", "tp", "b*s", *(f"h={h}" for h in HIDDEN)), rows)
    print("    break-even b*s (the grid sends less above it), from the same formulas:")
    for q, d in SCHEMES:
        base = replace(model, side=q, depth=d)
        ends = [break_even_tokens(base.sized(1, h)) for h in HIDDEN]
        text = ", ".join(f"h={h}: {'never' if t is None else f'{t:,.0f}'}"
                         for h, t in zip(HIDDEN, ends))
        print(f"    {base.describe().split(' (')[0]} (tp={base.tp}): {text}")
    print("    measured points (this run's model): grid / 1D per layer, forward + backward")
    rows = []
    for grid, one in (("2D tp=4", "1D tp=4"), ("2.5D tp=8", "1D tp=8")):
        if not all((n, p) in seen for n in (grid, one) for p in PASSES):
            rows.append((grid, "not run", "", "", "", ""))
            continue
        both = {k: [sum(seen[(n, p)][k] for p in PASSES) for n in (grid, one)]
                for k in ("counted", "formula", "wchar", "wire")}
        s = shape_of[grid]
        rows.append((grid, both["counted"][0] / both["counted"][1],
                     both["formula"][0] / both["formula"][1],
                     both["wchar"][0] / both["wchar"][1], both["wire"][0] / both["wire"][1],
                     layer_wire(s) / layer_wire(s.one_d())))
    print_table(("grid vs 1D", "payload counted", "payload formula", "wchar measured",
                 "gloo wire formula", "ring wire formula"), rows)


# ---- 3. step time ------------------------------------------------------------------------
def print_times(timed: list[dict], rounds: int, steps: int) -> float | None:
    names = list(timed[0]["times"])
    per_round = {n: [max(t["times"][n][i] for t in timed) for i in range(rounds)] for n in names}
    print(f"\n3. step time at tp=4 (4 gloo ranks): {rounds} rounds x {steps} steps of each "
          "variant, order rotating; per round the slowest rank's median step; median and min-max "
          "over rounds; 2D/1D: median (min-max) over rounds of the ratio within the round")
    paired = None
    if "2D tp=4" in per_round and "1D tp=4" in per_round:
        paired = [a / b for a, b in zip(per_round["2D tp=4"], per_round["1D tp=4"])]
    rows = []
    for n in names:
        v, med = per_round[n], statistics.median(per_round[n])
        ratio = (f"{statistics.median(paired):.3f} ({min(paired):.2f}-{max(paired):.2f})"
                 if paired and n.startswith("2D") else "-")
        rows.append((n, med * 1e3, min(v) * 1e3, max(v) * 1e3,
                     f"{(max(v) - min(v)) / med * 100:.0f}%", ratio,
                     f"{timed[0]['first_loss'][n]:.6f}"))
    for n, why in timed[0]["skipped"].items():
        rows.append((n, why, "", "", "", "", ""))
    print_table(("variant", "median ms", "min", "max", "spread", "2D/1D", "first-step loss"),
                rows)
    return statistics.median(paired) if paired else None


# ---- 4. memory -------------------------------------------------------------------------------
def print_memory(counted: dict, shape_of: dict, ref: dict) -> dict[str, tuple]:
    print("\n4. memory per rank: local parameter bytes and bytes saved for backward per layer "
          "(SavedActivations, a block after the first: the first also keeps the RoPE tables), "
          "against the exact formula and against the unsplit model's (measured in this process) "
          "times the ideal fraction: params 1/t (1D), 1/q^2 (2D, 2.5D); activations 1/t (1D), "
          "1/q^2 (2D), 1/(d*q^2) (2.5D)")
    unsplit_act = min(ref["saved"][1:])
    rows, ratios = [], {}
    for name, result in counted.items():
        if isinstance(result, str):
            rows.append((name, result, "", "", "", "", "", "", ""))
            continue
        s = shape_of[name]
        one = name.startswith("1D")
        p_want = param_bytes_1d(s.one_d()) if one else param_bytes_grid(s)
        p_frac = 1 / s.tp if one else 1 / s.side ** 2
        a_want = layer_activation_bytes(s.one_d(), sp=False) if one else activation_bytes_grid(s)
        a_frac = 1 / s.tp
        act = min(result["saved"][1:])
        ratios[name] = (result["params"] / (ref["params"] * p_frac), act / (unsplit_act * a_frac))
        rows.append((name, result["params"] / KIB, _ratio(result["params"], p_want),
                     f"1/{round(1 / p_frac)}", ratios[name][0], act / KIB, _ratio(act, a_want),
                     f"1/{round(1 / a_frac)}", ratios[name][1]))
    print_table(("variant", "params KiB", "/formula", "ideal", "/ideal", "act KiB/layer",
                 "/formula", "ideal", "/ideal"), rows)
    model = next(iter(shape_of.values()))
    print(f"    unsplit: params {ref['params'] / KIB:.1f} KiB (formula "
          f"{_ratio(ref['params'], param_bytes_unsplit(model)):.3f}), activations "
          f"{unsplit_act / KIB:.1f} KiB per layer (formula "
          f"{_ratio(unsplit_act, activation_bytes_unsplit(model)):.3f})")
    print("    activations per layer by term (formulas, which the measured totals equal), KiB: "
          "the unsplit model's / tp against each variant's")
    whole = layer_activation_terms(replace(model.one_d(), tp=1), sp=False)
    rows = []
    for name, result in counted.items():
        if isinstance(result, str):
            continue
        s = shape_of[name]
        mine = (layer_activation_terms(s.one_d(), sp=False) if name.startswith("1D")
                else activation_terms_grid(s))
        rows.append((name, *(f"{mine[k] / KIB:.1f} / {whole[k] / s.tp / KIB:.1f} = "
                             f"{mine[k] / (whole[k] / s.tp):.2f}" for k in whole)))
    print_table(("variant", *whole), rows)
    print("    what does not scale: grid params keep each norm weight's chunk j on every row "
          "(h/q, not h/q^2) and pad the vocabulary to q chunks; grid norms keep 1/rms per "
          "token on every column of the row (n, not n/q) but not the unsplit RMSNorm's x*r "
          "copy (recomputed in backward), so their term falls under 1/(d*q^2) and the total "
          "with it; 1D replicates both norms' weights and everything they save (input, x*r, "
          "1/rms, output) on every rank")
    return ratios
