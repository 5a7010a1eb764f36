"""The cost model against Megatron-LM's published throughput (Narayanan et al. 2021).

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (arXiv 2104.04473), Table 1: weak scaling of GPT models on Selene's A100s (8 per
node, 312 TFLOP/s bf16/fp16 peak), sequence 2048, vocabulary 51,200, mixed precision, full
activation recomputation. The rows without pipeline parallelism (1.7B to 18.4B) are 1D tensor
parallelism inside a node and data parallelism across nodes; the pipelined rows add pipeline
stages across nodes (``PIPELINED``). For each row, ``predict`` prices the paper's plan on the
A100 data-sheet profile and the paper's FLOP count (its eq. 3:
``96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h))`` per iteration, with recomputation) turns the
predicted step time into TFLOP/s per GPU, next to the paper's.

The pipelined rows are the ones ``shared/REFERENCES.md`` quotes (145.6B, 530B, 1T: layers,
hidden size, tp, pp, GPUs, TFLOP/s and % of peak). It gives neither their attention heads nor
their global batch, nor the schedule, so those are assumptions, printed with the table: 128
dimensions per head (heads only change the one recomputed layer's activations), a global batch
of one sequence per GPU, micro-batches of the size (1, 2 or 4) predicted fastest within 80 GB,
and both 1F1B and interleaved schedules. Rows of the paper's table that REFERENCES.md does not
quote are left out rather than recalled.

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


@dataclass(frozen=True)
class PipelinedRow:
    """A pipelined row of Table 1 as REFERENCES.md quotes it (no heads, no batch size)."""

    label: str
    layers: int
    hidden: int
    tp: int
    pp: int
    gpus: int
    tflops: float  # achieved teraFLOP/s per GPU, as published
    peak_percent: int  # of 312 TFLOP/s, as published

    @property
    def heads(self) -> int:
        return self.hidden // HEAD_DIM  # assumed

    @property
    def batch(self) -> int:
        return self.gpus  # assumed: one sequence per GPU per iteration

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)


PIPELINED = (
    PipelinedRow("145.6B", 80, 12288, 8, 8, 1536, 148, 47),
    PipelinedRow("530B", 105, 20480, 8, 35, 2520, 163, 52),
    PipelinedRow("1T", 128, 25600, 8, 64, 3072, 163, 52),
)
HEAD_DIM = 128  # assumption for the pipelined rows' head counts
PIPELINE_MICRO = (1, 2, 4)  # micro-batch sizes tried for the pipelined rows


def iteration_flops(row: MegatronRow | PipelinedRow) -> float:
    """The paper's eq. 3: FLOPs of one iteration with activation recomputation."""
    b, s, layer, h, v = row.batch, SEQ, row.layers, row.hidden, VOCAB
    return 96 * b * s * layer * h * h * (1 + s / (6 * h) + v / (16 * layer * h))


def spec_for(row: MegatronRow | PipelinedRow) -> ModelSpec:
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


def interleave_chunks(row: PipelinedRow) -> int:
    """V for the interleaved column: the smallest divisor >= 2 of the blocks per stage (equal
    chunks), else 2."""
    per_stage = row.layers // row.pp
    return next((v for v in range(2, per_stage + 1) if per_stage % v == 0), 2)


def project_pipelined(row: PipelinedRow, schedule: str = "1f1b",
                      hardware: str = "A100") -> Prediction:
    """The row's dp x pp x tp plan under ``schedule``, at the micro-batch size predicted
    fastest among those that fit the device (the smallest peak if none fits)."""
    spec, hw = spec_for(row), PROFILES[hardware]
    local = row.batch // row.dp
    chunks = interleave_chunks(row) if schedule == "interleaved" else 1
    tried = []
    for size in (b for b in PIPELINE_MICRO if local % b == 0):
        m = local // size
        if m < row.pp or (schedule == "interleaved" and m % row.pp):
            continue
        tried.append(predict(Plan(dp=row.dp, tp=row.tp, pp=row.pp, pp_schedule=schedule,
                                  pp_chunks=chunks, precision=PRECISION, microbatches=m,
                                  activation_checkpointing=True), spec, hw))
    fits = [p for p in tried if p.peak_bytes <= hw.device_memory]
    if fits:
        return min(fits, key=lambda p: p.step_time)
    return min(tried, key=lambda p: p.peak_bytes)


def predicted_tflops(row: MegatronRow | PipelinedRow, prediction: Prediction) -> float:
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


def pipelined_rows() -> list[tuple]:
    """(model, plan, micro-batch, m, 1F1B bubble, peak GB, 1F1B TFLOP/s, interleaved V and
    TFLOP/s, paper TFLOP/s, % of peak, 1F1B / paper) per pipelined row."""
    rows = []
    for row in PIPELINED:
        flat = project_pipelined(row, "1f1b")
        inter = project_pipelined(row, "interleaved")
        ours, ours_v = predicted_tflops(row, flat), predicted_tflops(row, inter)
        rows.append((f"{row.label} (h={row.hidden}, l={row.layers})",
                     f"tp={row.tp} pp={row.pp} dp={row.dp}, B={row.batch}",
                     flat.setting.micro_batch, flat.setting.microbatches,
                     f"{flat.bubble_time / flat.step_time:.1%}", flat.peak_bytes / 1e9, ours,
                     f"V={interleave_chunks(row)}: {ours_v:.1f}", row.tflops,
                     f"{row.peak_percent}%", ours / row.tflops))
    return rows


def print_pipelined() -> list[tuple]:
    print("\nMegatron-LM Table 1, pipelined rows quoted in REFERENCES.md: predicted vs published "
          "teraFLOP/s per GPU")
    print(f"assumed (not in REFERENCES.md): {HEAD_DIM} dimensions per head; global batch B = "
          "one sequence per GPU; micro-batch of 1, 2 or 4 sequences, the fastest predicted "
          "within 80 GB; schedule 1F1B (and interleaved with V chunks); same profile, "
          "precision and recomputation as above; the bubble by replaying the runtime's "
          "schedule with the stages' predicted costs; p2p and the data-parallel reduction "
          "between nodes (25 GB/s)")
    rows = pipelined_rows()
    from bench.common.table import print_table

    print_table(("model", "plan", "micro-batch", "m", "1F1B bubble", "peak GB",
                 "ours 1F1B", "ours interleaved", "paper TFLOP/s", "paper % peak",
                 "1F1B/paper"), rows)
    ratios = [r[-1] for r in rows]
    print(f"\nheadline: pipelined rows, predicted (1F1B)/published throughput "
          f"{min(ratios):.2f}-{max(ratios):.2f}x over the {len(rows)} rows REFERENCES.md "
          "quotes (the paper's other pipelined rows are not quoted there: left out)")
    return rows


def print_projection() -> list[tuple]:
    from bench.common.table import print_table

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
    return rows + print_pipelined()
