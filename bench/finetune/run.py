"""LoRA fine-tuning: model-state memory against its formula, capacity under a device budget,
and step speed against plain peft and across data-parallel ranks.

Three parts, each in its own file, each printing its table:
- memory (``memory.py``): the real SmolLM2-135M with peft rank-8 adapters on the seven
  projections under 1 rank, dp=2 zero=0..3 and tp=3; per rank, frozen weights + adapters +
  adapter grads + adapter optimizer states by formula against the runtime's account and
  against the tensor storages torch holds (aim: within 5%);
- capacity (``capacity.py``): the largest plain full fine-tune (fp32 AdamW, measured
  peak) in a device budget against a LoRA step on a bf16 LLaMA with its frozen base spilled
  to disk (aim >= 100x, the step run and where the frozen weights were reported);
- speed (``speed.py``): a LoRA step through ``parallelize`` + ``train_step`` on one
  rank against the same step in a plain peft loop (aim <= 1.1), and dp=2 tokens/s against one
  rank's (aim >= 1.6), rounds interleaved, medians and spread printed.

``--quick`` shrinks every part (fewer plans, a smaller LoRA model, shorter sequences, one
round); ``--parts`` runs a subset. Timings share this machine's 2 cores with whatever else
runs: read the spread before the median.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from typing import Any

PARTS = ("memory", "capacity", "speed")
QUICK = {"plans": ["dp=2 zero=2", "dp=2 zero=3", "tp=3"], "seq": 16, "widths": [64],
         "hidden": 512, "layers": 8, "rounds": 1, "steps": 1, "speed_seq": 32}


def _parser() -> argparse.ArgumentParser:
    from bench.finetune.memory import PLANS

    parser = argparse.ArgumentParser(prog="python -m bench finetune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="every part shrunk (a test run)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--plans", nargs="+", default=[p for p, _ in PLANS],
                        choices=[p for p, _ in PLANS], help="memory: the plans measured")
    parser.add_argument("--seq", type=int, default=32, help="memory and capacity: tokens")
    parser.add_argument("--budget", default="32MiB", help="capacity: device_mem")
    parser.add_argument("--host", default="16MiB",
                        help="capacity: host_mem of the LoRA run (0 is refused under auto)")
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 128, 256],
                        help="capacity: widths of plain PyTorch's ladder")
    parser.add_argument("--hidden", type=int, default=768, help="capacity: LoRA model width")
    parser.add_argument("--layers", type=int, default=32, help="capacity: LoRA model depth")
    parser.add_argument("--spill-dir", default="/var/tmp",
                        help="capacity: where the spill folder goes (a real disk, not tmpfs)")
    parser.add_argument("--rounds", type=int, default=5, help="speed: interleaved rounds")
    parser.add_argument("--steps", type=int, default=3, help="speed: steps per round")
    parser.add_argument("--batch", type=int, default=1, help="speed: sequences per rank")
    parser.add_argument("--speed-seq", type=int, default=128, help="speed: tokens")
    return parser


def main(argv: list[str]) -> dict[str, Any]:
    """Run the chosen parts and print them; return {"memory": {plan: worst measured/formula},
    "capacity": {"ratio", "fits", "device_peak"},
    "speed": {"vs_peft", "dp2_scaling", "ceiling"}}."""
    from transformers.utils import logging

    from kernels_runtime.testing import RankPool
    from workbench.models import smollm2_instruct

    args = _parser().parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    logging.disable_progress_bar()
    figures: dict[str, Any] = {}
    folder = str(smollm2_instruct()) if {"memory", "speed"} & set(args.parts) else ""
    # one pool per size for every part (started on first use): memory's 2 ranks run speed's
    # dp=2, capacity runs on speed's single rank; each part builds its own models
    with contextlib.ExitStack() as stack:
        pools = {w: stack.enter_context(RankPool(w, pg_timeout_s=600)) for w in (1, 2, 3)}
        _parts(args, folder, pools, figures)
    return figures


def _parts(args: argparse.Namespace, folder: str, pools: dict[int, Any],
           figures: dict[str, Any]) -> None:
    """The chosen parts in turn on the shared ``pools``, each adding its figures."""
    from kernels_runtime.byte_sizes import parse_bytes

    if "memory" in args.parts:
        from bench.finetune import memory as finetune_memory

        print(f"-- memory: SmolLM2-135M at {folder}, one sequence of {args.seq} tokens")
        figures["memory"] = finetune_memory.report(
            finetune_memory.run(folder, args.seq, args.plans, pools))
        worst = max(figures["memory"].values(), key=lambda r: abs(r - 1))
        print(f"memory: measured / formula per rank, worst over plans, ranks and both "
              f"measurements: {worst:.4f} (aim within 5%)")
        pools[3].close()  # tp=3 only: its ranks' memory back before the other parts
    if "capacity" in args.parts:
        from bench.finetune import capacity as finetune_capacity

        print("-- capacity")
        with tempfile.TemporaryDirectory(prefix="bench-finetune-", dir=args.spill_dir) as spill:
            out = pools[1].run(finetune_capacity.run_on_rank, parse_bytes(args.budget),
                               parse_bytes(args.host), args.widths, args.seq, args.hidden,
                               args.layers, spill, timeout_s=3600)[0]
        figures["capacity"] = finetune_capacity.report(out)
    if "speed" in args.parts:
        from bench.finetune import speed as finetune_speed

        print("-- speed")
        figures["speed"] = finetune_speed.report(finetune_speed.run(
            folder, args.rounds, args.steps, args.batch, args.speed_seq, pools))
