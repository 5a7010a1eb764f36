"""The block bookkeeping under random traffic, without a model: a simulated cache records, for
every slot, which prefix's key it holds (a key at position p depends on tokens 0..p), and every
step's copy-on-write copies, moves, swaps and writes are applied to it as the engine applies them
to the real cache. After every step, every running request must find its own keys in its blocks,
and the pool's counts must add up. Small pools force preemption; shared system prompts force
prefix sharing; long runs fragment the pool so scattered sequences are moved.
"""

from __future__ import annotations

import random

import pytest

from kernels_runtime.inference.blocks import BlockPool
from kernels_runtime.inference.params import SamplingParams
from kernels_runtime.inference.scheduler import Scheduler
from kernels_runtime.inference.sequence import Sequence

BS = 4


class FakeCache:
    def __init__(self, blocks: int) -> None:
        self.slots = [[None] * BS for _ in range(blocks)]

    def apply(self, step) -> None:
        for seq, blocks in step.swap_out:
            seq.swapped_out = [list(self.slots[b]) for b in blocks]
        saved = {src: list(self.slots[src]) for src, _ in step.copies}  # reads before writes
        for src, dst in step.copies:
            self.slots[dst] = list(saved[src])
        for seq, blocks in step.swap_in:
            for b, content in zip(blocks, seq.swapped_out):
                self.slots[b] = list(content)
            seq.swapped_out = None
        for seq, n in step.chunks:  # the forward writes the chunk's keys
            for p in range(seq.computed, seq.computed + n):
                self.slots[seq.blocks[p // BS]][p % BS] = tuple(seq.tokens[:p + 1])

    def check(self, seq: Sequence) -> None:
        for p in range(seq.computed):
            got = self.slots[seq.blocks[p // BS]][p % BS]
            assert got == tuple(seq.tokens[:p + 1]), (seq.request_id, p)


def _advance(sched: Scheduler, cache: FakeCache, rng: random.Random) -> tuple[int, int]:
    """One engine step on the simulated cache: (requests finished, requests preempted)."""
    step = sched.schedule()
    srcs, dsts = {s for s, _ in step.copies}, {d for _, d in step.copies}
    assert not srcs & dsts, "a block copied from and to in one step"
    cache.apply(step)
    sched.finish_chunks(step)
    finished = 0
    for seq, _ in step.chunks:
        if seq.computed == len(seq.tokens):  # its chunk reached the end: a new token
            seq.tokens.append(rng.randrange(1, 50))
            if len(seq.generated) >= seq.params.max_new_tokens:
                sched.finish(seq)
                finished += 1
    for seq in sched.running:
        cache.check(seq)
    held = [b for s in sched.running for b in s.blocks]
    assert sum(sched.pool.refs) == len(held), "reference counts do not match the tables"
    assert sched.pool.num_used == len(set(held))
    assert not set(held) & set(sched.pool.free), "a block both held and free"
    return finished, len(step.preempted)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_request_keeps_its_own_keys_through_sharing_and_preemption(preemption, seed):
    rng = random.Random(seed)
    pool = BlockPool(40, BS, prefix_sharing=True)
    sched = Scheduler(pool, max_num_seqs=6, max_batch_tokens=24, preemption=preemption)
    cache = FakeCache(pool.num_blocks)
    system = [rng.randrange(1, 50) for _ in range(10)]
    added = finished = preempted = 0
    for step_no in range(600):
        if step_no < 400 and rng.random() < 0.3:
            head = system if rng.random() < 0.5 else []
            prompt = head + [rng.randrange(1, 50) for _ in range(rng.randint(1, 20))]
            sched.add(Sequence(f"r{step_no}", list(prompt), len(prompt),
                               SamplingParams(max_new_tokens=rng.randint(1, 25))))
            added += 1
        if step_no < 400 or sched.has_work:
            done, out = _advance(sched, cache, rng)
            finished, preempted = finished + done, preempted + out
    assert finished == added and pool.num_used == 0 and not pool.claims
    assert preempted > 0 and pool.hits > 0
    print(f"{preemption} seed {seed}: {finished} finished, {preempted} preempted, "
          f"{pool.hits} prefix blocks shared")


def test_a_scattered_sequence_moves_to_consecutive_blocks_with_its_keys():
    """Blocks 5, 2, 9 (as a crowded pool leaves them) become a run, keys copied over; a
    sequence holding a shared block, and one whose block this step's copies fill, stay."""
    from kernels_runtime.inference.scheduler import ScheduledStep

    pool = BlockPool(16, BS, prefix_sharing=True)
    sched = Scheduler(pool, max_num_seqs=4, max_batch_tokens=64)
    cache = FakeCache(pool.num_blocks)
    scattered = Sequence("scattered", list(range(1, 11)), 10, SamplingParams(max_new_tokens=8))
    scattered.blocks = [pool._take(b) for b in (5, 2, 9)]
    scattered.computed = 10
    sharer = Sequence("sharer", list(range(1, 11)), 10, SamplingParams(max_new_tokens=8))
    sharer.blocks = [pool._take(11), pool._take(13)]
    pool.share(11)  # another request holds it too
    sharer.computed = 6
    for seq in (scattered, sharer):
        seq.status = "running"
        sched.running.append(seq)
        for p in range(seq.computed):
            cache.slots[seq.blocks[p // BS]][p % BS] = tuple(seq.tokens[:p + 1])
    step = ScheduledStep()
    sched._compact(step)
    cache.apply(step)
    first = scattered.blocks[0]
    assert scattered.blocks == [first, first + 1, first + 2] and first not in (5, 2, 9)
    cache.check(scattered)
    assert sharer.blocks == [11, 13]  # holds a shared block: not moved
    assert pool.refs[5] == pool.refs[2] == pool.refs[9] == 0  # old blocks released
    # a sequence whose blocks this step's copies fill is not moved before they are there
    pool.release(11)
    step = ScheduledStep(copies=[(15, 11)])
    sched._compact(step)
    assert sharer.blocks == [11, 13]
