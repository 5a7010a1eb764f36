"""Physical capacity: the largest model one rank trains a step of inside a memory cgroup.

The device budget of ``bench/memory/capacity.py`` is the runtime's own account; here the kernel
counts. Each trial is a fresh process that first moves itself into a cgroup v1 memory group of
``--cgroup-mem`` (768 MiB) made for this benchmark, then imports torch and trains one step.
The group counts everything the process touches, page cache included, and kills it past the
limit (a trial that dies did not fit; the group's ``max_usage_in_bytes`` is printed for those
that did). Plain PyTorch (an ordinary model, AdamW) is deepened until it no longer fits; the
disk tier trains a model built under ``deferred_parameters()`` (built unit by unit, never
whole) with ``zero=3 offload=auto``, small device and host budgets and activation checkpointing
(the device budget counts activations), everything else on disk.
Both sides fix glibc's malloc thresholds first thing (``memory/host_malloc.py``; the offload
applier does it too, but only a process that starts so keeps RSS near the tiers' accounts).
Needs root and the cgroup v1 memory controller; without them the row says why and is skipped.
The group is removed afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup/memory")


def unavailable() -> str | None:
    if os.geteuid() != 0:
        return "not root"
    if not (CGROUP_ROOT / "cgroup.procs").exists():
        return f"no cgroup v1 memory controller at {CGROUP_ROOT}"
    return None


class MemoryGroup:
    """A cgroup v1 memory group of ``limit`` bytes, removed on exit."""

    def __init__(self, limit: int) -> None:
        self.path = CGROUP_ROOT / f"workbench-bench-{os.getpid()}"
        self.limit = limit

    def __enter__(self) -> MemoryGroup:
        self.path.mkdir()
        (self.path / "memory.limit_in_bytes").write_text(str(self.limit))
        swappiness = self.path / "memory.swappiness"
        if swappiness.exists():
            swappiness.write_text("0")
        return self

    def reset(self) -> None:
        (self.path / "memory.max_usage_in_bytes").write_text("0")

    def max_usage(self) -> int:
        return int((self.path / "memory.max_usage_in_bytes").read_text())

    def __exit__(self, *exc: object) -> None:
        for _ in range(50):  # a killed trial's pages are uncharged shortly after it exits
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def trial(group: MemoryGroup, job: dict, timeout_s: float) -> dict:
    """Run ``job`` in a fresh process inside ``group``; ``{"fits": False}`` if it was killed."""
    group.reset()
    cmd = [sys.executable, "-m", "bench.memory.cgroup", "--child", json.dumps(job),
           str(group.path / "cgroup.procs")]
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                          cwd=Path(__file__).resolve().parents[2])  # the repository root
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        oom = proc.returncode < 0 or "MemoryError" in proc.stderr
        if not oom:
            raise RuntimeError(f"trial {job} failed:\n{proc.stderr[-3000:]}")
        return {"fits": False, "job": job, "usage": group.max_usage(), "seconds": seconds}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"fits": True, "job": job, "usage": group.max_usage(), "seconds": seconds, **out}


def _child(job: dict, procs: str) -> None:
    Path(procs).write_text(str(os.getpid()))  # in the group before torch is imported
    from kernels_runtime.memory.host_malloc import return_freed_memory

    return_freed_memory()  # from the start, both sides: freed buffers leave the process
    import torch

    from bench.memory.capacity import shape
    from kernels_runtime.calibrate.trial import build_model, next_token_loss, token_batch

    spec = shape(job["hidden"], job["layers"], job["seq"])
    batch = token_batch(0, 0, 1, job["seq"])
    if job["kind"] == "plain":
        model = build_model(spec)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        for step in range(2):  # the second step holds AdamW's states from the start
            loss = next_token_loss(model, token_batch(step, 0, 1, job["seq"]))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        numel = sum(p.numel() for p in model.parameters())
        print(json.dumps({"numel": numel, "loss": float(loss)}))
        return
    import torch.distributed as dist

    from kernels_runtime import ParallelContext, deferred_parameters, parallelize, train_step

    store = dist.HashStore()  # one rank: a process group without a network
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    with deferred_parameters():
        model = build_model(spec)
    numel = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    model, opt = parallelize(model, opt, ctx=ParallelContext.build(job["plan"]),
                             verbose=False, spill_dir=job["spill"])
    result = train_step(model, opt, [batch], loss_fn=next_token_loss)
    print(json.dumps({"numel": numel, "loss": float(result.loss),
                      "tiers": opt.sync.tier_bytes(),
                      "moved": sum(opt.sync.last_step["moved"].values())}))


def run(args: argparse.Namespace, spill: str) -> dict | str:
    """Plain PyTorch's largest in the group, then the disk tier's step; or why it is skipped."""
    from kernels_runtime.byte_sizes import parse_bytes

    why = unavailable()
    if why:
        return why
    limit = parse_bytes(args.cgroup_mem)
    plain: list[dict] = []
    with MemoryGroup(limit) as group:
        for layers in args.cgroup_plain_layers:
            row = trial(group, {"kind": "plain", "hidden": args.cgroup_plain_hidden,
                                "layers": layers, "seq": args.capacity_seq}, 600)
            plain.append(row)
            if not row["fits"]:
                break
        disk = trial(group, {"kind": "disk", "hidden": args.cgroup_disk_hidden,
                             "layers": args.cgroup_disk_layers, "seq": args.capacity_seq,
                             "plan": args.cgroup_disk_plan, "spill": spill}, 1500)
    return {"limit": limit, "plain": plain, "disk": disk}


def report(out: dict | str) -> float | None:
    from kernels_runtime.byte_sizes import human_bytes

    if isinstance(out, str):
        print(f"physical capacity in a memory cgroup: skipped ({out})")
        return None
    rows = [[f"plain h={r['job']['hidden']} L={r['job']['layers']}",
             f"{r['numel'] / 1e6:.1f}M" if r["fits"] else "-",
             "trained" if r["fits"] else "killed (over the limit)",
             human_bytes(r["usage"]), f"{r['seconds']:.0f}"] for r in out["plain"]]
    d = out["disk"]
    rows.append([f"disk tier h={d['job']['hidden']} L={d['job']['layers']}",
                 f"{d['numel'] / 1e6:.1f}M" if d["fits"] else "-",
                 "trained" if d["fits"] else "killed (over the limit)",
                 human_bytes(d["usage"]), f"{d['seconds']:.0f}"])
    print(f"one rank in a {human_bytes(out['limit'])} memory cgroup (page cache counted); disk "
          f"tier plan '{d['job']['plan']}'")
    from bench.common.table import print_table

    print_table(["model", "parameters", "one step", "cgroup peak", "s"], rows)
    fits = [r for r in out["plain"] if r["fits"]]
    if not fits or not d["fits"]:
        print("physical capacity: no ratio (a side trained nothing)")
        return None
    best = max(fits, key=lambda r: r["numel"])
    ratio = d["numel"] / best["numel"]
    tiers = ", ".join(f"{k} {human_bytes(v)}" for k, v in d["tiers"].items())
    print(f"disk tier after its step: {tiers}; loss {d['loss']:.4f}")
    print(f"largest plain PyTorch step in {human_bytes(out['limit'])}: "
          f"{best['numel'] / 1e6:.1f}M parameters; the disk tier: {d['numel'] / 1e6:.1f}M -> "
          f"{ratio:.1f}x (aim >= 20x)")
    return ratio


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cgroup-mem", default="768MiB")
    parser.add_argument("--cgroup-plain-hidden", type=int, default=512)
    parser.add_argument("--cgroup-plain-layers", type=int, nargs="+",
                        default=[2, 4, 6, 8, 10, 12, 16])
    parser.add_argument("--cgroup-disk-hidden", type=int, default=768)
    parser.add_argument("--cgroup-disk-layers", type=int, default=96)
    # ckpt: the device budget covers activations too (memory/activation_reserve.py), and
    # 96 blocks' saved tensors alone (101 MiB at this size) would not leave room for a block
    parser.add_argument("--cgroup-disk-plan", default="dp=1 zero=3 offload=auto "
                        "device_mem=128MiB host_mem=64MiB ckpt")


QUICK = {"cgroup_mem": "512MiB", "cgroup_plain_hidden": 64, "cgroup_plain_layers": [2],
         "cgroup_disk_hidden": 64, "cgroup_disk_layers": 4,
         "cgroup_disk_plan": "dp=1 zero=3 offload=auto device_mem=2MiB host_mem=1MiB"}

if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    _child(json.loads(sys.argv[2]), sys.argv[3])
