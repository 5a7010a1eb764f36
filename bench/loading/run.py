"""Loading a real checkpoint under a plan: host memory and time of ``load_pretrained`` (each rank
reads and holds only its pieces) against ``from_pretrained`` on every rank then
``parallelize_model`` (a whole copy per rank first), on SmolLM2-135M-Instruct (fp32).

For each plan (``tp=3`` on 3 ranks, ``dp=4 zero=3`` on 4), each variant runs in fresh rank
processes (a previous load's freed memory, kept by the allocator, would hide the next one's
growth). The ranks import everything and build their context first; then the parent samples,
every ~20 ms while they load, the memory of all of them together: PSS from
``/proc/<pid>/smaps_rollup`` (the file's page-cache pages mapped by several ranks count once
in total), RSS beside it, each less its process's value before the load. The peak over the
bytes of one copy of the weights (the file's tensors) is the headline: aim <= 1.3 shard-wise,
where ``from_pretrained`` needs a copy per rank. Samples can miss a short peak on a busy host,
so each rank also reports its own peak RSS growth (``VmHWM``, reset before the load); their
sum ("rank peaks") bounds the summed RSS from above (shared file pages count in every rank).
Load time is the slowest rank's, start to pieces filled; shard-wise over ``from_pretrained``
as a ratio. Rounds interleave the variants (a, b, a, b, ...); medians and spread (min-max)
are printed. The file is read once before the rounds so neither variant pays the disk.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from pathlib import Path

from bench.common.spread import span
from bench.common.table import print_table

PLANS = (("tp=3", 3), ("dp=4 zero=3", 4))
VARIANTS = ("shard-wise", "from_pretrained")
_CTX: list = []  # the rank's ParallelContext, built before the measured load


def _prepare(rank: int, world: int, folder: str, plan: str) -> int:
    """Import and build everything the load needs but the weights; return the pid."""
    import safetensors.torch  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: F401

    import kernels_runtime.checkpoint.pretrained  # noqa: F401
    from kernels_runtime import ParallelContext

    AutoConfig.from_pretrained(folder)
    _CTX[:] = [ParallelContext.build(plan)]
    return os.getpid()


def _load(rank: int, world: int, folder: str, variant: str) -> tuple[float, int]:
    """Seconds this rank took to load ``folder`` under the prepared plan, and the growth of
    its peak RSS meanwhile (reset before: ``clear_refs``), a check on the parent's samples."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from kernels_runtime.api import parallelize_model
    from kernels_runtime.checkpoint.pretrained import load_pretrained

    ctx = _CTX[0]
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    base = _status("VmRSS")
    dist.barrier()
    start = time.perf_counter()
    if variant == "shard-wise":
        model = load_pretrained(folder, ctx=ctx, verbose=False)
    else:
        model = parallelize_model(AutoModelForCausalLM.from_pretrained(folder).eval(), ctx=ctx,
                                  verbose=False)
    took = time.perf_counter() - start
    peak = _status("VmHWM") - base
    dist.barrier()
    del model
    return took, peak


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name == key:
                return int(rest.split()[0]) * 1024
    raise KeyError(key)


def _memory(pid: int) -> tuple[int, int]:
    """(PSS, RSS) bytes of process ``pid``."""
    values = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("Pss", "Rss"):
                values[key] = int(rest.split()[0]) * 1024
    return values["Pss"], values["Rss"]


class _Sampler(threading.Thread):
    """The peak, over samples every ``period_s``, of the summed growth of ``pids``' memory."""

    def __init__(self, pids: list[int], period_s: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.pids, self.period_s = pids, period_s
        self.base = [_memory(p) for p in pids]
        self.peak = [0, 0]  # PSS, RSS
        self.samples = 0
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            now = [_memory(p) for p in self.pids]
            for i in (0, 1):
                self.peak[i] = max(self.peak[i], sum(n[i] - b[i] for n, b in zip(now, self.base)))
            self.samples += 1
            self._done.wait(self.period_s)

    def finish(self) -> tuple[int, int]:
        self._done.set()
        self.join()
        return self.peak[0], self.peak[1]


def _measure(folder: str, plan: str, world: int, variant: str) -> dict:
    from kernels_runtime.testing import RankPool

    with RankPool(world, pg_timeout_s=600) as pool:
        pids = pool.run(_prepare, folder, plan, timeout_s=600)
        sampler = _Sampler(pids)
        sampler.start()
        loads = pool.run(_load, folder, variant, timeout_s=1200)
        pss, rss = sampler.finish()
    return {"pss": pss, "rss": rss, "seconds": max(t for t, _ in loads),
            "hwm": sum(p for _, p in loads), "samples": sampler.samples}


def _tensor_bytes(folder: Path) -> int:
    """Bytes of one copy of the weights: the tensors of the folder's safetensors files."""
    import math

    from safetensors import safe_open

    from kernels_runtime.checkpoint.pretrained import weight_files

    sizes = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1}
    total = 0
    for file in sorted(set(weight_files(folder).values())):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():  # noqa: SIM118
                info = f.get_slice(name)
                total += math.prod(info.get_shape()) * sizes[info.get_dtype()]
    return total


def main(argv: list[str]) -> dict[str, dict[str, float]]:
    """Run and print; return {plan: {variant: median peak PSS / copy, "time": median time
    ratio}}."""
    parser = argparse.ArgumentParser(prog="python -m bench loading", description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one round")
    parser.add_argument("--plans", nargs="*", default=[p for p, _ in PLANS])
    args = parser.parse_args(argv)
    rounds = 1 if args.quick else args.rounds
    from workbench.models import smollm2_instruct

    folder = smollm2_instruct()
    copy = _tensor_bytes(folder)
    for file in {f for f in folder.iterdir() if f.suffix == ".safetensors"}:
        file.read_bytes()  # into the page cache: neither variant pays the disk
    print(f"SmolLM2-135M-Instruct at {folder}: one copy of the weights = "
          f"{copy / 2**20:.1f} MiB; {rounds} round(s), variants interleaved")
    worlds = dict(PLANS)
    results: dict[tuple[str, str], list[dict]] = {}
    for _ in range(rounds):
        for plan in args.plans:
            for variant in VARIANTS:
                r = _measure(str(folder), plan, worlds[plan], variant)
                results.setdefault((plan, variant), []).append(r)
                print(f"  {plan:<12} {variant:<16} peak PSS {r['pss'] / 2**20:7.1f} MiB  "
                      f"RSS {r['rss'] / 2**20:7.1f} MiB  (sum of rank peaks "
                      f"{r['hwm'] / 2**20:7.1f} MiB)  {r['seconds']:.2f} s  "
                      f"({r['samples']} samples)", flush=True)
    rows, headline, figures = [], [], {}
    for plan in args.plans:
        med = {}
        for variant in VARIANTS:
            rs = results[(plan, variant)]
            ratios = [r["pss"] / copy for r in rs]
            secs = [r["seconds"] for r in rs]
            med[variant] = (statistics.median(ratios), statistics.median(secs))
            rows.append([plan, worlds[plan], variant,
                         statistics.median(r["pss"] for r in rs) / 2**20,
                         statistics.median(r["rss"] for r in rs) / 2**20,
                         statistics.median(r["hwm"] for r in rs) / copy,
                         med[variant][0], span(ratios), med[variant][1], span(secs)])
        time_ratios = [a["seconds"] / b["seconds"] for a, b in
                       zip(results[(plan, VARIANTS[0])], results[(plan, VARIANTS[1])])]
        figures[plan] = {v: med[v][0] for v in VARIANTS}
        figures[plan]["time"] = statistics.median(time_ratios)
        headline.append(f"{plan}: peak/copy {med[VARIANTS[0]][0]:.2f} (from_pretrained "
                        f"{med[VARIANTS[1]][0]:.2f}), time {statistics.median(time_ratios):.2f}x "
                        f"({span(time_ratios)})")
    print_table(["plan", "ranks", "variant", "peak PSS MiB", "peak RSS MiB",
                 "rank peaks/copy", "PSS/copy",
                 "spread", "load s", "spread"], rows)
    print("loading, all ranks of the host: peak host PSS over one copy of the weights "
          "(aim <= 1.3 shard-wise) and load time shard-wise / from_pretrained: "
          + "; ".join(headline))
    return figures
