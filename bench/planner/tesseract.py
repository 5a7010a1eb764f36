"""The cost model's 2.5D-over-1D and 2.5D-over-2D speedups on 64 GPUs, next to Tesseract's.

Wang et al., "Tesseract: Parallelize the Tensor Parallelism Efficiently" (arXiv 2105.14500,
ICPP '22), report 1.38x over 1D (Megatron) and 1.53x over 2D (Optimus) tensor parallelism in
strong scaling on 64 GPUs. The paper's experimental setting (model, batch, cluster) is not in
the stored corpus (only its abstract is), so this projection states its own:

- 64 GPUs, all of them tensor-parallel on one model replica (dp = 1), as strong scaling of
  tensor parallelism compares the three schemes: 1D tp=64, 2D q=8 (8 x 8) and 2.5D q=4, d=4
  (4 x 4 x 4: the shape with as many depths as rows; 2 x 2 x 16 is printed too);
- the GPT shape of Megatron-LM's 39.1B row (Narayanan et al. 2021, Table 1: hidden 8192,
  64 heads, 48 layers, sequence 2048, vocabulary 51,200), the smallest of that table whose 64
  heads 1D can split 64 ways; fp16 mixed precision, full recomputation, a global batch of 64
  sequences (one per GPU), and per plan the fewest micro-batches that fit 80 GB (as
  ``megatron.py`` does);
- the A100 data-sheet profile (8 per node, NVLink inside, 25 GB/s InfiniBand between), and the
  same GPUs 4 per node: the papers' clusters are not known here, and the node size decides
  which grid axes leave the node (2D's 8-wide rows fit 8 per node, not 4).

Nothing is tuned to the published figures: the predictions come out as they are.
Torch-free: shared by ``python -m bench planner --project`` and the tests.
"""

from __future__ import annotations

from workbench.planner import ModelSpec, Prediction, predict
from workbench.planner.cost_model import plan_label
from workbench.planner.grid import table_terms
from workbench.planner.hardware import A100, HardwareProfile, from_datasheet

GPUS = 64
SPEC = ModelSpec(hidden=8192, layers=48, heads=64, vocab=51200, seq=2048, positions=2048,
                 global_batch=64)
PLANS = {"1D": "tp=64", "2D": "tp=64 tp_mode=2d", "2.5D": "tp=64 tp_mode=2.5d tp_depth=4",
         "2.5D (d=16)": "tp=64 tp_mode=2.5d tp_depth=16"}
PUBLISHED = {"1D": 1.38, "2D": 1.53}  # Tesseract's strong-scaling speedups on 64 GPUs
HARDWARE = {"A100, 8 per node": 8, "A100, 4 per node": 4}


def hardware(per_node: int) -> HardwareProfile:
    return from_datasheet(A100, devices_per_node=per_node)


def project(plan: str, hw: HardwareProfile) -> Prediction:
    """``plan`` with the fewest micro-batches whose peak fits the device (the smallest
    micro-batch the grid allows if none fits)."""
    fits = None
    for m in (m for m in range(1, SPEC.global_batch + 1) if SPEC.global_batch % m == 0):
        try:
            fits = predict(f"dp=1 {plan} fp16 ckpt mb={m}", SPEC, hw)
        except ValueError:  # PlanError: the grid needs more samples per micro-batch
            break
        if fits.peak_bytes <= hw.device_memory:
            return fits
    assert fits is not None
    return fits


def speedups(per_node: int) -> tuple[dict[str, Prediction], dict[str, float]]:
    """The predictions per scheme and 2.5D's speedup over 1D and 2D."""
    hw = hardware(per_node)
    runs = {name: project(plan, hw) for name, plan in PLANS.items()}
    ours = {k: runs[k].step_time / runs["2.5D"].step_time for k in PUBLISHED}
    return runs, ours


def print_projection() -> dict[str, dict[str, float]]:
    from bench.common.table import print_table

    print("\nTesseract (Wang et al., arXiv 2105.14500): 2.5D vs 1D and 2D tensor parallelism on "
          f"{GPUS} GPUs, strong scaling, predicted")
    print(f"assumed (the paper's setting is not in the corpus): {SPEC.describe()}; fp16, full "
          "recomputation, dp=1, fewest micro-batches that fit 80 GB; A100 data sheet "
          "(NVLink inside a node, 25 GB/s per GPU between nodes)")
    rows, out = [], {}
    for label, per_node in HARDWARE.items():
        runs, ours = speedups(per_node)
        out[label] = ours
        for name, p in runs.items():
            st = p.setting
            axes = ", ".join(f"{k} {v:.2f}" for k, v in sorted(p.comm_by_axis().items()))
            bandwidth, latency = table_terms(st.plan.tp_mode, st.tp, st.plan.tp_depth)
            fits = "yes" if p.peak_bytes <= st.hw.device_memory else "no"
            rows.append((label, name, plan_label(p.plan), p.peak_bytes / 1e9, fits,
                         p.step_time, p.exposed_comm_time, axes,
                         f"{bandwidth:.2f} / {latency:.0f}"))
    print_table(("hardware", "scheme", "plan", "peak GB", "fits", "step s", "exposed comm s",
                 "comm s per axis (before overlap)", "table bw / lat"), rows)
    print("(table bw / lat: REFERENCES.md's terms, per all-reduce for 1D and per SUMMA step "
          "for the grids, in units of one block: not comparable across schemes)")
    for label, ours in out.items():
        print(f"headline, {label}: predicted 2.5D (4x4x4) over 1D {ours['1D']:.2f}x (paper "
              f"{PUBLISHED['1D']}x), over 2D {ours['2D']:.2f}x (paper {PUBLISHED['2D']}x)")
    return out
