"""The scheduler split into micro-batch groups, for a pipeline with several batches in flight.

Under pipeline overlap (``pipelined.py``) a micro-batch is scheduled while the ones before it
are still on later stages, their tokens not sampled yet. Scheduling it must not touch them: a
sequence in flight cannot be given another chunk, preempted or moved. So the running sequences
are split into disjoint groups, one ``Scheduler`` each, and a micro-batch is one group's step:
its next step depends only on its own results (as vLLM's virtual engines under pp).

The groups share the block pool and the waiting and swapped queues: a request is admitted by
whichever group schedules next with room (first come, first served, as one scheduler would),
and a sequence preempted by one group may come back in another. Each group schedules up to
``max_num_seqs`` sequences and ``max_batch_tokens`` tokens, the limits of one forward: a stage
runs the same batch per forward as without overlap, and the pipeline holds P of them (as vLLM's
virtual engines, each with the scheduler's limits; halving the batch instead would double the
forwards, whose fixed cost dominates small batches, and win nothing). The KV memory stays one
pool: when it runs short, groups preempt as one scheduler does. Every rank of a replica makes
the same calls in the same order (one group per tick, its commit before its next schedule), so
their schedulers stay identical.
"""

from __future__ import annotations

from collections import deque

from kernels_runtime.inference.blocks import BlockPool
from kernels_runtime.inference.scheduler import ScheduledStep, Scheduler
from kernels_runtime.inference.sequence import RUNNING, Sequence


class MicroBatchScheduler:
    """``Scheduler``'s interface over ``groups`` schedulers sharing one pool and queues; the
    engine's ``finish``, ``stats`` and the like see all groups, ``schedule(group)`` one."""

    def __init__(self, pool: BlockPool, max_num_seqs: int, max_batch_tokens: int,
                 preemption: str, groups: int) -> None:
        if groups < 1:
            raise ValueError(f"micro-batch groups must be >= 1, got {groups}")
        self.groups = [Scheduler(pool, max_num_seqs, max_batch_tokens, preemption)
                       for _ in range(groups)]
        waiting: deque[Sequence] = deque()
        swapped: deque[Sequence] = deque()
        for group in self.groups:
            group.waiting, group.swapped = waiting, swapped
        self.pool, self.block_size, self.preemption = pool, pool.block_size, preemption
        self.max_num_seqs, self.max_batch_tokens = max_num_seqs, max_batch_tokens
        self.watermark = self.groups[0].watermark

    @property
    def waiting(self) -> deque[Sequence]:
        return self.groups[0].waiting

    @property
    def swapped(self) -> deque[Sequence]:
        return self.groups[0].swapped

    @property
    def running(self) -> list[Sequence]:
        return [seq for group in self.groups for seq in group.running]

    @property
    def preemptions(self) -> int:
        return sum(group.preemptions for group in self.groups)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.swapped) or any(g.running for g in self.groups)

    def blocks_needed(self, tokens: int) -> int:
        return self.groups[0].blocks_needed(tokens)

    def add(self, seq: Sequence) -> None:
        self.groups[0].add(seq)  # the shared queue

    def schedule(self, group: int = 0) -> ScheduledStep:
        """Group ``group``'s next micro-batch."""
        return self.groups[group].schedule()

    def finish_chunks(self, step: ScheduledStep) -> None:
        self.groups[0].finish_chunks(step)  # touches only the step's sequences and the pool

    def finish(self, seq: Sequence) -> None:
        for group in self.groups:
            if seq.status == RUNNING and seq in group.running:
                group.finish(seq)
                return
        self.groups[0].finish(seq)  # waiting or swapped: the shared queues
