"""One rank's telemetry: memory per tier, communication, throughput, the step-time split and
the last pipeline step's timeline.

The notebook polls ranks through ipyparallel's datapub, which keeps only the latest value per
key, so everything published is cumulative (a lost or repeated reading costs nothing and rates
are differences) plus a short rolling window of the most recent steps. The snapshot, one dict
published under ``TELEMETRY_KEY``::

    seq, time                                   publish counter, wall clock (time.time())
    steps, tokens, samples, flops               cumulative, counted by this rank
    seconds: {step, compute, comm, waiting}     cumulative; definitions in ``split.py``
    throughput: {samples_per_s, tokens_per_s, flops_per_s, steps}   over the recent window
    memory: {device_allocated, device_reserved, device_peak,        bytes now (device tier),
             host_rss, host_peak, disk_spill}                       host tier, disk tier
    comm: {op: {group: {calls, bytes, seconds, blocked}}}           ``CommStats``, cumulative
    comm_by_axis: {group: {calls, bytes, seconds, blocked}}         the same, summed over ops
    p2p_by_axis: {group: {sent, received}}      point-to-point bytes (ops send, recv), cumulative
    recent: [{step, seconds, compute, comm, waiting, tokens, samples, flops}, ...]
    pipeline: the last pipeline step's timeline (``timeline.py``), or None: none in this cell
    offload: {tiers: {device, host, disk},      model-state bytes resident per tier now
              moved: {"device->host": ...},     bytes moved between tiers, cumulative
              evictions, wait_seconds, steps,   cumulative; per step: differences
              last_step: {moved, evictions, wait_seconds}}   or None: no offloading model
    curves: {steps, skipped, train, eval}       this cell's training curves (``curves.py``),
                                                or None: no train_step/eval_step in this cell
    inference: {steps, requests, finished,      an inference engine's figures (``Engine.stats``):
                generated_tokens, prompt_tokens, cumulative counts;
                running, waiting, swapped,      the queue now;
                blocks_total, blocks_used,      its paged KV cache now (blocks of block_size
                blocks_free, blocks_shared,     tokens; shared: held by several requests)
                block_size, preemptions, ...}   or None: no engine stepped in this cell
    expert_load: {step, layers, counts,         tokens this rank routed to each expert of each
                  tokens, imbalance}            MoE layer in the last step (``expert_load.py``),
                                                or None: no expert-parallel step in this cell

Group names are the mesh axes (dp, pp, sp, tp) or "world". Tokens and samples are this rank's
own (its data-parallel shard), so FLOP/s is this rank's achieved model FLOP/s.

No torch here: the memory probe and the ``CommStats`` are injected, so the notebook side can
import the schema, and the class is testable in a plain process.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from kernels_runtime.telemetry.curves import TrainingCurves
from kernels_runtime.telemetry.expert_load import ExpertLoad
from kernels_runtime.telemetry.flops import model_shape, training_flops_per_token
from kernels_runtime.telemetry.publisher import Publisher, Send
from kernels_runtime.telemetry.split import StepSplitter
from kernels_runtime.telemetry.timeline import compact_timeline

TELEMETRY_KEY = "colossal_telemetry"
# what of an inference engine's figures makes a flush publish: its steps, and the queue and KV
# blocks, which an abort changes without a step
INFERENCE_STATE = ("steps", "running", "waiting", "swapped", "blocks_used", "aborted")
MemoryProbe = Callable[[], dict[str, int]]
P2P_OPS = {"send": "sent", "recv": "received"}


@dataclass(frozen=True)
class StepRecord:
    step: int  # 1-based index among this rank's recorded steps
    seconds: float
    compute: float
    comm: float
    waiting: float
    tokens: int
    samples: int
    flops: float


def host_memory() -> dict[str, int]:
    """The default probe: this process's RSS; no device tier (a CPU rank's device is RAM)."""
    import psutil

    rss = psutil.Process().memory_info().rss
    return {"device_allocated": 0, "device_reserved": 0, "device_peak": 0,
            "host_rss": rss, "host_peak": rss}


class Telemetry:
    """Counters and samples of one rank; see the module docstring for what is published.

    ``comm_stats`` is the rank's ``CommStats`` (duck-typed: ``snapshot()``, ``totals()``).
    Record steps with ``with telemetry.step(tokens=..., samples=...):`` around each step, or
    ``telemetry.tick(tokens=..., samples=...)`` once at the end of each (the first tick after
    a pause only starts the clock); ``train_step`` does it by itself.
    Time is compute unless the collectives or ``with telemetry.waiting():`` say otherwise.
    """

    def __init__(
        self,
        comm_stats: Any = None,
        *,
        memory: MemoryProbe | None = None,
        publisher: Send | None = None,
        min_interval_s: float = 0.25,
        window: int = 32,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.comm_stats = comm_stats
        self.memory = memory or host_memory
        self.flops_per_token: float | None = None  # set to override the model-based estimate
        self.disk_spill_bytes = 0
        self.splitter = StepSplitter(self._counters, clock)
        self.publisher = Publisher(publisher, min_interval_s, clock)
        self.recent: deque[StepRecord] = deque(maxlen=window)
        self.last_published: dict[str, Any] | None = None
        self.pipeline: dict[str, Any] | None = None  # the last pipeline step's, compacted
        self.offload: dict[str, Any] | None = None  # placement figures (``record_offload``)
        self.inference: dict[str, Any] | None = None  # an engine's figures (``record_inference``)
        self.curves = TrainingCurves()  # train_step's and eval_step's results (``record_train``)
        self.expert_load = ExpertLoad()  # MoE layers record into it; committed at each tick
        self._totals = dict.fromkeys(("steps", "tokens", "samples", "flops"), 0)
        self._seconds = dict.fromkeys(("step", "compute", "comm", "waiting"), 0.0)
        self._models: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._published_state: tuple | None = None

    def configure(self, *, memory: MemoryProbe | None = None, device_timer: Any = None) -> None:
        """Install the rank's memory probe (the session does, from its accelerator).

        ``device_timer`` is accepted and unused: compute is no longer timed by regions."""
        if memory is not None:
            self.memory = memory

    def set_publisher(self, send: Send | None) -> None:
        """Publish through ``send`` (e.g. datapub) from now on, from the calling thread only."""
        self.publisher.install(send)

    # ---- recording ----------------------------------------------------------------------
    def compute(self) -> contextlib.AbstractContextManager[None]:
        """Marks compute for the reader only: compute is what is neither communication nor
        waiting, so unmarked time already counts as compute (``split.py``)."""
        return contextlib.nullcontext()

    def waiting(self) -> contextlib.AbstractContextManager[None]:
        """``with telemetry.waiting():`` around a wait the collectives cannot see, such as
        fetching the next batch: that time counts as waiting, not compute."""
        return self.splitter.waiting()

    def record_pipeline(self, timeline: dict[str, Any]) -> None:
        """The pipeline executor's timeline of the step now running (``timeline.py``)."""
        self.pipeline = compact_timeline(timeline, step=self._totals["steps"] + 1)

    @contextlib.contextmanager
    def step(self, tokens: int = 0, samples: int = 0,
             flops: float | None = None) -> Iterator[None]:
        """One training step around the block; a step that raises is not recorded."""
        self.splitter.begin()
        self.expert_load.begin_step()
        try:
            yield
        except BaseException:
            self.splitter.pause()
            raise
        self.tick(tokens, samples, flops)

    def tick(self, tokens: int = 0, samples: int = 0,
             flops: float | None = None) -> StepRecord | None:
        """A step ended now; it began where the previous one ended. The first tick after a
        pause only starts the clock and returns None. ``flops`` defaults to ``tokens *
        flops_per_token`` when that is set, else 0."""
        self.expert_load.end_step()  # the routing counted since the last tick is this step's
        timing = self.splitter.end()
        if timing is None:
            self.splitter.begin()
            return None
        if flops is None:
            flops = tokens * self.flops_per_token if self.flops_per_token else 0.0
        t = self._totals
        t["steps"] += 1
        t["tokens"] += tokens
        t["samples"] += samples
        t["flops"] += flops
        record = StepRecord(t["steps"], timing.seconds, timing.compute, timing.comm,
                            timing.waiting, tokens, samples, flops)
        for key, value in (("step", timing.seconds), ("compute", timing.compute),
                           ("comm", timing.comm), ("waiting", timing.waiting)):
            self._seconds[key] += value
        self.recent.append(record)
        self.maybe_publish()
        return record

    def pause(self) -> None:
        """Time from now until the next step begins belongs to no step (idle between cells,
        evaluation); it also starts a new throughput window and forgets the pipeline
        timeline and the inference figures (a cell without a pipeline or an engine shows
        none)."""
        self.splitter.pause()
        self.expert_load.begin_step()
        self.recent.clear()
        self.pipeline = None
        self.inference = None

    def new_cell(self) -> None:
        """A notebook cell starts (the engine's pre-run hook): ``pause``, and the training
        curves start again at step 1 and the expert load empties, so each cell's curve and
        heatmap are its own run's."""
        self.pause()
        self.curves.new_cell()
        self.expert_load.new_cell()

    def record_train(self, loss: float, stepped: bool, grad_norm: float | None,
                     lr: float | None = None, loss_scale: float | None = None) -> None:
        """A training step's result (``train_step``'s ``StepResult``, its optimizer's LR and
        loss scale), published with the next snapshot."""
        self.curves.record_train(loss, stepped, grad_norm, lr, loss_scale)

    def record_eval(self, loss: float) -> None:
        """An ``eval_step``'s loss; published with the next snapshot (forced at the cell's
        end by ``flush``)."""
        self.curves.record_eval(loss)

    def record_offload(self, tiers: dict[str, int], moved: dict[str, int], evictions: int,
                       wait_seconds: float) -> None:
        """One offloading step's placement figures: model-state bytes per tier after it, and
        what it moved (bytes per "from->to"), how many payloads it evicted a tier down and how
        long the step waited for movement. Kept cumulative, like everything published."""
        previous = self.offload or {"moved": {}, "evictions": 0, "wait_seconds": 0.0,
                                    "steps": 0}
        total = dict(previous["moved"])
        for pair, nbytes in moved.items():
            total[pair] = total.get(pair, 0) + nbytes
        self.offload = {"tiers": dict(tiers), "moved": total,
                        "evictions": previous["evictions"] + evictions,
                        "wait_seconds": previous["wait_seconds"] + wait_seconds,
                        "steps": previous["steps"] + 1,
                        "last_step": {"moved": dict(moved), "evictions": evictions,
                                      "wait_seconds": wait_seconds}}
        self.disk_spill_bytes = int(tiers.get("disk", 0))

    def record_inference(self, figures: dict[str, Any]) -> None:
        """An inference engine's figures after a step (cumulative counts, the queue and KV
        blocks now); published with the next snapshot."""
        self.inference = dict(figures)

    def record_disk_spill(self, nbytes: int) -> None:
        """Offload code reports bytes written to (positive) or freed from (negative) disk."""
        self.disk_spill_bytes += nbytes

    def model_flops(self, model: Any, tokens: int, seq_len: int | None = None) -> float:
        """FLOPs of training ``model`` on ``tokens`` tokens: ``tokens * flops_per_token`` when
        set, else the 6*Psi (+ attention) estimate of ``flops.py``, cached per model."""
        if self.flops_per_token:
            return tokens * self.flops_per_token
        shape = self._models.get(model)
        if shape is None:
            shape = self._models[model] = model_shape(model)
        n_params, layers, hidden = shape
        per_token = training_flops_per_token(n_params, n_layers=layers, hidden=hidden,
                                             seq_len=seq_len)
        return tokens * per_token

    # ---- reading and publishing ---------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """The current figures as plain Python values (picklable, JSON-able)."""
        comm = self.comm_stats.snapshot() if self.comm_stats is not None else {}
        by_axis: dict[str, dict[str, float]] = {}
        p2p: dict[str, dict[str, float]] = {}
        for op, groups in comm.items():
            for group, counters in groups.items():
                into = by_axis.setdefault(group, dict.fromkeys(counters, 0))
                for k, v in counters.items():
                    into[k] += v
                if op in P2P_OPS:
                    p2p.setdefault(group, {"sent": 0, "received": 0})[P2P_OPS[op]] += \
                        counters.get("bytes", 0)
        window = list(self.recent)
        seconds = sum(r.seconds for r in window)

        def rate(key: str) -> float:
            return sum(getattr(r, key) for r in window) / seconds if seconds > 0 else 0.0

        memory = dict(self.memory())
        memory["disk_spill"] = self.disk_spill_bytes
        return {
            "seq": self.publisher.sent, "time": time.time(), **self._totals,
            "seconds": dict(self._seconds),
            "throughput": {"samples_per_s": rate("samples"), "tokens_per_s": rate("tokens"),
                           "flops_per_s": rate("flops"), "steps": len(window)},
            "memory": memory, "comm": comm, "comm_by_axis": by_axis, "p2p_by_axis": p2p,
            "recent": [asdict(r) for r in window], "pipeline": self.pipeline,
            "offload": self.offload, "inference": self.inference,
            "curves": self.curves.block(), "expert_load": self.expert_load.block(),
            "publish_errors": self.publisher.errors,
        }

    def maybe_publish(self, force: bool = False) -> bool:
        """Publish a snapshot if the publisher is due (or ``force``); True if it went out."""
        if not (force and self.publisher.active) and not self.publisher.due():
            return False
        snap = self.snapshot()
        if not self.publisher.publish(snap, force=force):
            return False
        self.last_published = snap
        self._published_state = self._state()
        return True

    def flush(self) -> bool:
        """Publish now if anything changed since the last publish (the engine calls this at
        the end of every cell, so the last figures of a run always reach the notebook)."""
        if self._state() == self._published_state:
            return False
        return self.maybe_publish(force=True)

    def _state(self) -> tuple:
        calls = self.comm_stats.totals()["calls"] if self.comm_stats is not None else 0
        offloaded = self.offload["steps"] if self.offload else 0
        # an abort frees blocks without a step: the queue and the blocks count as a change
        inferred = tuple(self.inference.get(k) for k in INFERENCE_STATE) if self.inference \
            else ()
        return (self._totals["steps"], calls, self.disk_spill_bytes, offloaded, inferred,
                self.curves.state(), self.expert_load.steps)

    def _counters(self) -> dict[tuple[str, str], tuple[float, float]]:
        """(op, group) -> cumulative (bytes, blocked seconds), what the step split reads."""
        if self.comm_stats is None:
            return {}
        return {(op, group): (c["bytes"], c["blocked"])
                for op, groups in self.comm_stats.snapshot().items()
                for group, c in groups.items()}
