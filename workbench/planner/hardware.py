"""``HardwareProfile``: the rates a cost model divides by, from data sheets or from measurement.

Shipped profiles describe one GPU of an 8-GPU node (NVLink inside, InfiniBand between nodes)
from the vendor figures in ``shared/REFERENCES.md``. Data sheets give peaks; training reaches
a fraction of them, so a data-sheet profile applies stated efficiencies (``SHEET_EFFICIENCY``)
and says so in its ``source``. A calibrated profile (``from_measurements``, fed by
``kernels_runtime.calibrate``) holds achieved rates of this machine instead, including the
runtime's own per-step costs, which no data sheet knows.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

GB = 1e9

# Achieved / peak for data-sheet profiles (assumptions, not measurements): large bf16 GEMMs
# reach ~70% of peak, memory-bound kernels ~80% of HBM bandwidth, NCCL rings ~80% of NVLink.
# Fused attention reaches ~50% of peak on the FLOPs the cost model counts (4*b*s*s*h forward).
SHEET_EFFICIENCY = {"matmul": 0.7, "attention": 0.5, "memory": 0.8, "link": 0.8}
ADAM_BYTES_PER_ELEMENT = 32  # fused AdamW: read/write fp32 param, m, v; read grad (+ slack)
# Memory traffic of a block's memory-bound ops (norms, activations, softmax, residual adds) as a
# multiple of the bytes it keeps for backward: each kept tensor is written and read in forward,
# read again and its gradient written and read in backward, plus unkept intermediates.
# Assumption for data-sheet profiles; calibration measures the rate instead.
ACTIVATION_PASSES = 6.0
# Host-side Adam/AdamW touches 4 fp32 arrays read (master, gradient, two moments) and 3 written
# (master, two moments) per parameter: memory-bandwidth bound on the host's DRAM.
HOST_ADAM_BYTES_PER_ELEMENT = 28

# Offload links, per rank (published figures; SHEET_EFFICIENCY["link"] applied for PCIe):
# - PCIe Gen4 x16 (A100): 16 GT/s x 16 lanes x 128/130 = 31.5 GB/s per direction; Gen5 x16
#   (H100, H200 SXM): 32 GT/s, 63 GB/s per direction (PCI-SIG base specifications 4.0/5.0).
# - NVMe: one U.2 PCIe Gen4 data-center drive per GPU, as in DGX A100/H100 (8 x 3.84 TB in
#   their data sheets); sequential 7.0 GB/s read, 3.8 GB/s write (Samsung PM1733 data sheet).
# - Host DRAM per rank: DGX A100's 2 x AMD EPYC 7742 (8 channels DDR4-3200, 204.8 GB/s per
#   socket) and DGX H100/H200's 2 x Xeon 8480C (8 channels DDR5-4800, 307 GB/s per socket),
#   over 8 GPUs, times SHEET_EFFICIENCY["memory"].
PCIE_GBPS = {"A100": 31.5, "H100": 63.0, "H200": 63.0}
NVME_READ_GBPS, NVME_WRITE_GBPS = 7.0, 3.8
HOST_DRAM_GBPS = {"A100": 2 * 204.8 / 8, "H100": 2 * 307.2 / 8, "H200": 2 * 307.2 / 8}


@dataclass(frozen=True)
class Link:
    """A ring over one kind of link: bus bandwidth per rank and direction, latency per step."""

    bandwidth: float  # bytes / s
    latency: float  # s


@dataclass(frozen=True)
class Overhead:
    """The runtime's fixed costs: per optimizer step, per micro-batch, per layer per micro-batch
    (Python, hooks, kernel launches, small collectives such as the loss average)."""

    step: float
    micro: float
    layer: float


@dataclass(frozen=True)
class DataSheet:
    """Vendor figures of one GPU, as listed in REFERENCES.md."""

    gpu: str
    bf16_tflops: float
    fp32_tflops: float  # without TF32 (PyTorch's default for matmul)
    memory_gb: float
    hbm_tbps: float
    nvlink_gbps: float  # per direction
    internode_gbps: float  # per GPU


A100 = DataSheet("A100 SXM 80 GB", 312, 19.5, 80, 2.0, 300, 25)
H100 = DataSheet("H100 SXM", 989, 67, 80, 3.35, 450, 50)
H200 = DataSheet("H200 SXM", 989, 67, 141, 4.8, 450, 50)


@dataclass(frozen=True)
class HardwareProfile:
    """Achieved rates of one rank's device and its links, and the runtime's fixed costs.

    Rates are per precision where hardware makes them differ; backward and attention rates
    default to the forward matmul rate when a profile does not know better (data sheets)."""

    name: str
    device_memory: float  # bytes per rank (the device tier)
    host_memory: float  # bytes per rank
    disk: float  # bytes per rank (0: unknown)
    devices_per_node: int
    matmul_flops: dict[str, float]  # achieved FLOP/s of forward products, per precision
    activation_rate: dict[str, float]  # bytes kept for backward per s of memory-bound work
    elementwise_bandwidth: dict[str, float]  # bytes/s of a plain elementwise op (casts, zeroing)
    adam_rate: float  # optimizer-updated elements per second
    intra_node: Link
    inter_node: Link
    matmul_bwd_flops: dict[str, float] | None = None  # backward products, where they differ
    attention_flops: dict[str, float] | None = None  # forward attention; None: matmul rate
    attention_bwd_flops: dict[str, float] | None = None
    collectives: dict[str, Link] = field(default_factory=dict)  # measured per op, if any
    overlap: float = 1.0  # fraction of compute time that can hide a concurrent collective
    overhead: dict[int, Overhead] = field(default_factory=dict)  # per ZeRO stage
    # offload tiers (bytes/s per rank; 0: unknown, and a plan that needs the rate is refused):
    # host<->device copies per direction, disk sequential read and write with the page cache
    # bypassed, host memory bandwidth (host-side Adam)
    pcie_bandwidth: float = 0.0
    disk_read: float = 0.0
    disk_write: float = 0.0
    host_bandwidth: float = 0.0
    # memory-bound rate against the working set: per precision, (bytes one block keeps for
    # backward, that rate) at several micro-batch sizes, ascending; empty: one rate for all
    activation_curve: dict[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    source: str = ""

    @property
    def host_adam_rate(self) -> float:
        """Optimizer-updated elements per second of Adam on host-resident fp32 state."""
        return self.host_bandwidth / HOST_ADAM_BYTES_PER_ELEMENT

    def supports(self, precision: str) -> bool:
        return precision in self.matmul_flops

    def forward_flops(self, precision: str) -> float:
        return self.matmul_flops[precision]

    def backward_flops(self, precision: str) -> float:
        return (self.matmul_bwd_flops or self.matmul_flops)[precision]

    def attention_rates(self, precision: str) -> tuple[float, float]:
        """(forward, backward) FLOP/s of attention's two batched products."""
        fwd = (self.attention_flops or self.matmul_flops)[precision]
        bwd = (self.attention_bwd_flops or self.attention_flops or self.matmul_bwd_flops
               or self.matmul_flops)[precision]
        return fwd, bwd

    def activation_rate_at(self, precision: str, kept_per_block: float) -> float:
        """Bytes kept for backward per second of memory-bound work, for blocks that each keep
        ``kept_per_block`` bytes per micro-batch.

        On a CPU this rate is not a constant: it falls for fp32 as a block's tensors outgrow
        the caches (more page faults and cache misses per byte) and rises for bf16, whose
        per-op fixed costs (conversions, dispatch) amortize over larger tensors; measured on
        2 cores, fp32 from 2.6 to 1.2 GB/s and bf16 from 1.0 to 1.7 GB/s between 1 and 8
        samples of 128 tokens, which flips which precision is faster. With a calibrated curve
        the rate is interpolated linearly in log(bytes)-log(rate) between the two nearest
        measured sizes, and held at the end points beyond them; without one (data sheets),
        ``activation_rate``."""
        points = self.activation_curve.get(precision)
        if not points or kept_per_block <= 0:
            return self.activation_rate[precision]
        if kept_per_block <= points[0][0]:
            return points[0][1]
        for (x0, r0), (x1, r1) in zip(points, points[1:]):
            if kept_per_block <= x1:
                w = math.log(kept_per_block / x0) / math.log(x1 / x0) if x1 > x0 else 1.0
                return math.exp(math.log(r0) + w * (math.log(r1) - math.log(r0)))
        return points[-1][1]

    def link(self, op: str, ranks: int, stride: int = 1) -> Link:
        """The ring link of a collective over ``ranks`` ranks spaced ``stride`` apart: NVLink
        while the ring fits in one node, the slower inter-node link otherwise."""
        if op in self.collectives:
            return self.collectives[op]
        return self.intra_node if ranks * stride <= self.devices_per_node else self.inter_node

    def overhead_for(self, zero_stage: int) -> Overhead:
        return self.overhead.get(zero_stage) or self.overhead.get(0) or _GPU_OVERHEAD


_GPU_OVERHEAD = Overhead(step=5e-3, micro=1e-3, layer=1e-4)


def from_datasheet(sheet: DataSheet, devices_per_node: int = 8,
                   host_memory: float = 2e12 / 8) -> HardwareProfile:  # 2 TB host per node
    """A profile for one GPU of a node, with ``SHEET_EFFICIENCY`` applied to the peaks."""
    eff = SHEET_EFFICIENCY
    bf16 = sheet.bf16_tflops * 1e12 * eff["matmul"]
    fp32 = sheet.fp32_tflops * 1e12 * eff["matmul"]
    att = eff["attention"] / eff["matmul"]
    hbm = sheet.hbm_tbps * 1e12 * eff["memory"]
    key = sheet.gpu.split()[0]
    return HardwareProfile(
        name=f"{sheet.gpu} ({devices_per_node} per node)",
        device_memory=sheet.memory_gb * GB,
        host_memory=host_memory,
        disk=0.0,
        devices_per_node=devices_per_node,
        matmul_flops={"bf16": bf16, "fp16": bf16, "fp32": fp32},
        attention_flops={"bf16": bf16 * att, "fp16": bf16 * att, "fp32": fp32 * att},
        activation_rate={k: hbm / ACTIVATION_PASSES for k in ("bf16", "fp16", "fp32")},
        elementwise_bandwidth={"bf16": hbm, "fp16": hbm, "fp32": hbm},
        adam_rate=hbm / ADAM_BYTES_PER_ELEMENT,
        intra_node=Link(sheet.nvlink_gbps * GB * eff["link"], 3e-6),
        inter_node=Link(sheet.internode_gbps * GB * eff["link"], 8e-6),
        overlap=0.9,
        overhead={0: _GPU_OVERHEAD, 3: Overhead(step=5e-3, micro=1e-3, layer=3e-4)},
        pcie_bandwidth=PCIE_GBPS[key] * GB * eff["link"],
        disk_read=NVME_READ_GBPS * GB,
        disk_write=NVME_WRITE_GBPS * GB,
        host_bandwidth=HOST_DRAM_GBPS[key] * GB * eff["memory"],
        source=f"vendor data sheet x efficiencies {eff}",
    )


PROFILES: dict[str, HardwareProfile] = {
    "A100": from_datasheet(A100), "H100": from_datasheet(H100), "H200": from_datasheet(H200)}


def get_profile(hardware: HardwareProfile | str) -> HardwareProfile:
    if isinstance(hardware, HardwareProfile):
        return hardware
    key = hardware.upper()
    if key not in PROFILES:
        raise ValueError(f"hardware {hardware!r} is unknown; choose one of "
                         f"{', '.join(PROFILES)}, or pass a HardwareProfile (calibrate one with "
                         "workbench.planner.calibrate(pool))")
    return PROFILES[key]


def combine(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One record for a group of ranks: the slowest rank's rate and the largest fixed cost of
    each kind, since a synchronous step waits for the slowest rank."""
    slower_when_larger = ("latency", "step", "micro", "layer", "seconds")

    def merge(values: list[Any], key: str) -> Any:
        if isinstance(values[0], dict):
            return {k: merge([v[k] for v in values], k) for k in values[0]}
        if isinstance(values[0], (int, float)) and not isinstance(values[0], bool):
            return max(values) if key in slower_when_larger else min(values)
        return values[0]

    return merge(per_rank, "")


def median_records(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-quantity median of repeated calibrations (e.g. interleaved with other work)."""

    def merge(values: list[Any]) -> Any:
        if isinstance(values[0], dict):
            return {k: merge([v[k] for v in values]) for k in values[0]}
        if isinstance(values[0], (int, float)) and not isinstance(values[0], bool):
            return statistics.median(values)
        return values[0]

    return merge(records)


def from_measurements(measured: dict[str, Any] | list[dict[str, Any]]) -> HardwareProfile:
    """A profile from ``kernels_runtime.calibrate.measure`` records (one per rank, or combined).

    All measured ranks count as one node (they were measured together over one group); the
    measured per-op links replace the node's NVLink/InfiniBand pair.
    """
    m = combine(measured) if isinstance(measured, list) else measured
    links = {op: Link(v["bandwidth"], v["latency"]) for op, v in m["collectives"].items()}
    ring = links.get("all_reduce", Link(float("inf"), 0.0))
    world = int(m["world"])
    return HardwareProfile(
        name=f"calibrated {m['device']} x{world} ({m['backend']})",
        device_memory=float(m["memory_bytes"]),
        host_memory=float(m["memory_bytes"]) if m["device"] == "cpu" else 0.0,
        disk=0.0,
        devices_per_node=world,
        matmul_flops={k: v["forward"] for k, v in m["matmul"].items()},
        matmul_bwd_flops={k: v["backward"] for k, v in m["matmul"].items()},
        attention_flops={k: v["forward"] for k, v in m["attention"].items()} or None,
        attention_bwd_flops={k: v["backward"] for k, v in m["attention"].items()} or None,
        activation_rate=dict(m["activation"]),
        elementwise_bandwidth=dict(m["elementwise"]),
        adam_rate=float(m["adam"]),
        intra_node=ring,
        inter_node=ring,
        collectives=links,
        overlap=float(m.get("overlap", 0.0)),
        overhead={int(k): Overhead(v["step"], v["micro"], v["layer"])
                  for k, v in m.get("overhead", {}).items()},
        **_transfer_rates(m.get("transfer") or {}),
        activation_curve=_curve(m.get("activation_curve") or {}),
        source=f"measured in {m.get('seconds', 0):.1f} s on block (b, s, h, a, ffn) = {m['block']}",
    )


def _curve(measured: dict[str, Any]) -> dict[str, tuple[tuple[float, float], ...]]:
    """``activation_curve`` of a record: {precision: {batch: {"kept", "rate"}}} (see
    ``workbench.planner.calibration.measure_on_rank``) as ascending (kept, rate) pairs."""
    return {k: tuple(sorted((float(p["kept"]), float(p["rate"])) for p in v.values()))
            for k, v in measured.items() if v}


def _transfer_rates(t: dict[str, Any]) -> dict[str, float]:
    """Offload rates of a calibration record (``kernels_runtime.calibrate.transfer``): host<->
    device copies (on a CPU-only machine a host memcpy), the spill directory's disk with the
    page cache bypassed, host memory bandwidth; absent ones stay 0 (unknown)."""
    return {"pcie_bandwidth": float(t.get("pcie") or 0.0),
            "disk_read": float(t.get("disk_read") or 0.0),
            "disk_write": float(t.get("disk_write") or 0.0),
            "host_bandwidth": float(t.get("host_bandwidth") or 0.0)}
