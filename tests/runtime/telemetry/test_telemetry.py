"""Per-rank telemetry in a plain process: counters, the step-time split, rate-limited publishing.

What is protected: published figures are cumulative and add up (steps, tokens, comm per axis);
compute + communication + waiting equals each step's wall time; a publisher is called at most
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
        clock.advance(0.5)  # data loading: waiting
        with tel.compute():
            clock.advance(2.0)
            stats.record("reduce_scatter", "dp", 800, 0.9, blocked=0.75)  # waited in backward
            clock.advance(0.75)
        stats.record("all_reduce", "dp", 4, 0.25, blocked=0.25)  # loss all-reduce
        clock.advance(0.25)
    record = tel.recent[-1]
    assert (record.seconds, record.compute, record.comm, record.waiting) == (3.5, 2.0, 1.0, 0.5)
    # the next step starts where this one ended: time between steps is the next step's waiting
    clock.advance(1.0)
    with tel.step(tokens=64, samples=4), tel.compute():
        clock.advance(1.0)
    record = tel.recent[-1]
    assert (record.seconds, record.compute, record.comm, record.waiting) == (2.0, 1.0, 0.0, 1.0)
    snap = tel.snapshot()
    assert snap["seconds"] == {"step": 5.5, "compute": 3.0, "comm": 1.0, "waiting": 1.5}
    assert (snap["steps"], snap["tokens"], snap["samples"]) == (2, 128, 8)
    assert snap["throughput"]["tokens_per_s"] == pytest.approx(128 / 5.5)


def test_step_split_adds_up_on_the_wall_clock() -> None:
    stats = CommStats()
    tel = Telemetry(stats)
    for _ in range(3):
        with tel.step(tokens=10, samples=1):
            time.sleep(0.01)
            with tel.compute():
                time.sleep(0.02)
                t0 = time.perf_counter()
                time.sleep(0.01)  # stands for a blocked collective wait inside backward
                stats.record("all_reduce", "dp", 8, time.perf_counter() - t0,
                             blocked=time.perf_counter() - t0)
    for r in tel.recent:
        assert r.compute + r.comm + r.waiting == pytest.approx(r.seconds, abs=1e-9)
        assert r.compute >= 0.015 and r.comm >= 0.009 and r.waiting >= 0.009
    seconds = tel.snapshot()["seconds"]
    parts = seconds["compute"] + seconds["comm"] + seconds["waiting"]
    assert parts == pytest.approx(seconds["step"], abs=1e-9)


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
    code = ("import sys, kernels_runtime.telemetry as t, workbench.dashboard.history; "
            "assert 'torch' not in sys.modules, 'torch imported'; print(t.TELEMETRY_KEY)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == TELEMETRY_KEY
