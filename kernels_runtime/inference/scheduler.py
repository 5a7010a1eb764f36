"""Continuous batching: which tokens of which requests one forward computes.

Every step the scheduler fills a token budget (``max_batch_tokens``) with, in order:

1. one token for every running sequence that is decoding, and the next chunk of every running
   sequence still in its prompt, oldest first. A sequence that needs a new block when none is
   free takes one from the newest running sequence, which is preempted: its blocks are freed and
   it is recomputed later from its tokens (``preemption="recompute"``), or its blocks are copied
   to host memory and copied back when there is room (``"swap"``);
2. swapped sequences, back into the cache when nothing was preempted this step;
3. waiting requests, first come first served, as long as the budget, ``max_num_seqs`` and the
   free blocks allow; a prompt longer than what is left of the budget is cut into chunks that
   run over several steps beside the others' decodes (SplitFuse), so a long prompt never stalls
   every other stream for a whole forward of its own.

Requests join and leave at every step. The scheduler is deterministic: every rank of a replica
runs its own copy on the same inputs and reaches the same decisions, so the only things ranks
exchange are activations and the sampled tokens.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kernels_runtime.inference.blocks import BlockPool
from kernels_runtime.inference.sequence import FINISHED, RUNNING, SWAPPED, WAITING, Sequence

PREEMPTION_MODES = ("recompute", "swap")


@dataclass
class ScheduledStep:
    chunks: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, new tokens)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) copy on write
    swap_out: list[tuple[Sequence, list[int]]] = field(default_factory=list)  # save first
    swap_in: list[tuple[Sequence, list[int]]] = field(default_factory=list)  # load after
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.chunks)


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_batch_tokens: int,
                 preemption: str = "recompute") -> None:
        if preemption not in PREEMPTION_MODES:
            raise ValueError(f"preemption must be one of {PREEMPTION_MODES}, got {preemption!r}")
        self.pool, self.block_size = pool, pool.block_size
        self.max_num_seqs, self.max_batch_tokens = max_num_seqs, max_batch_tokens
        self.preemption = preemption
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.preemptions = 0  # cumulative
        # admitting a new request leaves this many blocks free while others run, so the
        # running ones can grow a step or two without preempting at once
        self.watermark = max(1, pool.num_blocks // 100)

    def add(self, seq: Sequence) -> None:
        seq.status = WAITING
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def blocks_needed(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # ---- one step -------------------------------------------------------------------------
    def schedule(self) -> ScheduledStep:
        step = ScheduledStep()
        budget = self.max_batch_tokens
        queue, kept = list(self.running), []
        while queue:
            seq = queue.pop(0)
            n = min(seq.to_compute, budget)
            if n == 0:
                kept.append(seq)
                continue
            while not self._reserve(seq, n, step):
                victim = queue.pop() if queue else seq
                self._preempt(victim, step)
                if victim is seq:
                    break
            else:
                step.chunks.append((seq, n))
                budget -= n
                kept.append(seq)
        self.running = kept
        if step.preempted:
            return step
        while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.swapped[0]
            saved = len(seq.swapped_out_blocks)
            n = min(seq.to_compute, budget)
            if self.pool.num_free < saved + self._new_blocks(seq, n, saved):
                break
            self.swapped.popleft()
            seq.blocks = []
            for i in range(saved):
                seq.blocks.append(self._allocate(seq, i))
            step.swap_in.append((seq, list(seq.blocks)))
            seq.swapped_out_blocks = []
            self._reserve(seq, n, step)
            self._run(seq, n, step)
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs \
                and not self.swapped:
            seq = self.waiting[0]
            if not seq.blocks:
                self._take_prefix(seq)
            n = min(seq.to_compute, budget)
            spare = self.watermark if self.running else 0
            if self.pool.num_free < self._new_blocks(seq, n, len(seq.blocks)) + spare \
                    or not self._reserve(seq, n, step):
                self._drop_blocks(seq)  # its prefix hits go back; they are taken again later
                break
            self.waiting.popleft()
            self._run(seq, n, step)
            budget -= n
        self._compact(step)
        return step

    def _compact(self, step: ScheduledStep, most: int = 4) -> None:
        """Move up to ``most`` running sequences whose blocks are scattered (their keys are
        gathered every step) into runs of consecutive blocks (read in place from then on):
        one copy instead of a gather per step. Last in the step, and the old blocks freed
        only after every move, so no block is both copied from and to in one step. Sequences
        holding shared blocks stay where they are (moving would unshare them), and so do those
        whose blocks are filled by this step's copies or swap-ins (not there yet to move)."""
        freed: list[int] = []
        filling = {dst for _, dst in step.copies}
        filling.update(b for _, blocks in step.swap_in for b in blocks)
        for seq in self.running:
            if most == 0:
                break
            blocks = seq.blocks
            if len(blocks) < 2 or blocks == list(range(blocks[0], blocks[0] + len(blocks))) \
                    or any(self.pool.refs[b] > 1 or b in filling for b in blocks):
                continue
            expect = self.blocks_needed(seq.total_len_bound())
            run = self.pool.allocate_run(id(seq), len(blocks), expect)
            if run is None:
                continue
            step.copies += list(zip(blocks, run))
            freed += blocks
            seq.blocks = run
            most -= 1
        self.pool.release_all(freed)

    def finish_chunks(self, step: ScheduledStep) -> None:
        """After the forward: the chunks' keys and values are in the cache."""
        for seq, n in step.chunks:
            seq.computed += n
            self._index_full_blocks(seq)

    def finish(self, seq: Sequence) -> None:
        """``seq`` is done (finished, aborted): its blocks go back to the pool."""
        if seq.status == RUNNING:
            self.running.remove(seq)
        elif seq.status == WAITING:
            self.waiting.remove(seq)
        elif seq.status == SWAPPED:
            self.swapped.remove(seq)
            seq.swapped_out = None
        self._drop_blocks(seq)
        seq.status = FINISHED

    # ---- blocks ---------------------------------------------------------------------------
    def _new_blocks(self, seq: Sequence, n: int, held: int) -> int:
        return max(0, self.blocks_needed(seq.computed + n) - held)

    def _reserve(self, seq: Sequence, n: int, step: ScheduledStep) -> bool:
        """Blocks for ``seq``'s next ``n`` tokens (a shared block about to be written is copied
        first); False, taking nothing, when too few are free."""
        new = self._new_blocks(seq, n, len(seq.blocks))
        first = seq.computed // self.block_size  # the block the chunk starts writing in
        shared = first < len(seq.blocks) and self.pool.refs[seq.blocks[first]] > 1
        if self.pool.num_free < new + shared:
            return False
        if shared:
            old, fresh = seq.blocks[first], self._allocate(seq, first)
            step.copies.append((old, fresh))
            self.pool.release(old)
            seq.blocks[first] = fresh
        for _ in range(new):
            seq.blocks.append(self._allocate(seq, len(seq.blocks)))
        return True

    def _allocate(self, seq: Sequence, index: int) -> int:
        """A block for logical block ``index`` of ``seq``, after its previous one if it can
        be (consecutive blocks are read in place; ``blocks.py``)."""
        after = seq.blocks[index - 1] if index > 0 else None
        expect = self.blocks_needed(seq.total_len_bound()) - index
        return self.pool.allocate(id(seq), after, max(1, expect))

    def _take_prefix(self, seq: Sequence) -> None:
        """Full blocks of ``seq``'s tokens already in the cache become its first blocks. At
        least the last token is computed again (its logits are needed), in a copy of its block
        if that block is shared."""
        size, previous = self.block_size, seq.prefix_root
        seq.hashes = []
        for start in range(0, len(seq.tokens) - size + 1, size):
            block, h = self.pool.lookup(previous, seq.tokens[start:start + size])
            if block is None:
                break
            self.pool.share(block)
            seq.blocks.append(block)
            seq.hashes.append(h)
            previous = h
        seq.computed = min(len(seq.blocks) * size, len(seq.tokens) - 1)
        if seq.preemptions == 0 and not seq.prefix_hit_tokens:  # saved by sharing, counted
            seq.prefix_hit_tokens = seq.computed  # once (not its own recompute, not retries)
            self.pool.hits += len(seq.blocks)

    def _index_full_blocks(self, seq: Sequence) -> None:
        size = self.block_size
        for i in range(len(seq.hashes), seq.computed // size):
            previous = seq.hashes[i - 1] if i else seq.prefix_root
            seq.hashes.append(self.pool.register(seq.blocks[i], previous,
                                                 seq.tokens[i * size:(i + 1) * size]))

    def _drop_blocks(self, seq: Sequence) -> None:
        self.pool.unclaim(id(seq))
        self.pool.release_all(seq.blocks)
        seq.blocks, seq.hashes, seq.computed = [], [], 0

    def _run(self, seq: Sequence, n: int, step: ScheduledStep) -> None:
        seq.status = RUNNING
        self.running.append(seq)
        step.chunks.append((seq, n))

    def _preempt(self, seq: Sequence, step: ScheduledStep) -> None:
        """Free ``seq``'s blocks for older sequences: swap them to host, or drop them and
        recompute later (a prompt still in its first chunks is always recomputed)."""
        if seq in self.running:
            self.running.remove(seq)
        seq.preemptions += 1
        self.preemptions += 1
        step.preempted.append(seq)
        step.chunks = [(s, n) for s, n in step.chunks if s is not seq]
        if self.preemption == "swap" and seq.computed > 0:
            step.swap_out.append((seq, list(seq.blocks)))
            seq.swapped_out_blocks = list(seq.blocks)
            self.pool.unclaim(id(seq))
            self.pool.release_all(seq.blocks)
            seq.blocks = []
            seq.status = SWAPPED
            self.swapped.append(seq)
        else:
            self._drop_blocks(seq)
            seq.status = WAITING
            self.waiting.appendleft(seq)
