"""The communication layer on real gloo process groups, one process per rank.

What is protected: every collective computes what a single process computes from all ranks'
inputs; the stats count calls and bytes per op and per named group; a collective that one rank
skips fails within the timeout on the others instead of hanging the notebook, and the group can
then be re-created in the same processes; the accelerator choice on a GPU-less machine.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.testing import assert_close

from kernels_runtime.comm import (
    Accelerator,
    Collectives,
    CollectiveTimeoutError,
    CommStats,
    find_free_port,
    init_distributed,
)

from helpers.distributed import run_ranks
from helpers.tier_guard import on_ranks

CHUNK = 3  # elements per rank in the scattered / gathered layouts


def _input(rank: int, world_size: int) -> torch.Tensor:
    """What `rank` contributes: distinct per rank, so a value from the wrong rank shows up."""
    return torch.arange(CHUNK * world_size, dtype=torch.float32) + 100 * rank  # (ws * CHUNK,)


def _dp_members(world_size: int) -> list[list[int]]:
    """Data-parallel subgroups: same-parity ranks at 4 ranks, everyone at 2."""
    if world_size >= 4:
        return [list(range(parity, world_size, 2)) for parity in (0, 1)]
    return [list(range(world_size))]


def _every_collective(rank: int, world_size: int) -> dict:
    """Run each op once on the world group (twice for all_reduce, reduce_scatter), then on "dp"."""
    coll = Collectives(timeout_s=20.0)
    x = _input(rank, world_size)
    out = {
        "all_reduce": coll.all_reduce(x.clone()),
        "all_reduce_max": coll.all_reduce(x.clone(), op=dist.ReduceOp.MAX),
        "all_gather": coll.all_gather(torch.empty(world_size * x.numel()), x),
        "reduce_scatter": coll.reduce_scatter(torch.empty(CHUNK), x),
        "broadcast": coll.broadcast(x.clone(), src=world_size - 1),
        "all_to_all": coll.all_to_all(torch.empty_like(x), x),
    }
    coll._native_reduce_scatter["gloo"] = False  # force the all_reduce + slice fallback
    out["reduce_scatter_fallback"] = coll.reduce_scatter(torch.empty(CHUNK), x)
    peer, received = rank ^ 1, torch.empty_like(x)
    if rank % 2 == 0:
        coll.send(x, dst=peer)
        coll.recv(received, src=peer)
    else:
        coll.recv(received, src=peer)
        coll.send(x, dst=peer)
    out["recv"] = received
    coll.barrier()
    groups = [dist.new_group(members) for members in _dp_members(world_size)]  # all ranks call
    dp = next(g for g, m in zip(groups, _dp_members(world_size)) if rank in m)
    coll.name_group(dp, "dp")
    out["dp_all_reduce"] = coll.all_reduce(x.clone(), group=dp)
    last_member = dist.get_process_group_ranks(dp)[-1]  # a global rank, as broadcast expects
    out["dp_broadcast"] = coll.broadcast(x.clone(), src=last_member, group=dp)
    out["stats"] = coll.stats.snapshot()
    return out


@pytest.fixture(scope="module")
def every_collective_results() -> Callable[[int], list[dict]]:
    """Each world size is spawned once and shared by the tests that read its results."""
    cache: dict[int, list[dict]] = {}

    def results(world_size: int) -> list[dict]:
        if world_size not in cache:
            cache[world_size] = run_ranks(_every_collective, world_size)
        return cache[world_size]

    return results


@pytest.mark.parametrize("world_size", [2, on_ranks(4)])
def test_collectives_match_single_process_reference(
    world_size: int, every_collective_results: Callable[[int], list[dict]]
) -> None:
    results = every_collective_results(world_size)
    inputs = [_input(r, world_size) for r in range(world_size)]
    total = torch.stack(inputs).sum(0)
    for rank, out in enumerate(results):
        members = next(m for m in _dp_members(world_size) if rank in m)
        assert_close(out["all_reduce"], total)
        assert_close(out["all_reduce_max"], torch.stack(inputs).amax(0))
        assert_close(out["all_gather"], torch.cat(inputs))
        assert_close(out["reduce_scatter"], total.chunk(world_size)[rank])
        assert_close(out["reduce_scatter_fallback"], total.chunk(world_size)[rank])
        assert_close(out["broadcast"], inputs[world_size - 1])
        expected_a2a = torch.cat([inputs[src].chunk(world_size)[rank] for src in range(world_size)])
        assert_close(out["all_to_all"], expected_a2a)
        assert_close(out["recv"], inputs[rank ^ 1])
        assert_close(out["dp_all_reduce"], torch.stack([inputs[m] for m in members]).sum(0))
        assert_close(out["dp_broadcast"], inputs[members[-1]])


def test_stats_count_calls_and_bytes_per_op_and_group(
    every_collective_results: Callable[[int], list[dict]],
) -> None:
    world_size = 2
    stats = every_collective_results(world_size)[0]["stats"]
    nbytes = CHUNK * world_size * 4  # one float32 input
    expected = {
        ("all_reduce", "world"): (2, 2 * nbytes),  # the fallback is not counted as all_reduce
        ("all_gather", "world"): (1, nbytes),
        ("reduce_scatter", "world"): (2, 2 * nbytes),  # native and fallback count alike
        ("broadcast", "world"): (1, nbytes),
        ("all_to_all", "world"): (1, nbytes),
        ("send", "world"): (1, nbytes),
        ("recv", "world"): (1, nbytes),
        ("barrier", "world"): (1, 0),
        ("all_reduce", "dp"): (1, nbytes),
        ("broadcast", "dp"): (1, nbytes),
    }
    counted = {(op, g): (c["calls"], c["bytes"]) for op, gs in stats.items() for g, c in gs.items()}
    assert counted == expected
    assert all(c["seconds"] > 0 for gs in stats.values() for c in gs.values())
    # blocked time (the step split's communication) is part of the op's time
    assert all(0 < c["blocked"] <= c["seconds"] for gs in stats.values() for c in gs.values())


def _skip_then_recreate(rank: int, world_size: int, ports: list[int], events: list) -> dict:
    """Rank 1 skips an all_reduce twice; each time rank 0 must time out, then all re-create.

    Phase 0: op-level timeout 3 s, group timeout 30 s (run_ranks' default): `wait` fires.
    Phase 1: op-level timeout 60 s, group re-created with 3 s: the smaller, the group's, applies.
    """
    outcome: dict = {}
    for phase, op_timeout_s in enumerate([3.0, 60.0]):
        if rank == 0:
            start = time.monotonic()
            try:
                Collectives(timeout_s=op_timeout_s).all_reduce(torch.ones(4))
            except CollectiveTimeoutError as err:
                outcome[phase] = (time.monotonic() - start, err)
            events[phase].set()
        else:
            events[phase].wait(timeout=60)  # stay alive: a dead peer is a different failure
        # re-create the broken group in the same processes, as the pool does
        init_distributed(rank, world_size, "127.0.0.1", ports[phase], timeout_s=3.0)
    outcome["after"] = Collectives().all_reduce(torch.full((4,), rank + 1.0))
    return outcome


@pytest.mark.slow  # ~10 s: waits out a real collective timeout
def test_skipped_collective_times_out_and_group_can_be_recreated() -> None:
    ctx = mp.get_context("spawn")
    events = [ctx.Event(), ctx.Event()]
    ports = [find_free_port(), find_free_port()]
    start = time.monotonic()
    outcome = run_ranks(_skip_then_recreate, 2, ports, events, timeout_s=60.0)[0]
    for phase in (0, 1):
        assert phase in outcome, f"phase {phase}: rank 0 did not raise CollectiveTimeoutError"
        elapsed, err = outcome[phase]
        assert (err.op, err.group, err.timeout_s) == ("all_reduce", "world", 3.0)
        assert "all_reduce on process group 'world' did not complete within 3.0 s" in str(err)
        assert 2.5 < elapsed < 3.0 + 5.0
    assert_close(outcome["after"], torch.full((4,), 3.0))
    assert time.monotonic() - start < 40.0  # nothing waited out the 30 s group timeout


def _fail_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("rank one is broken")
    return rank


def test_run_ranks_reports_the_failing_rank_traceback() -> None:
    with pytest.raises(AssertionError) as info:
        run_ranks(_fail_on_rank_one, 2)
    assert "--- rank 1 ---" in str(info.value)
    assert "ValueError: rank one is broken" in str(info.value)
    assert "--- rank 0 ---" not in str(info.value)


def _hang_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        time.sleep(600)
    return rank


@pytest.mark.slow  # waits out a timeout (~6 s): make test, not the inner loop
def test_run_ranks_kills_a_hanging_rank_at_its_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(AssertionError, match="rank 1 did not finish in time and was killed"):
        run_ranks(_hang_on_rank_one, 2, timeout_s=6.0)
    assert time.monotonic() - start < 6.0 + 10.0


def test_collective_timeout_error_survives_pickling() -> None:
    err = pickle.loads(pickle.dumps(CollectiveTimeoutError("barrier", "dp", 5.0, "boom")))
    assert (err.op, err.group, err.timeout_s) == ("barrier", "dp", 5.0)
    assert "re-create it" in str(err) and "boom" in str(err)


def test_stats_are_cumulative_and_thread_safe() -> None:
    stats = CommStats()

    def record_many() -> None:
        for _ in range(1000):
            stats.record("all_reduce", "dp", 8, 0.001)

    threads = [threading.Thread(target=record_many) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stats.record("barrier", "world", 0, 0.5, blocked=0.5)
    assert stats.snapshot()["all_reduce"]["dp"] == pytest.approx(
        {"calls": 4000, "bytes": 32000, "seconds": 4.0, "blocked": 0.0}
    )
    assert stats.totals() == pytest.approx(
        {"calls": 4001, "bytes": 32000, "seconds": 4.5, "blocked": 0.5})
    assert stats.blocked_seconds() == 0.5
    stats.reset()
    assert stats.snapshot() == {} and stats.totals()["calls"] == 0
    assert stats.blocked_seconds() == 0.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the GPU-less behaviour")
def test_accelerator_without_gpu_is_cpu_gloo() -> None:
    accelerator = Accelerator.detect(local_rank=3)
    assert (accelerator.kind, accelerator.backend) == ("cpu", "gloo")
    assert accelerator.device == torch.device("cpu") and not accelerator.pin_memory
    accelerator.synchronize()
    memory = accelerator.memory_in_use()
    assert set(memory) == {"device_allocated", "device_reserved", "device_peak", "host_rss",
                           "host_peak"}
    assert all(isinstance(v, int) for v in memory.values()) and memory["host_rss"] > 0
    assert memory["device_allocated"] == memory["device_reserved"] == memory["device_peak"] == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the GPU-less behaviour")
@pytest.mark.parametrize("prefer", ["cuda", "nccl"])
def test_asking_for_cuda_without_gpu_raises(prefer: str) -> None:
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        Accelerator.detect(prefer=prefer)
    with pytest.raises(ValueError, match="gloo"):  # before any rendezvous is attempted
        init_distributed(0, 1, "127.0.0.1", find_free_port(), backend=prefer)


def _ring_exchange(rank: int, world_size: int) -> dict:
    """Every rank sends to the next and receives from the previous, all at once (batched), then
    the same pairwise with separate asynchronous sends and receives."""
    coll = Collectives(timeout_s=20.0)
    nxt, prev = (rank + 1) % world_size, (rank - 1) % world_size
    mine = _input(rank, world_size)
    got = torch.empty_like(mine)
    for op in coll.batch_p2p([("send", mine, nxt), ("recv", got, prev)]):
        op.wait()
    back = torch.empty_like(mine)
    ops = [coll.irecv(back, nxt), coll.isend(got, prev)]  # return the received tensor
    for op in ops:
        op.wait()
    return {"got": got, "back": back, "stats": coll.stats.snapshot()}


@pytest.mark.slow  # 4 ranks
def test_batched_and_asynchronous_point_to_point(ranks) -> None:
    world = 4
    for rank, result in enumerate(ranks(world).run(_ring_exchange)):
        assert_close(result["got"], _input((rank - 1) % world, world))
        assert_close(result["back"], _input(rank, world))  # went round and came back
        nbytes = CHUNK * world * 4
        assert result["stats"]["send"]["world"] == {**result["stats"]["send"]["world"],
                                                    "calls": 2, "bytes": 2 * nbytes}
        assert result["stats"]["recv"]["world"]["calls"] == 2


def test_batch_p2p_refuses_unknown_kinds() -> None:
    with pytest.raises(ValueError, match="'send'\\|'recv'"):
        Collectives().batch_p2p([("broadcast", torch.ones(1), 0)])
