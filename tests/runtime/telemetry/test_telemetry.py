"""Per-rank telemetry in a plain process: counters, the step-time split, rate-limited publishing.

What is protected: published figures are cumulative and add up (steps, tokens, comm per axis);
compute + communication + waiting equals each step's wall time, waiting is only what the rank
really waited (receives, barriers, collective waits beyond their best rate, marked waits) and
unmarked time is compute, also on real gloo ranks and under a real pipeline, whose last step's
timeline is published, compacted and bounded; a publisher is called at most
once per interval, only from the thread that installed it, and a run's last figures are always
flushed; a failing publisher never stops training; the FLOP estimate is 6*Psi + attention; and
the telemetry package stays importable without torch (the notebook side imports it).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import torch

from kernels_runtime.comm import CommStats
from kernels_runtime.telemetry import (
    TELEMETRY_KEY,
    Telemetry,
    model_shape,
    training_flops_per_token,
)
from kernels_runtime.telemetry.timeline import MAX_EVENTS


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Recorder:
    def __init__(self) -> None:
        self.sent: list[dict] = []

    def __call__(self, snapshot: dict) -> None:
        self.sent.append(snapshot)


def _telemetry(clock: FakeClock, stats: CommStats | None = None, **kw) -> Telemetry:
    return Telemetry(stats if stats is not None else CommStats(), clock=clock,
                     memory=lambda: {"host_rss": 1000}, **kw)


def test_step_split_is_exact_with_a_fake_clock() -> None:
    clock, stats = FakeClock(), CommStats()
    tel = _telemetry(clock, stats)
    with tel.step(tokens=64, samples=4):
        with tel.waiting():  # data loading, marked
            clock.advance(0.5)
        clock.advance(2.0)  # forward and backward, unmarked: compute
        stats.record("recv", "pp", 800, 0.75, blocked=0.75)  # a pipeline bubble: waiting
        clock.advance(0.75)
        stats.record("all_reduce", "dp", 800, 0.25, blocked=0.25)  # first seen: its transfer
        clock.advance(0.25)
    record = tel.recent[-1]
    assert (record.seconds, record.compute, record.comm, record.waiting) == (3.5, 2.0, 0.25, 1.25)
    # the next step starts where this one ended: time between steps is the next step's compute
    clock.advance(1.0)
    with tel.step(tokens=64, samples=4):
        stats.record("all_reduce", "dp", 800, 0.5, blocked=0.5)  # half the best rate: a late
        clock.advance(0.5)  # peer, 0.25 s beyond the transfer
        stats.record("barrier", "world", 0, 0.125, blocked=0.125)  # no bytes: all waiting
        clock.advance(0.125)
        with tel.waiting():
            clock.advance(0.25)
            stats.record("broadcast", "dp", 64, 0.125, blocked=0.125)  # counted once: comm
            clock.advance(0.125)
    record = tel.recent[-1]
    assert (record.seconds, record.compute, record.comm, record.waiting) == (
        2.0, 1.0, 0.375, 0.625)
    snap = tel.snapshot()
    assert snap["seconds"] == {"step": 5.5, "compute": 3.0, "comm": 0.625, "waiting": 1.875}
    assert (snap["steps"], snap["tokens"], snap["samples"]) == (2, 128, 8)
    assert snap["throughput"]["tokens_per_s"] == pytest.approx(128 / 5.5)
    assert snap["p2p_by_axis"] == {"pp": {"sent": 0, "received": 800}}


def test_a_loop_that_marks_nothing_is_compute_not_waiting() -> None:
    """The quickstart's custom loop: no region marked, one all-reduce per step."""
    stats = CommStats()
    tel = Telemetry(stats)
    for _ in range(3):
        with tel.step(tokens=10, samples=1), tel.compute():  # the marker changes nothing
            time.sleep(0.01)
            t0 = time.perf_counter()
            time.sleep(0.001)  # stands for the blocked all-reduce of the loss
            spent = time.perf_counter() - t0
            stats.record("all_reduce", "world", 8, spent, blocked=spent)
    for r in tel.recent:
        assert r.compute + r.comm + r.waiting == pytest.approx(r.seconds, abs=1e-9)
        assert r.compute > r.comm + r.waiting  # the sleeps outside the all-reduce
    seconds = tel.snapshot()["seconds"]
    parts = seconds["compute"] + seconds["comm"] + seconds["waiting"]
    assert parts == pytest.approx(seconds["step"], abs=1e-9)
    assert seconds["comm"] + seconds["waiting"] == pytest.approx(stats.blocked_seconds())


def test_pause_drops_idle_time_and_tick_starts_the_clock() -> None:
    clock = FakeClock()
    tel = _telemetry(clock)
    assert tel.tick(tokens=5) is None  # the first tick only starts the clock
    clock.advance(2.0)
    assert tel.tick(tokens=5).seconds == 2.0
    tel.pause()  # e.g. a new cell starts: the idle time must not count
    clock.advance(60.0)
    assert tel.tick(tokens=5) is None
    clock.advance(1.0)
    assert tel.tick(tokens=5).seconds == 1.0
    assert tel.snapshot()["steps"] == 2 and tel.snapshot()["tokens"] == 10


def test_a_step_that_raises_is_not_recorded() -> None:
    tel = _telemetry(FakeClock())
    with pytest.raises(ValueError), tel.step(tokens=5):
        raise ValueError("bad batch")
    assert tel.snapshot()["steps"] == 0 and not tel.splitter.open


def test_publishing_is_rate_limited_cumulative_and_flushed() -> None:
    clock, stats, sent = FakeClock(), CommStats(), Recorder()
    tel = _telemetry(clock, stats, publisher=sent, min_interval_s=0.25)
    for _ in range(100):  # 100 steps of 10 ms: 1 s, so about 4 publishes, never more than 5
        with tel.step(tokens=8, samples=2):
            stats.record("all_reduce", "dp", 100, 0.001, blocked=0.001)
            stats.record("all_gather", "tp", 10, 0.001, blocked=0.001)
            clock.advance(0.01)
    assert 4 <= len(sent.sent) <= 5
    steps = [s["steps"] for s in sent.sent]
    assert steps == sorted(steps) and steps[0] == 1  # cumulative, the first step goes out
    assert tel.flush()  # the last figures always go out at the end of a cell
    final = sent.sent[-1]
    assert (final["steps"], final["tokens"], final["samples"]) == (100, 800, 200)
    assert final["comm_by_axis"]["dp"]["bytes"] == 10_000
    assert final["comm_by_axis"]["tp"]["calls"] == 100
    assert final["comm"]["all_reduce"]["dp"]["bytes"] == 10_000
    assert final["memory"] == {"host_rss": 1000, "disk_spill": 0}
    assert len(final["recent"]) == 32 and final["recent"][-1]["step"] == 100
    assert tel.last_published is final
    assert not tel.flush()  # nothing changed: nothing to send
    tel.record_disk_spill(4096)
    assert tel.flush() and sent.sent[-1]["memory"]["disk_spill"] == 4096


def test_an_abort_that_frees_blocks_without_a_step_is_flushed() -> None:
    sent = Recorder()
    tel = _telemetry(FakeClock(), publisher=sent)
    tel.record_inference({"steps": 7, "running": 1, "waiting": 0, "blocks_used": 5,
                          "aborted": 0})
    assert tel.flush() and sent.sent[-1]["inference"]["blocks_used"] == 5
    assert not tel.flush()
    # the engine's last request aborted: no step taken, its blocks back in the pool
    tel.record_inference({"steps": 7, "running": 0, "waiting": 0, "blocks_used": 0,
                          "aborted": 1})
    assert tel.flush() and sent.sent[-1]["inference"]["blocks_used"] == 0


def test_only_the_installing_thread_publishes() -> None:
    sent = Recorder()
    tel = _telemetry(FakeClock(), publisher=sent)
    other = threading.Thread(target=lambda: tel.tick(tokens=1) or tel.tick(tokens=1))
    other.start()
    other.join()
    assert sent.sent == []  # skipped off-thread; the figures are cumulative, nothing is lost
    assert tel.flush() and sent.sent[-1]["steps"] == 1


def test_a_failing_publisher_never_stops_training() -> None:
    def broken(snapshot: dict) -> None:
        raise OSError("socket closed")

    clock = FakeClock()
    tel = _telemetry(clock, publisher=broken)
    for _ in range(3):
        tel.tick(tokens=1)
        clock.advance(1.0)
    assert tel.publisher.errors == 2 and "socket closed" in tel.publisher.last_error
    assert tel.snapshot()["publish_errors"] == 2


def test_flops_are_six_psi_plus_attention() -> None:
    assert training_flops_per_token(1000) == 6000
    assert training_flops_per_token(1000, n_layers=2, hidden=8, seq_len=16) == 6000 + 12 * 256
    model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64))
    n_params = 64 * 32 + 32 * 64 + 64
    assert model_shape(model) == (n_params, None, None)
    tel = Telemetry()
    assert tel.model_flops(model, tokens=10) == 10 * 6 * n_params
    tel.flops_per_token = 5.0  # a caller who knows better overrides the estimate
    assert tel.model_flops(model, tokens=10) == 50.0


def test_telemetry_imports_without_torch() -> None:
    code = ("import sys, kernels_runtime.telemetry as t, workbench.ui.dashboard.history; "
            "assert 'torch' not in sys.modules, 'torch imported'; print(t.TELEMETRY_KEY)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == TELEMETRY_KEY


def test_a_timeline_is_published_compacted_and_bounded() -> None:
    tel = _telemetry(FakeClock())
    events = [{"kind": "F" if i % 2 else "B", "chunk": 0, "mb": i, "stage": 1,
               "start": i / 3, "end": i / 3 + 0.1234567, "wait": 1 / 7, "extra": "dropped"}
              for i in range(300)]
    tel.record_pipeline({"schedule": "1f1b", "stage": 1, "stages": 2, "chunks": 1,
                         "microbatches": 300, "step_seconds": 100.0, "waited_seconds": 42.0,
                         "bubble": 0.42, "p2p_bytes": 4096, "deferred_weight_grads": 0,
                         "events": events})
    published = tel.snapshot()["pipeline"]
    assert published["step"] == 1  # the step now running: the executor records inside it
    assert len(published["events"]) == MAX_EVENTS and published["events_dropped"] == 300 - 256
    assert published["events"][3] == {"kind": "F", "chunk": 0, "mb": 3, "stage": 1,
                                      "start": 1.0, "end": 1.123457, "wait": 0.142857}
    assert (published["bubble"], published["p2p_bytes"]) == (0.42, 4096)
    tel.pause()  # a new cell: its dashboard shows no pipeline unless it runs one
    assert tel.snapshot()["pipeline"] is None


def _blocked_by_op(stats: CommStats) -> dict[str, float]:
    out: dict[str, float] = {}
    for op, groups in stats.snapshot().items():
        out[op] = sum(c["blocked"] for c in groups.values())
    return out


def _pipeline_rank(rank: int, world: int) -> dict:
    """Three 1f1b steps of a small nn.Sequential over two stages, as in the pipeline tests;
    per step, this rank's split and the blocked seconds its collectives counted."""
    from torch import nn

    from kernels_runtime import parallelize, train_step

    from helpers.distributed import context

    ctx = context("pp=2 mb=4 pp_schedule=1f1b")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 2))
    model, opt = parallelize(model, torch.optim.SGD(model.parameters(), lr=0.1), ctx=ctx,
                             verbose=False)
    tel, stats = ctx.telemetry, ctx.comm.stats
    tel.pause()
    steps = []
    for step in range(3):
        before = _blocked_by_op(stats)
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)
        train_step(model, opt, list(zip(x.chunk(4), y.chunk(4))),
                   lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]))
        after = _blocked_by_op(stats)
        delta = {op: after[op] - before.get(op, 0.0) for op in after}
        steps.append({"record": tel.recent[-1], "blocked": sum(delta.values()),
                      "recv": delta.get("recv", 0.0)})
    return {"steps": steps, "published": tel.snapshot()["pipeline"],
            "raw": model.parallel_state.schedule.last_timeline, "stage": ctx.coord("pp")}


def test_a_real_pipeline_publishes_its_timeline_and_its_bubble_is_waiting(ranks) -> None:
    results = ranks(2).run(_pipeline_rank, timeout_s=120)
    for rank, result in enumerate(results):
        published, raw = result["published"], result["raw"]
        assert published["stage"] == result["stage"] == rank and published["stages"] == 2
        assert published["schedule"] == "1f1b" and published["microbatches"] == 4
        assert published["step"] == result["steps"][-1]["record"].step
        kinds = sorted((e["kind"], e["mb"]) for e in published["events"])
        assert kinds == sorted((k, mb) for k in "FB" for mb in range(4))
        assert published["events"] == [
            {k: round(e[k], 6) if k in ("start", "end", "wait") else e[k]
             for k in ("kind", "chunk", "mb", "stage", "start", "end", "wait")}
            for e in raw["events"]]
        assert published["p2p_bytes"] == raw["p2p_bytes"] > 0
        for step in result["steps"]:
            r = step["record"]
            assert r.compute + r.comm + r.waiting == pytest.approx(r.seconds, abs=1e-9)
            # nothing is marked: waiting and communication are exactly the blocked seconds,
            # every receive's wait is waiting, and the rest of the step is compute
            assert r.comm + r.waiting == pytest.approx(step["blocked"], abs=1e-9)
            assert r.waiting >= step["recv"] - 1e-9
            assert r.compute == pytest.approx(r.seconds - step["blocked"], abs=1e-9)


def test_offload_figures_are_published_cumulative():
    from kernels_runtime.telemetry import Telemetry

    tel = Telemetry(memory=lambda: {"host_rss": 1})
    assert tel.snapshot()["offload"] is None
    tel.record_offload({"device": 10, "host": 20, "disk": 30}, {"device->host": 5}, 2, 0.5)
    tel.record_offload({"device": 10, "host": 25, "disk": 40}, {"device->host": 5,
                                                                 "host->disk": 7}, 3, 0.25)
    snap = tel.snapshot()
    assert snap["offload"]["moved"] == {"device->host": 10, "host->disk": 7}
    assert (snap["offload"]["evictions"], snap["offload"]["wait_seconds"]) == (5, 0.75)
    assert snap["offload"]["last_step"]["evictions"] == 3 and snap["offload"]["steps"] == 2
    assert snap["memory"]["disk_spill"] == 40  # the disk tier's model state, now
