"""The cost model against Megatron-LM's published throughput (Narayanan et al. 2021).

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (arXiv 2104.04473), Table 1: weak scaling of GPT models on Selene's A100s (8 per
node, 312 TFLOP/s bf16/fp16 peak), sequence 2048, vocabulary 51,200, mixed precision, full
activation recomputation. The rows without pipeline parallelism (1.7B to 18.4B) use only the
terms this cost model has: 1D tensor parallelism inside a node and data parallelism across
nodes. For each row, ``predict`` prices the paper's plan on the A100 data-sheet profile and the
paper's FLOP count (its eq. 3: ``96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h))`` per iteration, with
recomputation) turns the predicted step time into TFLOP/s per GPU, next to the paper's.

Torch-free: pure arithmetic, shared by ``python -m bench planner --project`` and the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

from kernels_runtime.mesh.plan import Plan
from workbench.planner import PROFILES, ModelSpec, Prediction, predict

SEQ, VOCAB = 2048, 51200
PRECISION = "fp16"  # the paper's mixed precision (fp16 with loss scaling)


@dataclass(frozen=True)
class MegatronRow:
    """One row of Table 1 (pipeline-parallel size 1)."""

    billions: float
    heads: int
    hidden: int
    layers: int
    tp: int
    gpus: int
    batch: int  # global batch, sequences per iteration
    tflops: float  # achieved teraFLOP/s per GPU, as published


TABLE1 = (
    MegatronRow(1.7, 24, 2304, 24, 1, 32, 512, 137),
    MegatronRow(3.6, 32, 3072, 30, 2, 64, 512, 138),
    MegatronRow(7.5, 32, 4096, 36, 4, 128, 512, 142),
    MegatronRow(18.4, 48, 6144, 40, 8, 256, 1024, 135),
)


def iteration_flops(row: MegatronRow) -> float:
    """The paper's eq. 3: FLOPs of one iteration with activation recomputation."""
    b, s, layer, h, v = row.batch, SEQ, row.layers, row.hidden, VOCAB
    return 96 * b * s * layer * h * h * (1 + s / (6 * h) + v / (16 * layer * h))


def spec_for(row: MegatronRow) -> ModelSpec:
    """A GPT as the paper describes it: learned positions, tied embeddings, and the textbook
    activation count (``attention=None``: Korthikanti et al.'s profile)."""
    return ModelSpec(hidden=row.hidden, layers=row.layers, heads=row.heads, vocab=VOCAB,
                     seq=SEQ, global_batch=row.batch, positions=SEQ)


def plan_for(row: MegatronRow, microbatches: int) -> Plan:
    return Plan(dp=row.gpus // row.tp, tp=row.tp, precision=PRECISION,
                microbatches=microbatches, activation_checkpointing=True)


def project(row: MegatronRow, hardware: str = "A100") -> Prediction:
    """The paper's plan with the fewest micro-batches (largest micro-batch) whose predicted
    peak fits the device: the paper does not list its micro-batch sizes."""
    spec, hw = spec_for(row), PROFILES[hardware]
    local = row.batch // (row.gpus // row.tp)
    fits = None
    for m in (m for m in range(1, local + 1) if local % m == 0):
        fits = predict(plan_for(row, m), spec, hw)
        if fits.peak_bytes <= hw.device_memory:
            return fits
    assert fits is not None
    return fits  # nothing fits: the smallest micro-batch, whose peak the table shows


def predicted_tflops(row: MegatronRow, prediction: Prediction) -> float:
    return iteration_flops(row) / prediction.step_time / row.gpus / 1e12


def table_rows() -> list[tuple]:
    """(model, plan, micro-batch, peak GB, step s, predicted TFLOP/s, paper, ratio) per row."""
    rows = []
    for row in TABLE1:
        p = project(row)
        ours = predicted_tflops(row, p)
        micro = p.setting.micro_batch
        rows.append((f"{row.billions}B (h={row.hidden}, a={row.heads}, l={row.layers})",
                     f"tp={row.tp} dp={row.gpus // row.tp}, B={row.batch}", micro,
                     p.peak_bytes / 1e9, p.step_time, ours, row.tflops, ours / row.tflops))
    return rows


def print_projection() -> list[tuple]:
    from bench.table import print_table

    hw = PROFILES["A100"]
    print("\nMegatron-LM (Narayanan et al. 2021, arXiv 2104.04473) Table 1, rows with pipeline "
          "size 1: predicted vs published teraFLOP/s per GPU")
    print(f"assumed: seq {SEQ}, vocab {VOCAB}, {PRECISION} mixed precision with Adam, full "
          "activation recomputation, no ZeRO, no sequence parallelism; A100 SXM 80 GB "
          f"data sheet x {hw.source.removeprefix('vendor data sheet x ')}, "
          f"{hw.devices_per_node} per node (NVLink inside, 25 GB/s per GPU between nodes); "
          "activations by Korthikanti et al.'s count; micro-batch: the largest that fits 80 GB "
          "(the paper does not list it); FLOPs per iteration by the paper's eq. 3")
    rows = table_rows()
    print_table(("model", "plan", "micro-batch", "peak GB", "step s", "ours TFLOP/s",
                 "paper TFLOP/s", "ours/paper"), rows)
    ratios = [r[-1] for r in rows]
    print(f"\nheadline: predicted/published throughput {min(ratios):.2f}-{max(ratios):.2f}x "
          f"over the {len(rows)} rows")
    return rows
