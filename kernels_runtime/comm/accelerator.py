"""Which device and backend this engine uses, decided once and passed around.

Every rank must agree on the backend (nccl needs CUDA tensors, gloo takes CPU ones), and the
notebook must run unchanged on a laptop without a GPU, so the choice lives in one small value
object instead of device checks scattered through the runtime. This module is the one place
that names device kinds: everything else asks the ``Accelerator`` (its device, whether work on
it is queued asynchronously, its memory counters, RNG states, events). A new torch device type
with a collective backend (e.g. ``xpu`` with ``xccl``) is one more row of ``DEVICE_KINDS``;
``torch.get_device_module`` gives the per-kind module (``torch.cuda``, ``torch.xpu``) with the
same functions for each.
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass
from typing import Any

import psutil
import torch

# device kind -> (collective backend, environment variable that selects visible devices),
# tried in this order; "cpu" with gloo is the fallback and always present.
DEVICE_KINDS: dict[str, tuple[str, str]] = {
    "cuda": ("nccl", "CUDA_VISIBLE_DEVICES"),
    "xpu": ("xccl", "ZE_AFFINITY_MASK"),
}
HOST_KIND, HOST_BACKEND = "cpu", "gloo"


def backend_device_kind(backend: str) -> str:
    """The device kind whose tensors ``backend`` communicates (gloo: the host)."""
    for kind, (name, _) in DEVICE_KINDS.items():
        if name == backend:
            return kind
    return HOST_KIND


def timing_event(backend: str) -> Any:
    """A timing event on the current stream of the device ``backend`` communicates."""
    return torch.get_device_module(backend_device_kind(backend)).Event(enable_timing=True)


def grouped_gemm_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) compute capability of a CUDA device, whose grouped-GEMM kernel depends
    on it (``parallel/expert/expert_compute.py``); None for any other kind of device."""
    if device.type != "cuda":
        return None
    return _cuda_capability(device)


@functools.cache
def _cuda_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _preferences() -> tuple[str | None, ...]:
    kinds = [k for k in DEVICE_KINDS] + [b for b, _ in DEVICE_KINDS.values()]
    return (None, *kinds, HOST_KIND, HOST_BACKEND)


def _count(kind: str) -> int:
    module = getattr(torch, kind, None)
    try:
        return module.device_count() if module is not None and module.is_available() else 0
    except Exception:  # a broken driver: no devices of this kind
        return 0


_COPY_STREAMS: dict[torch.device, Any] = {}  # one side stream per device for prefetch copies


@dataclass(frozen=True)
class Accelerator:
    """The device a rank computes on and the collective backend that matches it."""

    kind: str  # "cuda", "xpu", ... or "cpu"
    device: torch.device
    backend: str  # "nccl" on cuda, "gloo" on cpu

    @classmethod
    def detect(cls, local_rank: int = 0, prefer: str | None = None) -> Accelerator:
        """Pick <kind>:<local_rank % visible devices> with its backend if a device is visible,
        else cpu/gloo.

        ``prefer`` forces a side: "cpu"/"gloo" always gives cpu (useful to test on a GPU box);
        a device kind or its backend ("cuda"/"nccl") fails loudly when no such device is
        visible, rather than silently training on CPU. The visible-devices variable is applied
        by torch itself, so with one visible device every rank of this host gets device 0.
        """
        if prefer not in _preferences():
            raise ValueError(f"prefer must be one of {_preferences()}, got {prefer!r}")
        if prefer in (HOST_KIND, HOST_BACKEND):
            return cls.host()
        for kind, (backend, env) in DEVICE_KINDS.items():
            wanted = prefer in (kind, backend)
            if prefer is not None and not wanted:
                continue
            count = _count(kind)
            if count:
                return cls(kind, torch.device(kind, local_rank % count), backend)
            if wanted:
                visible = os.environ.get(env, "<unset>")
                raise ValueError(
                    f"{prefer!r} was requested but no {kind.upper()} device is visible to this "
                    f"process ({env}={visible}); use backend 'gloo' (device 'cpu') instead."
                )
        return cls.host()

    @classmethod
    def host(cls) -> Accelerator:
        return cls(HOST_KIND, torch.device(HOST_KIND), HOST_BACKEND)

    @classmethod
    def for_backend(cls, backend: str) -> Accelerator:
        """The accelerator of an initialised process group's backend, on the current device."""
        kind = backend_device_kind(backend)
        if kind == HOST_KIND:
            return cls.host()
        return cls(kind, torch.device(kind, cls._module_of(kind).current_device()), backend)

    @staticmethod
    def _module_of(kind: str) -> Any:
        return torch.get_device_module(kind)

    @property
    def module(self) -> Any:
        """``torch.cuda`` (or the module of this kind); None for the host."""
        return None if self.kind == HOST_KIND else self._module_of(self.kind)

    @property
    def queues_work(self) -> bool:
        """Whether work on this device is queued and runs after the call returns (a GPU): then
        the host must not wait on it with a timeout, and timing needs device events."""
        return self.kind != HOST_KIND

    @property
    def pin_memory(self) -> bool:
        """Pinned host buffers only pay off when there is a device to copy them to."""
        return self.queues_work

    def bind(self) -> None:
        """Make this the current device of the process (before creating its process group)."""
        if self.module is not None:
            self.module.set_device(self.device)

    def name(self) -> str:
        return self.module.get_device_name(self.device) if self.module is not None else "cpu"

    def total_memory(self) -> int | None:
        """Bytes of device memory; None for the host (its budget is the caller's to decide)."""
        if self.module is None:
            return None
        return self.module.get_device_properties(self.device).total_memory

    def supports(self, dtype: torch.dtype) -> bool:
        """Whether this device computes in ``dtype`` natively (bf16 needs Ampere on CUDA)."""
        if dtype == torch.bfloat16 and self.module is not None:
            check = getattr(self.module, "is_bf16_supported", None)
            return bool(check()) if check is not None else True
        return True

    def memory_in_use(self) -> dict[str, int]:
        """Bytes in use now: device allocator counters (0 on the host), this process's host RSS
        and its peak RSS since start (the kernel's high-water mark)."""
        host_rss = psutil.Process().memory_info().rss
        host = {"host_rss": host_rss, "host_peak": max(host_rss, _peak_rss())}
        if self.module is None:
            return {"device_allocated": 0, "device_reserved": 0, "device_peak": 0, **host}
        return {
            "device_allocated": self.module.memory_allocated(self.device),
            "device_reserved": self.module.memory_reserved(self.device),
            "device_peak": self.module.max_memory_allocated(self.device),
            **host,
        }

    def synchronize(self) -> None:
        """Wait for queued device work. Only for measurements outside training steps
        (calibration); steps are timed with events, never by synchronizing."""
        if self.module is not None:
            self.module.synchronize(self.device)

    def event(self) -> Any:
        """A timing event on the current stream (None on the host, where work is not queued)."""
        if self.module is None:
            return None
        return self.module.Event(enable_timing=True)

    def copy_to_device_async(self, host: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Start copying pinned ``host`` to the device on a side stream, so the copy overlaps
        the compute queued on the current one; returns (device tensor, event). The side stream
        first waits for the current one (the copy must not overtake what is queued before
        it). Use the tensor only after ``wait_copy``. Only where work is queued (a GPU)."""
        module = self.module
        stream = _COPY_STREAMS.get(self.device)
        if stream is None:
            stream = _COPY_STREAMS[self.device] = module.Stream(self.device)
        stream.wait_stream(module.current_stream(self.device))
        with module.stream(stream):
            target = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            target.copy_(host, non_blocking=True)
            done = module.Event()
            done.record(stream)
        return target, done

    def wait_copy(self, target: torch.Tensor, done: Any) -> None:
        """The current stream waits (on the device, not the host) for a copy started by
        ``copy_to_device_async``; the allocator is told the tensor is used on it now."""
        current = self.module.current_stream(self.device)
        current.wait_event(done)
        target.record_stream(current)

    def device_timer(self) -> EventTimer | None:
        """Times compute regions by device events (the telemetry's ``DeviceTimer``); None on
        the host, where the wall clock times work that runs in the call."""
        return EventTimer(self) if self.queues_work else None

    # ---- random number generators ------------------------------------------------------
    def rng_states(self) -> dict[str, torch.Tensor]:
        """This process's RNG states by device kind: the host's, and the device's if used."""
        states = {HOST_KIND: torch.get_rng_state()}
        module = self.module
        if module is not None and module.is_initialized():
            states[self.kind] = module.get_rng_state()
        return states

    def set_rng_states(self, states: dict[str, torch.Tensor]) -> None:
        if HOST_KIND in states:
            torch.set_rng_state(states[HOST_KIND])
        if self.module is not None and self.kind in states:
            self.module.set_rng_state(states[self.kind])


class EventTimer:
    """A region = an event recorded at its start and one at its end, on the current stream;
    the elapsed time is read later, when the step ends."""

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator

    def start(self) -> Any:
        event = self.accelerator.event()
        event.record()
        return event

    def stop(self, start: Any) -> Any:
        end = self.accelerator.event()
        end.record()

        def seconds() -> float:
            end.synchronize()  # at the step's end: its work has normally finished already
            return start.elapsed_time(end) / 1e3

        return seconds


def _peak_rss() -> int:
    """Peak resident set size of this process in bytes (0 where the platform has no getrusage)."""
    try:
        import resource
    except ImportError:  # Windows
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor on ``device`` (tuples, lists, named tuples and dicts kept):
    data loaders yield host tensors, the model lives on the rank's GPU. A no-op on CPU ranks."""
    if isinstance(batch, torch.Tensor):
        return batch if batch.device == device else batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return type(batch)((k, to_device(v, device)) for k, v in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch
