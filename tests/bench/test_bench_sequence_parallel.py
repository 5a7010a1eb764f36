"""Sequence parallelism holds a 4x longer sequence under the same per-rank activation memory.

What is protected (the counts behind ``python -m bench sequence_parallel --quick``, no timing):
on 4 real gloo ranks, the bytes autograd saves for backward on the rank saving most, for b
sequences of 4s tokens under sp=4, against b sequences of s tokens per rank without sequence
parallelism: ring attention within 5% and Ulysses within 10% (it also keeps the repeated
key/value heads and its all-to-all outputs); at the short length s, sp=4 keeps under 30% of it.
"""

from __future__ import annotations

import pytest

from bench.sequence_parallel.run import parse, saved_bytes


@pytest.mark.slow
def test_a_four_times_longer_sequence_fits_in_the_same_activation_memory(ranks):
    from helpers.distributed import process_comm

    args = parse(["--quick"])
    pool = ranks(4)

    def total(plan: str, seq: int) -> int:
        return max(r["total"] for r in pool.run(saved_bytes, args, plan, seq, process_comm,
                                                timeout_s=300))

    base = total("dp=4", args.seq)
    ring = total("sp=4 sp_mode=ring", 4 * args.seq)
    ulysses = total("sp=4 sp_mode=all_to_all", 4 * args.seq)
    short = total("sp=4 sp_mode=ring", args.seq)
    assert ring / base <= 1.05, (ring, base)
    assert ulysses / base <= 1.10, (ulysses, base)
    assert short / base <= 0.30, (short, base)
