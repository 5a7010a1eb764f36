"""Which device and backend this engine uses, decided once and passed around.

Every rank must agree on the backend (nccl needs CUDA tensors, gloo takes CPU ones), and the
notebook must run unchanged on a laptop without a GPU, so the choice lives in one small value
object instead of `torch.cuda.is_available()` checks scattered through the runtime.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import psutil
import torch

_PREFERENCES = (None, "cuda", "cpu", "nccl", "gloo")


@dataclass(frozen=True)
class Accelerator:
    """The device a rank computes on and the collective backend that matches it."""

    kind: str  # "cuda" or "cpu"
    device: torch.device
    backend: str  # "nccl" on cuda, "gloo" on cpu

    @classmethod
    def detect(cls, local_rank: int = 0, prefer: str | None = None) -> Accelerator:
        """Pick cuda:<local_rank % visible devices> with nccl if a GPU is visible, else cpu/gloo.

        `prefer` forces a side: "cpu"/"gloo" always gives cpu (useful to test on a GPU box);
        "cuda"/"nccl" fails loudly when no GPU is visible, rather than silently training on CPU.
        CUDA_VISIBLE_DEVICES is applied by torch itself, so with one visible device every rank
        of this host gets cuda:0.
        """
        if prefer not in _PREFERENCES:
            raise ValueError(f"prefer must be one of {_PREFERENCES}, got {prefer!r}")
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if prefer in ("cuda", "nccl") and count == 0:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
            raise ValueError(
                f"{prefer!r} was requested but no CUDA device is visible to this process "
                f"(CUDA_VISIBLE_DEVICES={visible}); use backend 'gloo' (device 'cpu') instead."
            )
        if count > 0 and prefer not in ("cpu", "gloo"):
            return cls("cuda", torch.device("cuda", local_rank % count), "nccl")
        return cls("cpu", torch.device("cpu"), "gloo")

    def memory_in_use(self) -> dict[str, int]:
        """Bytes in use now: device allocator counters (0 on cpu), this process's host RSS and
        its peak RSS since start (the kernel's high-water mark)."""
        host_rss = psutil.Process().memory_info().rss
        host = {"host_rss": host_rss, "host_peak": max(host_rss, _peak_rss())}
        if self.kind != "cuda":
            return {"device_allocated": 0, "device_reserved": 0, "device_peak": 0, **host}
        return {
            "device_allocated": torch.cuda.memory_allocated(self.device),
            "device_reserved": torch.cuda.memory_reserved(self.device),
            "device_peak": torch.cuda.max_memory_allocated(self.device),
            **host,
        }

    def synchronize(self) -> None:
        """Wait for queued device work, so wall-clock timings measure the work, not its launch."""
        if self.kind == "cuda":
            torch.cuda.synchronize(self.device)

    @property
    def pin_memory(self) -> bool:
        """Pinned host buffers only pay off when there is a device to copy them to."""
        return self.kind == "cuda"


def _peak_rss() -> int:
    """Peak resident set size of this process in bytes (0 where the platform has no getrusage)."""
    try:
        import resource
    except ImportError:  # Windows
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB
